"""TP against PP across a real link: one prefill's TTFT and the bytes it puts on the wire.

Two network namespaces ("nodes") joined by a veth pair, each end rate-limited by `tc tbf` to
each --rates value in turn. At every rate the same prompt runs, --reps times and the layouts
alternating, as
- PP2: one stage per node, the stage boundary on the link (pipefill.runtime.p2p);
- TP2: one stage whose two TP ranks are on the two nodes, their all-reduces over gloo on the
  link (Layout.node_of, runtime/tp.py).
The bytes are the veth pair's transmit counters (both ends, frames with their headers), taken
before and after each run, less those of the same launch with a one-token prompt (the
rendezvous, the warm-up forward, the control traffic), measured once per layout.

Formulas (S prompt tokens, H hidden size, L layers, P stages, b bytes per value of --dtype):
- TP2: every sum is a ring all-reduce of 2 ranks, in which each rank sends its S x H
  partial once: 2 x (2L - 1) x S x H x b on the wire, both ways: two sums a layer and one for
  the embedding, less the last layer's two, which cover only the rows whose logits are kept
  (StageModel's trim). One rank sends half of it, about the usual 4 S H L;
- PP: each boundary carries the hidden state in --dtype and the residual in float32
  (runtime/p2p.frame_layout): S x H x (P - 1) x (b + 4).

Needs root (network namespaces, veth, tc) and iproute2.

    pipefill bench tp-vs-pp --input-len 8192 --rates 1gbit,10gbit --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess

from pipefill.bench.netdelay import (NodePair, add_veth, generate_across, generate_argv,
                                     namespaces)

NODES = NodePair.of_this_process("ptv", "v", "10.81.0")  # the veth pair's ends
BASE_PORT = 29700
RUN_TIMEOUT_S = 1800
LAYOUTS = {"PP2": ["--pp-size", "2"], "TP2": ["--tp-size", "2"]}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "tp-vs-pp", help="TTFT and wire bytes of TP2 against PP2 across a tbf-limited veth "
                         "link between two network namespaces (root)",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input-len", type=int, default=8192, help="prompt tokens")
    p.add_argument("--rates", default="1gbit,10gbit",
                   help="link rates to try, comma separated (tc units: 500mbit, 10gbit)")
    p.add_argument("--reps", type=int, default=3, help="runs per layout and rate")
    p.add_argument("--model-path", default=None, help="default: the default model")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES),
                   help="the nodes' --dtype (and the formulas' bytes per value)")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="the nodes' chunk size (default: theirs)")
    p.add_argument("--threads-per-stage", type=int, default=1, help="threads of each process")
    p.set_defaults(run=run)


def parse_rate(text: str) -> float:
    """'10gbit' -> 1e10 bits/s; a ValueError with a sentence otherwise."""
    t = text.strip().lower()
    for unit, scale in UNITS.items():
        if t.endswith(unit):
            try:
                value = float(t[:-len(unit)])
            except ValueError:
                break
            if value > 0:
                return value * scale
            break
    raise ValueError(f"--rates: {text!r} is not a rate such as 500mbit or 10gbit")


def check(ns: argparse.Namespace) -> list[str]:
    """The rates, as given; ValueError (exit 2) for a bad flag or a machine that cannot."""
    for flag in ("input_len", "reps", "threads_per_stage"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if ns.chunked_prefill_size is not None and ns.chunked_prefill_size < 1:
        raise ValueError("--chunked-prefill-size must be at least 1")
    rates = [r.strip() for r in ns.rates.split(",") if r.strip()]
    if not rates:
        raise ValueError("--rates needs at least one rate, such as 10gbit")
    for r in rates:
        parse_rate(r)
    if os.geteuid() != 0:
        raise ValueError("pipefill bench tp-vs-pp needs root: it creates network namespaces, "
                         "a veth pair and tc qdiscs")
    if shutil.which("tc") is None or shutil.which("ip") is None:
        raise ValueError("pipefill bench tp-vs-pp needs iproute2 (ip and tc)")
    return rates


def formula_bytes(layout: str, tokens: int, hidden: int, layers: int,
                  dtype_bytes: int, stages: int = 2) -> int:
    """Bytes one prefill of `tokens` should put on the link, both directions, payload only
    (module docstring)."""
    if layout == "TP2":  # the last layer's two sums are a row's: left out
        return 2 * (2 * layers - 1) * tokens * hidden * dtype_bytes
    if layout == "PP2":
        return tokens * hidden * (stages - 1) * (dtype_bytes + 4)
    raise ValueError(f"unknown layout {layout!r}")


def set_rate(rate: str) -> None:
    """tbf at `rate` on both ends. The bucket holds 1 ms of the rate (at least 64 KB, more
    than a frame) so the limiter can keep pace at 10 Gbit/s; the queue 50 ms."""
    burst = max(64 << 10, int(parse_rate(rate) / 8 / 1000))
    for ns, iface in zip(NODES.ns, NODES.iface):
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", iface,
                            "root", "tbf", "rate", rate, "burst", str(burst), "latency",
                            "50ms"], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"tc tbf {rate} on {iface} failed: {r.stderr.strip()}")


def wire_bytes() -> int:
    """Bytes both ends of the veth pair have sent so far."""
    total = 0
    for ns, iface in zip(NODES.ns, NODES.iface):
        out = subprocess.run(["ip", "-j", "-s", "-n", ns, "link", "show", iface],
                             capture_output=True, text=True, check=True).stdout
        total += json.loads(out)[0]["stats64"]["tx"]["bytes"]
    return total


def run(ns: argparse.Namespace) -> int:
    rates = check(ns)
    hidden, layers = model_shape(ns.model_path)
    # The veth pair and its qdiscs go with the namespaces, also when the bench is killed
    # by SIGTERM or SIGINT; a run killed outright leaves them for the next one to delete.
    with namespaces(NODES):
        add_veth(NODES)
        rows = measure(ns, rates)
    report(ns, rates, rows, hidden, layers)
    return 0


def model_shape(model_path: str | None) -> tuple[int, int]:
    from pipefill.model.loader import WeightSource, resolve_model_path
    cfg = WeightSource(resolve_model_path(model_path)).config
    return cfg.hidden_size, cfg.num_layers


def measure(ns: argparse.Namespace, rates: list[str]) -> dict:
    """{(rate, layout): {"ms": [...], "bytes": [...]}}, plus {layout: overhead bytes}."""
    ports = iter(range(BASE_PORT, BASE_PORT + 2000))
    set_rate(rates[-1])
    overhead = {layout: launch(ns, layout, 1, next(ports))[1] for layout in LAYOUTS}
    rows: dict = {"overhead": overhead}
    for rate in rates:
        set_rate(rate)
        for rep in range(ns.reps):
            for layout in LAYOUTS:
                ttft_s, nbytes = launch(ns, layout, ns.input_len, next(ports))
                row = rows.setdefault((rate, layout), {"ms": [], "bytes": []})
                row["ms"].append(ttft_s * 1000)
                row["bytes"].append(nbytes - overhead[layout])
                print(f"{rate} {layout} rep {rep + 1}: TTFT {ttft_s * 1000:.1f} ms, "
                      f"{nbytes / 1e6:.1f} MB on the wire (the launch's own "
                      f"{overhead[layout] / 1e6:.1f} MB included)", flush=True)
    return rows


def launch(ns: argparse.Namespace, layout: str, tokens: int, port: int) -> tuple[float, int]:
    """One `pipefill generate` per namespace: (TTFT in s, bytes the link carried)."""
    chunk = (["--chunked-prefill-size", str(ns.chunked_prefill_size)]
             if ns.chunked_prefill_size else [])
    argv = generate_argv(NODES, port, tokens, ns.dtype, ns.threads_per_stage, ns.model_path,
                         *LAYOUTS[layout], *chunk)
    before = wire_bytes()
    ttft_s = generate_across(NODES, argv, f"the {layout} prefill", RUN_TIMEOUT_S)["ttft_s"]
    return ttft_s, wire_bytes() - before


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def report(ns: argparse.Namespace, rates: list[str], rows: dict, hidden: int,
           layers: int) -> None:
    b = DTYPE_BYTES[ns.dtype]
    print(f"\npipefill bench tp-vs-pp: prefill of {ns.input_len} tokens, model "
          f"{ns.model_path or 'default'} (H={hidden}, L={layers}), {ns.dtype}; two network "
          f"namespaces joined by a veth pair under tc tbf; median [min-max] over {ns.reps} "
          f"runs; wire bytes: both ends' tx counters less a one-token launch's "
          f"(PP2 {rows['overhead']['PP2'] / 1e6:.2f} MB, "
          f"TP2 {rows['overhead']['TP2'] / 1e6:.2f} MB)")
    print("| rate | layout | TTFT (ms) | bytes on the wire (MB) | formula (MB) |\n"
          "|---|---|---|---|---|")
    for rate in rates:
        for layout in LAYOUTS:
            row = rows[(rate, layout)]
            formula = formula_bytes(layout, ns.input_len, hidden, layers, b)
            print(f"| {rate} | {layout} | {_median(row['ms'])} | "
                  f"{statistics.median(row['bytes']) / 1e6:.1f} | {formula / 1e6:.1f} |")
