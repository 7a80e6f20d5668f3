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

    python -m pipefill.bench.decode_gemm --rows 1,2,4,8,16 --threads 2 --isa avx512bf16
"""
from __future__ import annotations

import argparse
import time

import torch

from pipefill.kernels import decode_gemm as dg
from pipefill.base.platform import cpu_name

# (name, K, N) of SmolLM2-135M (hidden 576, intermediate 1536, 9 query / 3 KV heads of 64).
SHAPES = [("qkv", 576, 960), ("o_proj", 576, 576), ("gate_up", 576, 3072),
          ("down", 1536, 576), ("lm_head", 576, 49152)]
STREAM_BYTES = 256 << 20  # copies of a matrix rotate through at least this many bytes
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


def bench_shape(k: int, n: int, rows: list[int], isa: str, x_dtype, w_dtype, min_s: float):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(w_dtype)
    disable = tuple(i for i in dg.ISAS if i != isa)
    first = dg.pack(w, None, x_dtype, w_dtype, max_rows=max(rows), disable=disable)
    copies = max(1, -(-STREAM_BYTES // first.nbytes))
    mats = [first] + [dg.pack(w, None, x_dtype, w_dtype, max(rows), disable)
                      for _ in range(copies - 1)]
    cases = [(torch.randn(m, k, generator=g).to(x_dtype), torch.empty(m, n, dtype=x_dtype))
             for m in rows]
    times = time_interleaved(mats, cases, min_s)
    return first.nbytes, [(m, s, first.nbytes / s, 2 * m * k * n / s)
                          for m, s in zip(rows, times)]


def in_cache_gflops(isa, x_dtype, w_dtype, m: int, min_s: float) -> float:
    k, n = 576, 336  # 7 whole groups of 48; 0.4 MB bf16 / 0.8 MB float32: stays in L2
    w = torch.randn(n, k).to(w_dtype)
    p = dg.pack(w, None, x_dtype, w_dtype, max_rows=m,
                disable=tuple(i for i in dg.ISAS if i != isa))
    x = torch.randn(m, k).to(x_dtype)
    out = torch.empty(m, n, dtype=x_dtype)
    return 2 * m * k * n / time_calls([p] * 64, x, out, min_s) / 1e9


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rows", default="1,2,4,8,16", help="comma-separated M")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--isa", default=None, help="one of " + ", ".join(dg.ISAS) +
                    " (default: the best usable for the dtypes)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="activations (compute) dtype")
    ap.add_argument("--weight-dtype", default=None, choices=("bfloat16", "float32"),
                    help="packed weights dtype (default: the compute dtype)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                    help="subset of " + ",".join(s[0] for s in SHAPES))
    ap.add_argument("--min-s", type=float, default=0.5, help="seconds timed per (shape, M)")
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
    rows = [int(r) for r in ns.rows.split(",")]
    if not rows or min(rows) < 1:
        raise ValueError("--rows: positive integers, comma-separated")
    torch.set_num_threads(ns.threads)
    x_dtype = getattr(torch, ns.dtype)
    w_dtype = getattr(torch, ns.weight_dtype or ns.dtype)
    isa = ns.isa or dg.choose_isa(x_dtype, w_dtype)[0]
    if isa is None or not dg.isa_status().get(isa, (False,))[0]:
        raise ValueError(f"--isa {isa}: not usable here ({dg.isa_status()})")
    bw = copy_bandwidth()
    peak = in_cache_gflops(isa, x_dtype, w_dtype, max(rows), ns.min_s)
    print(f"{cpu_name()}, {ns.threads} threads, {'CPU' if ns.cpu_clock else 'wall'} clock, isa {isa}, x {ns.dtype}, weights {w_dtype}; "
          f"copy bandwidth {bw / 1e9:.1f} GB/s (read + write); in-cache kernel "
          f"{peak:.1f} GFLOP/s at M = {max(rows)}")
    print("| shape (K x N) | MB | M | ms/call | x M=1 | weights GB/s | % copy bw | GFLOP/s "
          "| % in-cache |")
    print("|---|---|---|---|---|---|---|---|---|")
    wanted = ns.shapes.split(",")
    for name, k, n in SHAPES:
        if name not in wanted:
            continue
        nbytes, res = bench_shape(k, n, rows, isa, x_dtype, w_dtype, ns.min_s)
        base = res[0][1]
        for m, s, gbs, flops in res:
            print(f"| {name} {k}x{n} | {nbytes / 1e6:.2f} | {m} | {s * 1e3:.3f} | "
                  f"{s / base:.2f} | {gbs / 1e9:.1f} | {100 * gbs / bw:.0f} | "
                  f"{flops / 1e9:.1f} | {100 * flops / 1e9 / peak:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
