"""Prefill on GGUF blocks, the two ways (``pipefill bench decode-gemm --prefill-vs-int8``): a
real GGUF file's linear layers, as the engine holds them (kernels.quant_gemm.QuantLinear, one
per distinct layer name, block types and shape, and the LM head), at prefill row counts M:

* dequantize + GEMM: the matrix dequantized into the compute dtype for the call, then torch's
  F.linear (oneDNN for bfloat16, MKL's sgemm for float32): QuantLinear.prefill_dequantized;
* int8: the activations quantized per row in blocks of 32 and multiplied on the integer path's
  16-row kernel (VNNI or AVX2), as decode runs it: QuantLinear.prefill_int8.

Each (layer, M) times the two interleaved, `--pairs` pairs in one process (the order flipped
every pair), at each of --prefill-threads: 1 thread on this thread's CPU time (what a shared
CPU's other jobs do not distort), more on the wall clock; medians of the times and of the
per-pair ratio dequantize / int8 (> 1: int8 is faster). The error of each against float64
(the file's exact weights times the same x, in float64): ||y - ref|| / ||ref|| and
max |y - ref| / max |ref|; a head wider than 16,384 rows is checked on 16,384 of them, and
timed only where M x N <= 2^25 (the engine computes logits for the rows that need them).
"""
from __future__ import annotations

import time

import torch

from pipefill.model.loader import WeightSource, load_stage_weights, resolve_model_path

HEAD_ELEMENTS = 1 << 25  # the head is timed up to M x vocab of this many outputs
CHECKED_ROWS = 16384  # output rows a wide head's error is measured on


def model_linears(path: str | None, dtype: torch.dtype) -> list[tuple[str, object]]:
    """(label, QuantLinear) of each distinct (name, block types, shape) of the file's layers,
    then the LM head, as the engine loads them (every layer read, blocks kept)."""
    source = WeightSource(resolve_model_path(path))
    weights = load_stage_weights(source, range(source.config.num_layers), True, True, dtype,
                                 blocks=True)
    seen = {}
    for layer in weights.layers:
        for name, q in (layer.packed or {}).items():
            seen.setdefault((name, q.types, q.shape), q)
    out = [(name, q) for (name, _, _), q in seen.items()]
    if weights.lm_head_quant is not None:
        out.append(("lm_head", weights.lm_head_quant))
    return out


def reference_rows(q) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(float64 weights, the output rows they are) the error is measured on: all rows, or a
    spread of CHECKED_ROWS of a wide single-part head (dequantized from their own blocks)."""
    if q.out_features <= CHECKED_ROWS or len(q.parts) != 1:
        return q.dequantize(torch.float32).double(), None
    ids = torch.linspace(0, q.out_features - 1, CHECKED_ROWS).long()
    return q.rows(ids, torch.float32).double(), ids


def errors(y: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor | None) -> tuple[float, float]:
    """(||y - ref|| / ||ref||, max |y - ref| / max |ref|) on the checked output rows."""
    y = (y if ids is None else y[:, ids]).double()
    d = y - ref
    return (d.norm() / ref.norm()).item(), (d.abs().max() / ref.abs().max()).item()


def time_pairs(a, b, x: torch.Tensor, pairs: int, threads: int) -> tuple[float, float, float]:
    """(median seconds of a, of b, median of the per-pair ratios a / b), a and b called in
    turn (the order flipped every pair) on `threads` threads."""
    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    a(x), b(x)  # warm-up: kernel builds, oneDNN primitives, scratch
    ta, tb = [], []
    for i in range(pairs):
        for fn, times in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
            t0 = clock()
            fn(x)
            times.append(clock() - t0)
    ratios = sorted(p / q for p, q in zip(ta, tb))
    return _median(ta), _median(tb), ratios[len(ratios) // 2]


def _median(v: list[float]) -> float:
    return sorted(v)[len(v) // 2]


def run_compare(path: str | None, rows: list[int], threads: list[int], dtype: torch.dtype,
                pairs: int) -> None:
    """Prints the table (markdown) of every layer of the file at every M and thread count."""
    linears = model_linears(path, dtype)
    path_name = linears[0][1].int8 if linears else None
    if path_name is None:
        raise ValueError("--prefill-vs-int8: the integer path does not run here (or the "
                         "file's layers are not kept as blocks)")
    print(f"{resolve_model_path(path)}: x {str(dtype).removeprefix('torch.')}, int8 on "
          f"{path_name}, {pairs} interleaved pairs; ratio = dequantize+GEMM / int8 "
          "(> 1: int8 faster); 1 thread on CPU time, more on the wall clock")
    print("| layer | types | N x K | M | threads | dequant+GEMM ms | int8 ms | ratio | "
          "rel err dequant | rel err int8 | max err dequant | max err int8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, q in linears:
        ref_w, ids = reference_rows(q)
        for m in rows:
            if label == "lm_head" and m * q.out_features > HEAD_ELEMENTS:
                continue
            x = torch.randn(m, q.in_features, generator=torch.Generator().manual_seed(m))
            x = x.to(dtype)
            ref = x.double() @ ref_w.T
            e_deq = errors(q.prefill_dequantized(x), ref, ids)
            e_int8 = errors(q.prefill_int8(x), ref, ids)
            del ref
            for t in threads:
                ta, tb, ratio = time_pairs(q.prefill_dequantized, q.prefill_int8, x, pairs, t)
                print(f"| {label} | {q.types} | {q.out_features}x{q.in_features} | {m} | {t} | "
                      f"{ta * 1e3:.3f} | {tb * 1e3:.3f} | {ratio:.2f} | {e_deq[0]:.1e} | "
                      f"{e_int8[0]:.1e} | {e_deq[1]:.1e} | {e_int8[1]:.1e} |", flush=True)
