"""`pipefill bench attention`: the fused AMX chunk attention against torch's SDPA paths.

Workload: one sequence, a chunk of `--chunk` queries at the end of `--prefix-lens` cached tokens
(bottom-right causal), `--heads` query heads over `--kv-heads` KV heads. Methods, timed
interleaved (A B C A B C ...) and reported best-of-N, because this VM's speed drifts:

* amx    — pipefill.kernels.amx_attention.chunk_attention over the packed paged cache;
* split  — _scaled_dot_product_flash_attention_for_cpu on the prefix (no mask) and on the
           diagonal block (is_causal=True), merged by log-sum-exp (the engine's SDPA path);
* masked — F.scaled_dot_product_attention with a bottom-right causal bool mask.

TFLOP/s count 4 * Hq * D per visible (query, key) pair. The kernel's time split comes from two
measurements: rdtsc counters around its QK^T / softmax / PV phases (per 32-row block and
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
from pipefill.model.attention import heads_first, split_attention


def add_parser(sub) -> None:
    p = sub.add_parser("attention", help="AMX chunk attention vs. SDPA micro-benchmark",
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
    p.add_argument("--no-split-profile", action="store_true",
                   help="skip the QK^T/softmax/PV time split of the AMX kernel")
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


def bench_case(prefix_len: int, chunk: int, hq: int, hkv: int, d: int, page_size: int,
               threads: list[int], reps: int, profile: bool, amx_ok: bool) -> list[dict]:
    from pipefill.kernels import amx_attention as amx

    gen = torch.Generator().manual_seed(prefix_len)
    n = prefix_len + chunk
    q = torch.randn(chunk, hq, d, generator=gen).bfloat16()
    k = torch.randn(n, hkv, d, generator=gen).bfloat16()
    v = torch.randn(n, hkv, d, generator=gen).bfloat16()
    scale = d ** -0.5
    mask = torch.arange(n).unsqueeze(0) <= (prefix_len + torch.arange(chunk)).unsqueeze(1)
    pairs = chunk * prefix_len + chunk * (chunk + 1) // 2
    flops = 4 * hq * d * pairs
    methods = {
        "split": lambda: split_sdpa(q, k, v, prefix_len, scale),
        "masked": lambda: masked_sdpa(q, k, v, mask, scale),
    }
    errors = {}
    if amx_ok:
        npages = math.ceil(n / page_size)
        cache = amx.AmxKVCache(1, npages, page_size, hkv, d)
        kc, vc = cache.layer(0)
        table = torch.arange(npages, dtype=torch.int32)
        amx.write_kv(kc, vc, k, v, table, 0)
        out = torch.empty(chunk, hq, d, dtype=torch.bfloat16)
        methods = {"amx": lambda: amx.chunk_attention(q, kc, vc, table, prefix_len, scale, out=out),
                   **methods}
    rows = []
    for th in threads:
        torch.set_num_threads(th)
        results = {name: fn() for name, fn in methods.items()}  # warm-up (and outputs)
        if "amx" in results:
            ref = results["masked"].float()
            errors = {"amx_vs_masked_max_abs": (results["amx"].float() - ref).abs().max().item(),
                      "split_vs_masked_max_abs": (results["split"].float() - ref).abs().max().item()}
        best = {name: math.inf for name in methods}
        for _ in range(reps):
            for name, fn in methods.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        row = {"prefix_len": prefix_len, "chunk": chunk, "heads": hq, "kv_heads": hkv, "head_dim": d,
               "threads": th, "flop": flops,
               **{f"{name}_s": t for name, t in best.items()},
               **{f"{name}_tflops": flops / t / 1e12 for name, t in best.items()}, **errors}
        if amx_ok:
            row["amx_vs_masked"] = best["masked"] / best["amx"]
            row["amx_vs_split"] = best["split"] / best["amx"]
            if profile:
                row.update(_time_split(amx, q, kc, vc, table, prefix_len, scale, out, th, reps, pairs * hq))
        row["split_vs_masked"] = best["masked"] / best["split"]
        rows.append(row)
        _print_row(row)
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


def _print_row(row: dict) -> None:
    line = (f"prefix {row['prefix_len']:>6} chunk {row['chunk']} threads {row['threads']}: "
            + "  ".join(f"{m} {row[f'{m}_tflops']:.3f}" for m in ("amx", "split", "masked")
                        if f"{m}_tflops" in row) + " TFLOP/s")
    if "amx_vs_masked" in row:
        line += f"  | amx/masked {row['amx_vs_masked']:.2f}x  amx/split {row['amx_vs_split']:.2f}x"
    line += f"  split/masked {row['split_vs_masked']:.2f}x"
    print(line, flush=True)
    if "rdtsc_share" in row:
        s, mg = row["rdtsc_share"], row["marginal_ns_per_score"]
        print(f"    amx {row['ns_per_score']:.3f} thread-ns/score; rdtsc share qk {s['qk']:.0%} "
              f"softmax {s['softmax']:.0%} pv {s['pv']:.0%} other {s['other']:.0%}; marginal ns/score "
              f"qk {mg['qk']:.3f} softmax {mg['softmax']:.3f} pv {mg['pv']:.3f}", flush=True)
    if "amx_vs_masked_max_abs" in row:
        print(f"    max |diff| vs masked SDPA: amx {row['amx_vs_masked_max_abs']:.2e} "
              f"split {row['split_vs_masked_max_abs']:.2e}", flush=True)


def run(ns: argparse.Namespace) -> int:
    from pipefill.kernels.amx_attention import amx_available

    prefixes = parse_ints(ns.prefix_lens, "--prefix-lens", minimum=0)
    threads = parse_ints(ns.threads, "--threads")
    if ns.heads % ns.kv_heads:
        raise ValueError("--heads must be a multiple of --kv-heads")
    amx_ok, why = amx_available()
    if not amx_ok:
        print(f"AMX kernel unavailable ({why}); timing the SDPA paths only")
    saved = torch.get_num_threads()
    rows = []
    print(f"{ns.heads} q heads / {ns.kv_heads} kv heads, head_dim {ns.head_dim}, chunk {ns.chunk}, "
          f"best of {ns.reps}")
    try:
        for prefix in prefixes:
            rows += bench_case(prefix, ns.chunk, ns.heads, ns.kv_heads, ns.head_dim, ns.page_size,
                               threads, ns.reps, amx_ok and not ns.no_split_profile, amx_ok)
    finally:
        torch.set_num_threads(saved)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"amx_available": amx_ok, "amx_reason": why, "rows": rows}, f, indent=2)
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
