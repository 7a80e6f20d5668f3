"""What a link's delay adds to a PP2 prefill. Two network namespaces, one stage each, joined by
the user-space delay link of pipefill/bench/netdelay.py (TUN devices and a forwarder,
rate-limited to --rate-gbit): the same prefill runs over the link with no added delay and with
--delay-ms each way, in turn, --reps times each. Printed: each link's measured TCP round trip,
the TTFTs (median [min-max]), and what the delay added per chunk, in round trips. Every stage
message being one frame on a receive posted ahead (ARCHITECTURE.md, 'A chunk's path'), the
delay should add about one round trip in all (the first chunk's way out, the token's way
back), and at most about one per chunk.

--p2p times the stage link alone, without a model: stage 0 sends --chunks micro-batches of
--chunk-size x --hidden-size activations (bfloat16 hidden, float32 residual) back to back
through pipefill.runtime.p2p, stage 1 answers each with a result, and the time until the last
result is that prefill's communication with no compute to hide it (--compute-ms: a sleep per
chunk on each stage). The first round of each run warms the link up and is not counted.

Needs root (network namespaces and TUN devices) and iproute2.

    pipefill bench link --delay-ms 1 --input-len 2048 --chunked-prefill-size 256 --reps 3
    pipefill bench link --p2p --delay-ms 1 --chunks 8 --chunk-size 256 --hidden-size 4096
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from pipefill.base.plan import PipeMessage, StepResult
from pipefill.bench.netdelay import (DelayLink, NodePair, finish_nodes, generate_across,
                                     generate_argv, measure, namespaces, start_on_node)
from pipefill.runtime.executor import Activations
from pipefill.runtime.p2p import Pipe

NODES = NodePair.of_this_process("pfl", "t", "10.79.0")  # TUN devices
BASE_PORT = 29600
RUN_TIMEOUT_S = 900


def add_parser(sub) -> None:
    p = sub.add_parser(
        "link", help="what a link's delay adds to a PP2 prefill (network namespaces, root)",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--delay-ms", type=float, default=1.0,
                   help="one-way delay of the delayed link (the other has none)")
    p.add_argument("--rate-gbit", type=float, default=10.0, help="both links' rate limit")
    p.add_argument("--reps", type=int, default=3, help="runs per link")
    p.add_argument("--model-path", default=None, help="model of the prefill (default: the "
                   "default model)")
    p.add_argument("--input-len", type=int, default=2048, help="prompt tokens")
    p.add_argument("--chunked-prefill-size", type=int, default=256, help="tokens per chunk")
    p.add_argument("--dtype", default="auto", help="the stages' --dtype")
    p.add_argument("--threads-per-stage", type=int, default=1, help="the stages' threads")
    p.add_argument("--p2p", action="store_true",
                   help="time the stage link alone (pipefill.runtime.p2p), no model")
    p.add_argument("--chunks", type=int, default=8, help="--p2p: micro-batches per round")
    p.add_argument("--chunk-size", type=int, default=256, help="--p2p: rows per micro-batch")
    p.add_argument("--hidden-size", type=int, default=2048, help="--p2p: hidden size")
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="--p2p: a sleep per micro-batch on each stage, standing for compute")
    p.set_defaults(run=run)


def check(ns: argparse.Namespace) -> None:
    for flag in ("reps", "input_len", "chunked_prefill_size", "chunks", "chunk_size",
                 "hidden_size", "threads_per_stage"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if ns.delay_ms <= 0 or ns.rate_gbit <= 0 or ns.compute_ms < 0:
        raise ValueError("--delay-ms and --rate-gbit must be positive, --compute-ms >= 0")
    if os.geteuid() != 0 or not os.path.exists("/dev/net/tun"):
        raise ValueError("pipefill bench link needs root and /dev/net/tun (it creates "
                         "network namespaces and TUN devices)")


def run(ns: argparse.Namespace) -> int:
    check(ns)
    with namespaces(NODES):
        rows = measure_links(ns)
    report(ns, rows)
    return 0


def measure_links(ns: argparse.Namespace) -> dict[float, dict]:
    """{delay: {"rtt_ms": [...], "ms": [...], "chunks": n}}, the links taken in turn."""
    rows = {0.0: {"rtt_ms": [], "ms": []}, ns.delay_ms: {"rtt_ms": [], "ms": []}}
    ports = iter(range(BASE_PORT, BASE_PORT + 1000, 2))
    for rep in range(1 if ns.p2p else ns.reps):
        for delay, row in rows.items():
            with DelayLink(NODES.ns, NODES.iface, NODES.ip, delay_ms=delay,
                           rate_gbit=ns.rate_gbit):
                row["rtt_ms"].append(measure(NODES.ns, NODES.ip[1], next(ports),
                                             8 << 20)["rtt_ms"])
                if ns.p2p:
                    row["ms"] += [s * 1000 for s in run_p2p(ns, next(ports))]
                    row["chunks"] = ns.chunks
                else:
                    ttft_s, row["chunks"] = run_prefill(ns, next(ports))
                    row["ms"].append(ttft_s * 1000)
            print(f"rep {rep + 1}: {delay:g} ms each way: {row['ms'][-1]:.1f} ms", flush=True)
    return rows


def run_prefill(ns: argparse.Namespace, port: int) -> tuple[float, int]:
    """One `pipefill generate` per namespace, PP2 across the link: (TTFT in s, chunks)."""
    argv = generate_argv(NODES, port, ns.input_len, ns.dtype, ns.threads_per_stage,
                         ns.model_path, "--chunked-prefill-size", str(ns.chunked_prefill_size),
                         "--pp-size", "2")
    metrics = generate_across(NODES, argv, "the PP2 prefill", RUN_TIMEOUT_S)
    return metrics["ttft_s"], len(metrics["chunk_sizes"])


def run_p2p(ns: argparse.Namespace, port: int) -> list[float]:
    """Seconds per round of ns.chunks micro-batches over the link, warm-up round left out."""
    spec = json.dumps({"addr": f"{NODES.ip[0]}:{port}", "rounds": ns.reps + 1,
                       "chunks": ns.chunks, "rows": ns.chunk_size, "hidden": ns.hidden_size,
                       "compute_s": ns.compute_ms / 1000})
    argv = [sys.executable, "-m", "pipefill.bench.link"]
    outs = finish_nodes([start_on_node(NODES, r, argv + [str(r), spec]) for r in (0, 1)],
                        "the p2p run", RUN_TIMEOUT_S)
    return json.loads(outs[0].strip().splitlines()[-1])[1:]


def _p2p_rank(rank: int, spec: dict) -> None:
    """One end of --p2p: stage 0 sends the micro-batches and takes the results back."""
    host, _, port = spec["addr"].rpartition(":")
    store = dist.TCPStore(host, int(port), 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    pipe = Pipe(rank, 2, spec["hidden"], torch.bfloat16, torch.device("cpu"))
    acts = Activations(torch.randn(spec["rows"], spec["hidden"]).to(torch.bfloat16),
                       torch.randn(spec["rows"], spec["hidden"]))
    seconds = []
    for _ in range(spec["rounds"]):
        dist.barrier()
        t0 = time.perf_counter()
        for k in range(spec["chunks"]):
            if rank == 0:
                time.sleep(spec["compute_s"])
                pipe.send_forward(PipeMessage(None, [0.0]), acts)
            else:
                pipe.recv_forward()
                time.sleep(spec["compute_s"])
                pipe.send_result(StepResult(k))
        if rank == 0:
            for _ in range(spec["chunks"]):
                pipe.recv_result()
        pipe.flush()
        seconds.append(time.perf_counter() - t0)
    dist.barrier()
    print(json.dumps(seconds), flush=True)
    os._exit(0)  # receives stay posted: skip the teardown that would wait on them


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def report(ns: argparse.Namespace, rows: dict[float, dict]) -> None:
    base, delayed = rows[0.0], rows[ns.delay_ms]
    what = (f"the stage link alone, {ns.chunks} micro-batches of {ns.chunk_size} x "
            f"{ns.hidden_size} (compute {ns.compute_ms:g} ms each)" if ns.p2p else
            f"PP2 prefill of {ns.input_len} tokens in chunks of {ns.chunked_prefill_size} "
            f"({base['chunks']} chunks), model {ns.model_path or 'default'}")
    print(f"\npipefill bench link: {what}; two network namespaces joined by a user-space link "
          f"(TUN forwarder) at {ns.rate_gbit:g} Gbit/s; median [min-max] over "
          f"{len(base['ms'])} runs")
    print("| delay each way (ms) | link RTT (ms) | time (ms) |\n|---|---|---|")
    for delay, row in rows.items():
        print(f"| {delay:g} | {statistics.median(row['rtt_ms']):.2f} | {_median(row['ms'])} |")
    added = statistics.median(delayed["ms"]) - statistics.median(base["ms"])
    rtt = statistics.median(delayed["rtt_ms"]) - statistics.median(base["rtt_ms"])
    per_chunk = added / base["chunks"]
    print(f"the delay added {added:.1f} ms over {base['chunks']} chunks: {per_chunk:.2f} ms "
          f"per chunk = {per_chunk / rtt:.2f} round trips per chunk (the delay adds "
          f"{rtt:.2f} ms to a round trip); at most about 1 expected")


if __name__ == "__main__":
    _p2p_rank(int(sys.argv[1]), json.loads(sys.argv[2]))
