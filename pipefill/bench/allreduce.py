"""The shared-memory all-reduce (pipefill.comm.shm) against gloo's, between `--world` processes
of this node, over the sizes a layer's all-reduce takes: one decode token's hidden state
(1 x hidden) up to a whole prefill chunk (4,096 x hidden).

Each rank is pinned to its own cores (when there are enough) with `--threads` threads. For
each size and dtype, the two are timed in turn in every repetition (shm, gloo, shm, gloo, ...)
so a drift of the machine's speed reaches both alike; a repetition times a loop of calls (as
many as make about 64 MiB, at most 1,000) after a barrier, on rank 0. Printed: microseconds per
call and the algorithm bandwidth (the tensor's bytes / time), median [min-max] over `--reps`,
and how many times faster shared memory is. Before timing, each size's result is checked to be
the same on both (integer values, so any summation order is exact).

    pipefill bench allreduce --world 2 --reps 5 --dtype float32,bfloat16
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipefill.base.platform import cpu_name, free_port, place_stage
from pipefill.comm import shm
from pipefill.kernels import shm_comm

DEFAULT_SIZES = ",".join(f"{rows}x{hidden}" for rows in (1, 16, 512, 4096)
                         for hidden in (2048, 4096, 8192))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOOP_BYTES = 64 << 20  # a timed loop moves about this many bytes...
MAX_ITERS = 1000  # ...in at most this many calls


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """'1x2048,16x4096' -> [(1, 2048), (16, 4096)] (rows x hidden)."""
    sizes = []
    for item in text.split(","):
        rows, sep, hidden = item.strip().partition("x")
        if not (sep and rows.isdigit() and hidden.isdigit() and int(rows) and int(hidden)):
            raise ValueError(f"--sizes: {item.strip()!r} is not ROWSxHIDDEN (e.g. 1x4096)")
        sizes.append((int(rows), int(hidden)))
    return sizes


def iterations(nbytes: int) -> int:
    return max(1, min(MAX_ITERS, LOOP_BYTES // max(1, nbytes)))


def _time_loop(call, x: torch.Tensor, iters: int) -> float:
    """Seconds per call, rank 0's clock, the ranks started together by a gloo barrier."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call(x)
    return (time.perf_counter() - t0) / iters


def _same_result(group: shm.ShmGroup, rows: int, hidden: int, dtype: torch.dtype) -> bool:
    x = torch.randint(-50, 50, (rows, hidden), generator=torch.Generator().manual_seed(
        dist.get_rank())).to(dtype)
    ours, theirs = group.all_reduce_(x.clone()), x.clone()
    dist.all_reduce(theirs)
    return torch.equal(ours, theirs)


def bench_size(group: shm.ShmGroup, rows: int, hidden: int, dtype: torch.dtype,
               reps: int) -> dict:
    x = torch.randn(rows, hidden).to(dtype)
    nbytes = x.numel() * x.element_size()
    iters = iterations(nbytes)
    same = _same_result(group, rows, hidden, dtype)
    calls = {"shm": group.all_reduce_, "gloo": dist.all_reduce}
    for call in calls.values():  # warm-up: first touches, gloo's buffers
        call(x)
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            times[name].append(_time_loop(call, x, iters))
    return {"rows": rows, "hidden": hidden, "dtype": str(dtype).removeprefix("torch."),
            "bytes": nbytes, "iters": iters, "same_result": same, "seconds": times}


def _us(ts: list[float]) -> str:
    return (f"{statistics.median(ts) * 1e6:.1f} [{min(ts) * 1e6:.1f}-{max(ts) * 1e6:.1f}]")


def _gbs(nbytes: int, ts: list[float]) -> str:
    return f"{nbytes / statistics.median(ts) / 1e9:.2f}"


def print_row(r: dict) -> None:
    shm_t, gloo_t = r["seconds"]["shm"], r["seconds"]["gloo"]
    check = "" if r["same_result"] else " RESULTS DIFFER"
    print(f"| {r['rows']} x {r['hidden']} | {r['dtype']} | {r['bytes'] / 1024:.0f} | "
          f"{_us(shm_t)} | {_gbs(r['bytes'], shm_t)} | {_us(gloo_t)} | "
          f"{_gbs(r['bytes'], gloo_t)} | {statistics.median(gloo_t) / statistics.median(shm_t):.1f}"
          f"{check} |", flush=True)


def _rank_main(rank: int, ns: argparse.Namespace, port: int) -> None:
    place_stage(rank, ns.world, ns.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ns.world)
    group = shm.ShmGroup(rank, ns.world, "bench", ns.max_bytes, isa=ns.isa)
    if rank == 0:
        print(f"pipefill bench allreduce: {cpu_name()}; world {ns.world}, {ns.threads} "
              f"thread(s) per rank; shm sums with the {group.isa} build, buffers of "
              f"{group.slot_bytes >> 10} KiB per rank; median [min-max] over {ns.reps} reps, "
              f"algorithm bandwidth = bytes / time")
        print("| rows x hidden | dtype | KiB | shm us | shm GB/s | gloo us | gloo GB/s "
              "| gloo / shm |")
        print("|---|---|---|---|---|---|---|---|")
    results = []
    for dtype in ns.dtypes:
        for rows, hidden in ns.size_list:
            r = bench_size(group, rows, hidden, dtype, ns.reps)
            if rank == 0:
                print_row(r)
                results.append(r)
    group.close()
    if rank == 0 and ns.json:
        with open(ns.json, "w") as f:
            json.dump({"cpu": cpu_name(), "world": ns.world, "threads": ns.threads,
                       "isa": group.isa, "results": results}, f, indent=1)
    dist.destroy_process_group()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--world", type=int, default=2, help="ranks (processes) on this node")
    ap.add_argument("--sizes", default=DEFAULT_SIZES,
                    help="ROWSxHIDDEN tensors, comma-separated (default: hidden 2048, 4096 and "
                    "8192 at 1, 16, 512 and 4096 rows: one decode token to a whole chunk)")
    ap.add_argument("--dtype", default="float32,bfloat16",
                    help="float32 and/or bfloat16, comma-separated (bfloat16 is summed in "
                    "float32 by shm)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (each times shm then gloo)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--max-bytes", type=int, default=shm.DEFAULT_MAX_BYTES,
                    help="shm buffer per rank; larger tensors go in pieces of this size")
    ap.add_argument("--isa", default=None, choices=shm_comm.ISAS,
                    help="the shm sum build (default: the best this CPU runs)")
    ap.add_argument("--json", metavar="FILE", help="write every time to this JSON file")


def add_parser(sub) -> None:
    p = sub.add_parser("allreduce", help="shared-memory all-reduce against gloo, per size",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    if ns.world < 2:
        raise ValueError(f"--world must be at least 2, got {ns.world}")
    if ns.reps < 1 or ns.threads < 1 or ns.max_bytes < 1:
        raise ValueError("--reps, --threads and --max-bytes must be positive")
    ns.size_list = parse_sizes(ns.sizes)
    names = [d.strip() for d in ns.dtype.split(",")]
    unknown = [d for d in names if d not in DTYPES]
    if unknown:
        raise ValueError(f"--dtype: {', '.join(unknown)} unknown; choose float32, bfloat16")
    ns.dtypes = [DTYPES[d] for d in names]
    isa, why = shm_comm.choose_isa(isa=ns.isa)
    if isa is None:
        raise RuntimeError(f"the shared-memory all-reduce is unavailable here: {why}")
    try:
        mp.spawn(_rank_main, args=(ns, free_port()), nprocs=ns.world)
    except mp.ProcessRaisedException as e:
        raise RuntimeError(f"a rank failed: {str(e).strip().splitlines()[-1]}") from None
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
