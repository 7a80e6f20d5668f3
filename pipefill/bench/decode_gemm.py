"""The small-M decode GEMM alone (pipefill.kernels.decode_gemm), per weight shape of the default
model and per row count M: ms per call, GB/s of weights streamed and GFLOP/s, against two
ceilings measured in the same run:

* copy bandwidth: torch `copy_` of a 512 MiB buffer (read + write bytes per second);
* in-cache compute: the same kernel on a matrix small enough to stay in L2 (576 x 336), at the
  largest M asked: the GFLOP/s the kernel's inner loop reaches when memory is not the limit.

Weights are streamed from memory as in a real decode step: each timed call uses the next of
enough copies of the matrix to exceed the last-level cache, so no call finds its weights cached.
The ratio M / 1 of the time per call is what a batch costs over a single sequence (1.0 = the
weights are read once and the extra rows are free). The M values of a shape are timed in
turn, round after round (medians of 5), so the ratios hold while the machine's speed drifts.

``--gguf-type Q4_K`` (any type kernels.gguf_blocks reads) times the quantized decode GEMM
(pipefill.kernels.quant_gemm) on random blocks of that type instead: by default its integer
path (int8 activations, integer dot products), with --isa one of its paths (int8-avx512vnni,
int8-avx2, or avx512/avx2/scalar: the blocks dequantized to float32 in registers);
``--shape-set gemma3-270m`` takes Gemma 3 270M's shapes (a shape whose K is not whole blocks
of the type is skipped, as the loader keeps it dequantized; Q4_K_M files use Q5_0/Q8_0
there). ``--gguf-type FP8_E4M3`` times it on random FP8 e4m3 codes with 128 x 128 block
scales (kernels.fp8_blocks: one byte a weight), against bf16's packed copies of the same
shapes without it; ``--shape-set deepseek-v2-lite`` takes DeepSeek-V2-Lite's matrices (one
routed expert's).

    python -m pipefill.bench.decode_gemm --rows 1,2,4,8,16 --threads 2 --isa avx512bf16
    python -m pipefill.bench.decode_gemm --rows 1,8 --threads 2 --gguf-type Q4_K \
        --shape-set gemma3-270m
    python -m pipefill.bench.decode_gemm --rows 1,8 --gguf-type FP8_E4M3 \
        --shape-set deepseek-v2-lite

``--prefill-vs-int8 [GGUF]`` measures prefill instead (pipefill.bench.gguf_prefill): a GGUF
file's layers as the engine holds them, dequantize + GEMM against the integer path, with
their errors against float64 (what QuantLinear.int8_prefills' default rests on):

    python -m pipefill.bench.decode_gemm --prefill-vs-int8 --dtype bfloat16
    python -m pipefill.bench.decode_gemm --prefill-vs-int8 model.gguf --prefill-threads 1
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pipefill.bench import gguf_prefill
from pipefill.kernels import decode_gemm as dg
from pipefill.kernels import fp8_blocks
from pipefill.kernels import quant_gemm as qg
from pipefill.kernels.gguf_blocks import BLOCK_TYPES, random_blocks, supports
from pipefill.base.platform import cpu_name

# (name, K, N) of SmolLM2-135M (hidden 576, intermediate 1536, 9 query / 3 KV heads of 64).
SHAPES = [("qkv", 576, 960), ("o_proj", 576, 576), ("gate_up", 576, 3072),
          ("down", 1536, 576), ("lm_head", 576, 49152)]
# Gemma 3 270M (hidden 640, intermediate 2048, 4 query / 1 KV heads of 256, 262,144 tokens).
GEMMA3_SHAPES = [("qkv", 640, 1536), ("o_proj", 1024, 640), ("gate_up", 640, 4096),
                 ("down", 2048, 640), ("lm_head", 640, 262144)]
# DeepSeek-V2-Lite (hidden 2048, 16 heads of 128 + 64 rope, latent 512 + 64, experts 1408
# wide, 102,400 tokens): q_proj with kv_a_proj_with_mqa, o_proj, one routed expert, the head.
DEEPSEEK_V2_LITE_SHAPES = [("qkv", 2048, 16 * 192 + 576), ("o_proj", 2048, 2048),
                           ("gate_up", 2048, 2 * 1408), ("down", 1408, 2048),
                           ("lm_head", 2048, 102400)]
SHAPE_SETS = {"smollm2": SHAPES, "gemma3-270m": GEMMA3_SHAPES,
              "deepseek-v2-lite": DEEPSEEK_V2_LITE_SHAPES}
GGUF_TYPES = {name: qtype for qtype, (name, _, _) in BLOCK_TYPES.items()}
FP8 = fp8_blocks.NAME  # --gguf-type's FP8 choice: not a GGUF type, the same kernel
STREAM_BYTES = 256 << 20  # copies of a matrix rotate through at least this many bytes
PREFILL_ROWS = "16,32,64,128,512,2048"  # --prefill-vs-int8's default M
CLOCK = time.perf_counter  # --cpu-clock: time.thread_time (one thread; a shared CPU)


def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(reps):
        t0 = CLOCK()
        b.copy_(a)
        best = min(best, CLOCK() - t0)
    return 2 * nbytes / best


def _round(mats: list, x: torch.Tensor, out: torch.Tensor, seconds: float) -> float:
    """Seconds per call over at least `seconds`, cycling through the copies in `mats`."""
    n, t0 = 0, CLOCK()
    while True:
        for p in mats:
            p(x, out=out)
        n += len(mats)
        el = CLOCK() - t0
        if el >= seconds:
            return el / n


def time_calls(mats: list, x: torch.Tensor, out: torch.Tensor, min_s: float) -> float:
    """Seconds per call (median of 5 rounds), cycling through the copies in `mats`."""
    return time_interleaved(mats, [(x, out)], min_s)[0]


def time_interleaved(mats: list, cases: list, min_s: float, rounds: int = 5) -> list[float]:
    """Seconds per call of each (x, out) case: the median of `rounds` rounds that visit the
    cases in turn, so a drift of the machine's speed reaches every case alike (the M / 1
    ratios are what the bench is for)."""
    for x, out in cases:
        for p in mats[:2]:
            p(x, out=out)
    times = [[] for _ in cases]
    for _ in range(rounds):
        for t, (x, out) in zip(times, cases):
            t.append(_round(mats, x, out, min_s / rounds))
    return [sorted(t)[len(t) // 2] for t in times]


def make_linear(k: int, n: int, isa: str, x_dtype, w_dtype, gguf_type: str | None,
                max_rows: int, seed: int = 0):
    """One matrix on the kernel being timed: packed float32/bf16 weights (decode_gemm), or
    random GGUF blocks of gguf_type or FP8 codes with block scales (quant_gemm); an isa
    int8-<path> is quant_gemm's integer path (GGUF blocks)."""
    disable = tuple(i for i in qg.ISAS if i != isa) + ("int8",)
    if isa.startswith("int8-"):
        disable = tuple(f"int8-{p}" for p in qg.INT8_PATHS if f"int8-{p}" != isa)
    if gguf_type == FP8:
        codes, scale = fp8_blocks.quantize(
            torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
        return qg.QuantLinear.from_fp8([(codes, scale)], k, max_rows=max_rows, disable=disable)
    if gguf_type is not None:
        qtype = GGUF_TYPES[gguf_type]
        raw = random_blocks(qtype, n, k, np.random.default_rng(seed))
        return qg.QuantLinear.from_parts([(raw, qtype)], k, max_rows=max_rows, disable=disable)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(w_dtype)
    return dg.pack(w, None, x_dtype, w_dtype, max_rows=max_rows,
                   disable=tuple(i for i in dg.ISAS if i != isa))


def bench_shape(k: int, n: int, rows: list[int], isa: str, x_dtype, w_dtype, min_s: float,
                gguf_type: str | None = None, stream_bytes: int = STREAM_BYTES):
    first = make_linear(k, n, isa, x_dtype, w_dtype, gguf_type, max(rows))
    copies = max(1, -(-stream_bytes // first.nbytes))
    mats = [first] + [make_linear(k, n, isa, x_dtype, w_dtype, gguf_type, max(rows), seed=c)
                      for c in range(1, copies)]
    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(m, k, generator=g).to(x_dtype), torch.empty(m, n, dtype=x_dtype))
             for m in rows]
    times = time_interleaved(mats, cases, min_s)
    return first.nbytes, [(m, s, first.nbytes / s, 2 * m * k * n / s)
                          for m, s in zip(rows, times)]


def in_cache_gflops(isa, x_dtype, w_dtype, m: int, min_s: float,
                    gguf_type: str | None = None) -> float:
    # 7 whole groups of 48; 0.4 MB bf16 / 0.8 MB float32, less as blocks: stays in L2. K is
    # 512 for blocks (whole blocks of every type).
    k, n = (576 if gguf_type is None else 512), 336
    p = make_linear(k, n, isa, x_dtype, w_dtype, gguf_type, m)
    x = torch.randn(m, k).to(x_dtype)
    out = torch.empty(m, n, dtype=x_dtype)
    return 2 * m * k * n / time_calls([p] * 64, x, out, min_s) / 1e9


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rows", default=None,
                    help="comma-separated M (default 1,2,4,8,16; --prefill-vs-int8: "
                         f"{PREFILL_ROWS})")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--isa", default=None, help="one of " + ", ".join(dg.ISAS) +
                    " (default: the best usable for the dtypes)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="activations (compute) dtype")
    ap.add_argument("--weight-dtype", default=None, choices=("bfloat16", "float32"),
                    help="packed weights dtype (default: the compute dtype)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                    help="subset of " + ",".join(s[0] for s in SHAPES))
    ap.add_argument("--shape-set", default="smollm2", choices=tuple(SHAPE_SETS),
                    help="whose matrix shapes: the default model's, Gemma 3 270M's or "
                         "DeepSeek-V2-Lite's")
    ap.add_argument("--gguf-type", default=None, choices=(*GGUF_TYPES, FP8),
                    help="time the quantized decode GEMM on random GGUF blocks of this type, "
                         f"or {FP8}: FP8 e4m3 codes with 128x128 block scales "
                         "(--isa then one of " + ", ".join(qg.ISAS) + ", or for GGUF blocks "
                         "the integer path: " + ", ".join(f"int8-{p}" for p in qg.INT8_PATHS)
                         + "; default: the integer path where it runs)")
    ap.add_argument("--stream-mb", type=int, default=STREAM_BYTES >> 20,
                    help="copies of each matrix rotate through at least this many MiB (more "
                         "than the last-level cache, so that no call finds its weights cached)")
    ap.add_argument("--min-s", type=float, default=0.5, help="seconds timed per (shape, M)")
    ap.add_argument("--prefill-vs-int8", nargs="?", const="", default=None, metavar="GGUF",
                    help="instead: prefill on GGUF blocks two ways, a .gguf file's layers as "
                         "the engine holds them (default: the default model's): dequantize + "
                         "torch's GEMM against the integer path's 16-row kernel, interleaved, "
                         "at --rows (here 16,32,64,128,512,2048 unless given) in --dtype, with "
                         "each one's error against float64 (bench/gguf_prefill.py)")
    ap.add_argument("--prefill-threads", default="2,1",
                    help="--prefill-vs-int8: comma-separated thread counts (1: CPU time)")
    ap.add_argument("--pairs", type=int, default=9,
                    help="--prefill-vs-int8: interleaved pairs timed per (layer, M, threads)")
    ap.add_argument("--cpu-clock", action="store_true",
                    help="time with this thread's CPU time instead of the wall clock (needs "
                    "--threads 1): on a CPU shared with other jobs, time spent descheduled is "
                    "not counted (memory bandwidth is still shared)")


def add_parser(sub) -> None:
    p = sub.add_parser("decode-gemm", help="the small-M decode GEMM alone, per shape and M",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(run=run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(ns: argparse.Namespace) -> int:
    global CLOCK
    if ns.cpu_clock:
        if ns.threads != 1:
            raise ValueError("--cpu-clock needs --threads 1 (other threads' time is not seen)")
        CLOCK = time.thread_time
    rows = [int(r) for r in (ns.rows or (PREFILL_ROWS if ns.prefill_vs_int8 is not None
                                         else "1,2,4,8,16")).split(",")]
    if not rows or min(rows) < 1:
        raise ValueError("--rows: positive integers, comma-separated")
    x_dtype = getattr(torch, ns.dtype)
    if ns.prefill_vs_int8 is not None:
        threads = [int(t) for t in ns.prefill_threads.split(",")]
        if not threads or min(threads) < 1 or ns.pairs < 1:
            raise ValueError("--prefill-threads: positive integers; --pairs: at least 1")
        gguf_prefill.run_compare(ns.prefill_vs_int8 or None, rows, threads, x_dtype, ns.pairs)
        return 0
    torch.set_num_threads(ns.threads)
    w_dtype = getattr(torch, ns.weight_dtype or ns.dtype)
    kernel = qg if ns.gguf_type else dg
    fp8 = ns.gguf_type == FP8
    isa = ns.isa or (qg.choose_isa(fp8=fp8)[0] if ns.gguf_type
                     else dg.choose_isa(x_dtype, w_dtype)[0])
    status = qg.fp8_isa_status() if fp8 else kernel.isa_status()
    if ns.gguf_type and not fp8:
        status = {**status, **{f"int8-{p}": s for p, s in qg.int8_status().items()}}
        if ns.isa is None and qg.choose_int8()[0]:
            isa = f"int8-{qg.choose_int8()[0]}"
    if isa is None or not status.get(isa, (False,))[0]:
        raise ValueError(f"--isa {isa}: not usable here ({status})")
    weights = ns.gguf_type or w_dtype
    bw = copy_bandwidth()
    peak = in_cache_gflops(isa, x_dtype, w_dtype, max(rows), ns.min_s, ns.gguf_type)
    print(f"{cpu_name()}, {ns.threads} threads, {'CPU' if ns.cpu_clock else 'wall'} clock, isa {isa}, x {ns.dtype}, weights {weights}; "
          f"copy bandwidth {bw / 1e9:.1f} GB/s (read + write); in-cache kernel "
          f"{peak:.1f} GFLOP/s at M = {max(rows)}")
    print("| shape (K x N) | MB | M | ms/call | x M=1 | weights GB/s | % copy bw | GFLOP/s "
          "| % in-cache |")
    print("|---|---|---|---|---|---|---|---|---|")
    wanted = ns.shapes.split(",")
    for name, k, n in SHAPE_SETS[ns.shape_set]:
        if name not in wanted:
            continue
        if ns.gguf_type and not fp8 and not supports(GGUF_TYPES[ns.gguf_type], k):
            print(f"| {name} {k}x{n} | skipped: K is not whole {ns.gguf_type} blocks |")
            continue
        nbytes, res = bench_shape(k, n, rows, isa, x_dtype, w_dtype, ns.min_s, ns.gguf_type,
                                  ns.stream_mb << 20)
        base = res[0][1]
        for m, s, gbs, flops in res:
            print(f"| {name} {k}x{n} | {nbytes / 1e6:.2f} | {m} | {s * 1e3:.3f} | "
                  f"{s / base:.2f} | {gbs / 1e9:.1f} | {100 * gbs / bw:.0f} | "
                  f"{flops / 1e9:.1f} | {100 * flops / 1e9 / peak:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
