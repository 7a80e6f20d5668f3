"""`pipefill bench attention`: every fused attention kernel this CPU runs against torch's SDPA
paths, side by side, with the measured matmul peak of the same dtype.

Workload: one sequence, a chunk of `--chunk` queries at the end of `--prefix-lens` cached tokens
(bottom-right causal), `--heads` query heads over `--kv-heads` KV heads, per `--dtypes` entry
(q, K, V and the cache in that dtype; `--kv-cache-dtypes int8,fp8_e4m3` adds runs over a
quantized cache, which the vector kernels widen in the kernel and the SDPA methods read as its
dequantized values, already made: the error columns compare the same values). Methods, timed interleaved (A B C A B C ...) and reported
best-of-N, because this VM's speed drifts:

* amx, avx512bf16, avx512, avx2 — the kernels over the packed paged cache (those the CPU runs
  and that take the dtype: amx and avx512bf16 are bfloat16-only);
* split  — _scaled_dot_product_flash_attention_for_cpu on the prefix (no mask) and on the
           diagonal block (is_causal=True), merged by log-sum-exp (the engine's SDPA path);
* masked — F.scaled_dot_product_attention with a bottom-right causal bool mask;
* peak   — a [4096 x 1024] @ [1024 x 1024] matmul in the same dtype and thread count, timed in
           the same interleaved rounds: "% peak" is kernel TFLOP/s over its TFLOP/s.

TFLOP/s count 4 * Hq * D per visible (query, key) pair. For amx, the kernel's time split comes
from two measurements: rdtsc counters around its QK^T / softmax / PV phases (per 32-row block and
128-key step; `other` = staging, epilogue, scheduling), and "marginal" costs: the time saved
when the phase is skipped (mode bits of chunk_attention_ex; those runs compute garbage).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from pipefill.bench.prefill import parse_ints
from pipefill.kernels.kv_quant import QUANT_KV_DTYPES, as_stored, stored_dim
from pipefill.model.attention import heads_first, split_attention
from pipefill.base.platform import cpu_name


def add_parser(sub) -> None:
    p = sub.add_parser("attention", help="attention kernels vs. SDPA micro-benchmark",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix-lens", default="2048,8192,16384",
                   help="comma-separated prefix lengths (cached tokens before the chunk)")
    p.add_argument("--chunk", type=int, default=2048, help="queries per chunk")
    p.add_argument("--heads", type=int, default=9, help="query heads")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64, choices=(64, 128))
    p.add_argument("--page-size", type=int, default=64, help="KV cache page size (multiple of 32)")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per method (best kept)")
    p.add_argument("--dtypes", default="bfloat16,float32",
                   help="comma-separated dtypes of q, K, V and the cache (bfloat16, float32)")
    p.add_argument("--kv-cache-dtypes", default="same",
                   help="comma-separated KV cache dtypes: same (the q dtype), int8, fp8_e4m3 "
                        "(quantized: the vector kernels only, AMX does not read them)")
    p.add_argument("--no-split-profile", action="store_true",
                   help="skip the QK^T/softmax/PV time split of the AMX kernel")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time; cpu: this process's CPU time / threads (on a shared, "
                        "oversubscribed machine it counts only the cycles the run got)")
    p.add_argument("--json", metavar="FILE", help="write every number to this JSON file")
    p.set_defaults(run=run)


def split_sdpa(q, k, v, prefix_len: int, scale: float) -> torch.Tensor:
    """The engine's SDPA route: prefix without mask + causal diagonal block, merged by LSE."""
    return split_attention(q, k[:prefix_len], v[:prefix_len], k[prefix_len:], v[prefix_len:],
                           scale)


def masked_sdpa(q, k, v, mask, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


KERNELS = ("amx", "avx512bf16", "avx512", "avx2")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def runnable_kernels(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> dict[str, str]:
    """{kernel: "ok" or why not} for every kernel, for q in `dtype` and the cache in kv_dtype
    (None: dtype; int8 / fp8_e4m3: quantized)."""
    from pipefill.kernels.amx_attention import amx_available
    from pipefill.kernels.cpu_attention import kernel_available
    status = {}
    for name in KERNELS:
        if kv_dtype is not None and name == "amx":
            status[name] = "reads bfloat16 pages only"
            continue
        if name in ("amx", "avx512bf16") and dtype != torch.bfloat16:
            status[name] = "bfloat16-only"
            continue
        ok, why = amx_available() if name == "amx" else kernel_available(name)
        status[name] = "ok" if ok else why
    return status


def _quant_kernel_fn(name, q, k, v, page_size, prefix_len, scale, kv_dtype):
    """A vector kernel over a quantized token-major cache holding k, v."""
    from pipefill.kernels import cpu_attention as cpu
    n, hkv, d = k.shape
    npages = math.ceil(n / page_size)
    kc = torch.zeros((npages * page_size, hkv, stored_dim(d, kv_dtype)), dtype=kv_dtype)
    vc = torch.zeros_like(kc)
    table = torch.arange(npages, dtype=torch.int32)
    cpu.write_kv(kc, vc, k, v, table, 0, page_size=page_size)
    out = torch.empty_like(q)
    return (lambda: cpu.chunk_attention(name, q, kc, vc, table, prefix_len, scale, out=out,
                                        page_size=page_size)), (kc, vc, table, out)


def _kernel_fn(name, q, k, v, page_size, prefix_len, scale, kv_dtype=None):
    from pipefill.kernels import amx_attention as amx
    from pipefill.kernels import cpu_attention as cpu
    if kv_dtype is not None:
        return _quant_kernel_fn(name, q, k, v, page_size, prefix_len, scale, kv_dtype)
    n, hkv, d = k.shape
    npages = math.ceil(n / page_size)
    kc, vc = amx.AmxKVCache(1, npages, page_size, hkv, d, k.dtype).layer(0)
    table = torch.arange(npages, dtype=torch.int32)
    out = torch.empty_like(q)
    if name == "amx":
        amx.write_kv(kc, vc, k, v, table, 0)
        return (lambda: amx.chunk_attention(q, kc, vc, table, prefix_len, scale, out=out)), \
            (kc, vc, table, out)
    cpu.write_kv(kc, vc, k, v, table, 0)
    return (lambda: cpu.chunk_attention(name, q, kc, vc, table, prefix_len, scale, out=out)), \
        (kc, vc, table, out)


def bench_case(prefix_len: int, chunk: int, hq: int, hkv: int, d: int, page_size: int,
               threads: list[int], reps: int, profile: bool, dtype: torch.dtype = torch.bfloat16,
               kernels: tuple[str, ...] = (), clock: str = "wall",
               kv_dtype: torch.dtype | None = None) -> list[dict]:
    """kv_dtype: None (the cache in `dtype`) or a quantized dtype (int8, float8_e4m3fn)."""
    gen = torch.Generator().manual_seed(prefix_len)
    n = prefix_len + chunk
    q = torch.randn(chunk, hq, d, generator=gen).to(dtype)
    k = torch.randn(n, hkv, d, generator=gen).to(dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(dtype)
    if kv_dtype is not None:  # every method sees the values the quantized cache holds
        k, v = as_stored(k, kv_dtype), as_stored(v, kv_dtype)
    scale = d ** -0.5
    mask = torch.arange(n).unsqueeze(0) <= (prefix_len + torch.arange(chunk)).unsqueeze(1)
    pairs = chunk * prefix_len + chunk * (chunk + 1) // 2
    flops = 4 * hq * d * pairs
    a = torch.randn(4096, 1024, generator=gen).to(dtype)
    b = torch.randn(1024, 1024, generator=gen).to(dtype)
    methods, extra = {}, {}
    for name in kernels:
        methods[name], extra[name] = _kernel_fn(name, q, k, v, page_size, prefix_len, scale,
                                                kv_dtype)
    methods["split"] = lambda: split_sdpa(q, k, v, prefix_len, scale)
    methods["masked"] = lambda: masked_sdpa(q, k, v, mask, scale)
    methods["peak"] = lambda: torch.mm(a, b)
    work = {name: flops for name in methods}
    work["peak"] = 2 * 4096 * 1024 * 1024
    rows = []
    for th in threads:
        torch.set_num_threads(th)
        results = {name: fn() for name, fn in methods.items()}  # warm-up (and outputs)
        ref = results["masked"].double()
        errors = {f"{name}_vs_masked_max_abs": (results[name].double() - ref).abs().max().item()
                  for name in (*kernels, "split")}
        best = {name: math.inf for name in methods}
        now = time.perf_counter if clock == "wall" else time.process_time
        per = 1 if clock == "wall" else th  # CPU time of th busy threads -> elapsed
        for _ in range(reps):
            for name, fn in methods.items():
                t0 = now()
                fn()
                best[name] = min(best[name], (now() - t0) / per)
        tf = {name: work[name] / t / 1e12 for name, t in best.items()}
        row = {"dtype": str(dtype).removeprefix("torch."),
               "kv_dtype": str(kv_dtype or dtype).removeprefix("torch."), "prefix_len": prefix_len,
               "chunk": chunk, "heads": hq, "kv_heads": hkv, "head_dim": d, "threads": th,
               "clock": clock,
               "flop": flops, **{f"{name}_s": t for name, t in best.items()},
               **{f"{name}_tflops": x for name, x in tf.items()}, **errors,
               **{f"{name}_vs_split": best["split"] / best[name] for name in kernels},
               **{f"{name}_of_peak": tf[name] / tf["peak"] for name in (*kernels, "split")},
               "split_vs_masked": best["masked"] / best["split"]}
        if profile and "amx" in kernels:
            from pipefill.kernels import amx_attention as amx
            kc, vc, table, out = extra["amx"]
            row.update(_time_split(amx, q, kc, vc, table, prefix_len, scale, out, th, reps,
                                   pairs * hq))
        rows.append(row)
        _print_row(row, kernels)
    return rows


def _time_split(amx, q, kc, vc, table, prefix_len, scale, out, threads, reps, scores) -> dict:
    """rdtsc shares and marginal (skip-one-phase) costs of the kernel's three phases."""
    prof = torch.zeros(threads, 4, dtype=torch.int64)
    amx.chunk_attention_ex(q, kc, vc, table, prefix_len, scale, out=out, prof=prof)
    cyc = prof.sum(0).double()
    total = max(cyc[3].item(), 1.0)
    shares = {"qk": cyc[0].item() / total, "softmax": cyc[1].item() / total, "pv": cyc[2].item() / total}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    modes = {"full": 0, "no_qk": 1, "no_softmax": 2, "no_pv": 4}
    best = {m: math.inf for m in modes}
    for _ in range(reps):
        for name, mode in modes.items():
            t0 = time.perf_counter()
            amx.chunk_attention_ex(q, kc, vc, table, prefix_len, scale, out=out, mode=mode)
            best[name] = min(best[name], time.perf_counter() - t0)
    ns = {name: t * threads / scores * 1e9 for name, t in best.items()}  # thread-ns per score
    return {"rdtsc_share": shares, "ns_per_score": ns["full"],
            "marginal_ns_per_score": {"qk": ns["full"] - ns["no_qk"],
                                      "softmax": ns["full"] - ns["no_softmax"],
                                      "pv": ns["full"] - ns["no_pv"]}}


def _print_row(row: dict, kernels: tuple[str, ...]) -> None:
    names = (*kernels, "split", "masked")
    print(f"{row['dtype']:>8} kv {row['kv_dtype']:>13} prefix {row['prefix_len']:>6} chunk {row['chunk']} threads "
          f"{row['threads']}: " + "  ".join(f"{m} {row[f'{m}_tflops']:.3f}" for m in names)
          + f" TFLOP/s (matmul peak {row['peak_tflops']:.3f})", flush=True)
    print("    " + "  ".join(f"{m}: {row[f'{m}_vs_split']:.2f}x split, "
                             f"{row[f'{m}_of_peak']:.0%} of peak" for m in kernels)
          + f"  split: {row['split_of_peak']:.0%} of peak, {row['split_vs_masked']:.2f}x masked",
          flush=True)
    if "rdtsc_share" in row:
        s, mg = row["rdtsc_share"], row["marginal_ns_per_score"]
        print(f"    amx {row['ns_per_score']:.3f} thread-ns/score; rdtsc share qk {s['qk']:.0%} "
              f"softmax {s['softmax']:.0%} pv {s['pv']:.0%} other {s['other']:.0%}; marginal ns/score "
              f"qk {mg['qk']:.3f} softmax {mg['softmax']:.3f} pv {mg['pv']:.3f}", flush=True)
    print("    max |diff| vs masked SDPA: " + "  ".join(
        f"{m} {row[f'{m}_vs_masked_max_abs']:.1e}" for m in (*kernels, "split")), flush=True)



def run(ns: argparse.Namespace) -> int:
    from pipefill.base.platform import cpu_flags

    prefixes = parse_ints(ns.prefix_lens, "--prefix-lens", minimum=0)
    threads = parse_ints(ns.threads, "--threads")
    if ns.heads % ns.kv_heads:
        raise ValueError("--heads must be a multiple of --kv-heads")
    dtypes = [x.strip() for x in ns.dtypes.split(",") if x.strip()]
    bad = [x for x in dtypes if x not in _DTYPES]
    if bad or not dtypes:
        raise ValueError(f"--dtypes {ns.dtypes!r}: choose from bfloat16, float32")
    kv_names = [x.strip() for x in ns.kv_cache_dtypes.split(",") if x.strip()]
    if not kv_names or any(x != "same" and x not in QUANT_KV_DTYPES for x in kv_names):
        raise ValueError(f"--kv-cache-dtypes {ns.kv_cache_dtypes!r}: choose from same, "
                         f"{', '.join(QUANT_KV_DTYPES)}")
    simd = sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"CPU: {cpu_name()} ({' '.join(simd)}); {ns.heads} q heads / {ns.kv_heads} kv heads, "
          f"head_dim {ns.head_dim}, chunk {ns.chunk}, best of {ns.reps}, {ns.clock} clock")
    saved = torch.get_num_threads()
    rows, status = [], {}
    try:
        for name, kv_name in [(a, b) for a in dtypes for b in kv_names]:
            dtype = _DTYPES[name]
            kv_dtype = QUANT_KV_DTYPES.get(kv_name)
            key = name if kv_dtype is None else f"{name}/{kv_name}"
            status[key] = runnable_kernels(dtype, kv_dtype)
            kernels = tuple(k for k, why in status[key].items() if why == "ok")
            skipped = [f"{k} ({why})" for k, why in status[key].items() if why != "ok"]
            if skipped:
                print(f"{key}: not timed: {'; '.join(skipped)}")
            for prefix in prefixes:
                rows += bench_case(prefix, ns.chunk, ns.heads, ns.kv_heads, ns.head_dim,
                                   ns.page_size, threads, ns.reps, not ns.no_split_profile,
                                   dtype, kernels, ns.clock, kv_dtype)
    finally:
        torch.set_num_threads(saved)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"cpu": cpu_name(), "kernels": status, "rows": rows}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipefill.bench.attention")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "attention":
        argv.insert(0, "attention")
    ns = parser.parse_args(argv)
    return ns.run(ns)


if __name__ == "__main__":
    raise SystemExit(main())
