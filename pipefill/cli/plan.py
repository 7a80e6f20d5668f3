"""`pipefill plan`: the PP × TP layout, C0 and σ for a model on a machine, with predicted TTFT,
per-device memory and link load (ARCHITECTURE.md, 'The deployment planner')."""
from __future__ import annotations

import argparse
import json
import os

from pipefill.bench.roofline import this_cpu
from pipefill.chunking.sim import SMOOTH_GRID
from pipefill.config.args import chunk_size_flag
from pipefill.model.config import ModelConfig
from pipefill.model.families import family_for_hf_config
from pipefill.model.loader import WeightSource, resolve_model_path
from pipefill.planner import (PRESETS, THIS_CPU, Hardware, Layout, Overrides, Plan, Precision,
                              layouts, load_hardware_file, parse_tflops_flag, search)
from pipefill.planner.costs import layer_kinds
from pipefill.planner.hardware import DTYPE_NAMES

GB = 1e9
# Flags that override one field of the hardware: flag -> (Overrides field, type, what it is).
OVERRIDE_FLAGS = {
    "--device-memory-gb": ("memory_gb", float, "memory per device (GB)"),
    "--memory-bandwidth-gb-s": ("memory_bandwidth_gb_s", float,
                                "memory bandwidth per device (GB/s)"),
    "--devices-per-node": ("devices_per_node", int, "devices per node"),
    "--intra-node-gb-s": ("intra_node_gb_s", float,
                          "a device's link to the others of its node (GB/s, each way)"),
    "--intra-node-latency-us": ("intra_node_latency_us", float, "that link's latency (us)"),
    "--inter-node-gb-s": ("inter_node_gb_s", float,
                          "a device's share of the network between nodes (GB/s, each way)"),
    "--inter-node-latency-us": ("inter_node_latency_us", float, "the network's latency (us)"),
    "--efficiency": ("efficiency", float, "the share of the peak FLOP/s prefill reaches (h20's "
                                          "is calibrated, this-cpu's is 1)"),
    "--chunk-overhead-ms": ("chunk_overhead_ms", float,
                            "the milliseconds a chunk costs a stage beside its operations "
                            "(scheduling, launches, synchronisation)"),
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="choose PP x TP, C0 and sigma for a model on a machine",
        description="Search the PP x TP layouts of a machine's devices (and, for each, the "
                    "first chunk size C0 and the dynamic-chunking smooth factor sigma) for the "
                    "lowest time to first token of one prompt, predicted by the pipeline "
                    "simulator over a per-operation cost model (GEMMs of the active weights, "
                    "attention's quadratic term, two ring all-reduces a layer under TP, hidden "
                    "state and residual across each stage border). Prints the best layout with "
                    "its TTFT, per-device memory (weights + KV) and link load, the command "
                    "that runs it, and a table of the alternatives. Layouts that do not fit "
                    "in memory come last.")
    p.add_argument("--model-config", default="default", metavar="PATH",
                   help="the model: a config.json, a folder holding one, a .gguf file, or "
                        "'default' (the default model, SmolLM2-135M-Instruct); only its "
                        "shapes are read")
    p.add_argument("--hardware", default=THIS_CPU, metavar="NAME|FILE",
                   help=f"the machine: a preset ({', '.join(sorted(PRESETS))}: datasheet "
                        f"figures; {THIS_CPU}: this machine, one device per usable core, "
                        "measured now for --measure-seconds) or a JSON or TOML file with "
                        "tflops {dtype: TFLOP/s}, memory_gb, memory_bandwidth_gb_s, "
                        "devices_per_node, intra_node and inter_node {bandwidth_gb_s, "
                        "latency_us}, efficiency, chunk_overhead_ms, devices_are_cores "
                        "(docs: pipefill/planner/hardware.py)")
    p.add_argument("--input-len", type=int, required=True, help="prompt tokens to plan for")
    p.add_argument("--nodes", type=int, default=1,
                   help="nodes of the machine; the devices are nodes x devices per node")
    p.add_argument("--devices", type=int, default=None,
                   help="devices to lay out (default: all of --nodes); every layout uses all")
    p.add_argument("--pp-size", type=int, default=None, help="consider only this many stages")
    p.add_argument("--tp-size", type=int, default=None,
                   help="consider only this many TP ranks per stage")
    p.add_argument("--chunked-prefill-size", default="auto", type=chunk_size_flag,
                   help="C0 in tokens, or auto: try a grid from 256 to --max-chunk tokens")
    p.add_argument("--smooth-factor", default="auto",
                   help="sigma of dynamic chunking (0: fixed chunks), or auto: try "
                        f"{', '.join(map(str, SMOOTH_GRID))} and 0.8 (pipelines only)")
    p.add_argument("--max-chunk", type=int, default=32768, help="largest C0 the grid tries")
    p.add_argument("--page-size", type=int, default=64, help="chunks are multiples of this")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="activations, attention and (by default) weights")
    p.add_argument("--weight-dtype", default="auto",
                   help="the GEMMs' weights: auto (fp8 for an FP8 checkpoint, else --dtype), "
                        "or bfloat16, float16, float32, fp8, int8")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="the KV cache: auto (--dtype), or fp8, int8, bfloat16, ...")
    p.add_argument("--device-tflops", metavar="DTYPE=N,...",
                   help="override the hardware's dense TFLOP/s per device, e.g. bf16=148,fp8=296")
    for flag, (_, kind, text) in OVERRIDE_FLAGS.items():
        p.add_argument(flag, type=kind, help=f"override {text}")
    p.add_argument("--measure-seconds", type=float, default=2.0,
                   help=f"with --hardware {THIS_CPU}: seconds spent measuring this machine")
    p.add_argument("--top", type=int, default=20, help="rows of the alternatives table")
    p.add_argument("--json", metavar="FILE", help="also write every plan here")
    p.set_defaults(run=run)


# -- the model ------------------------------------------------------------------------------
def read_model(path: str) -> tuple[ModelConfig, bool]:
    """(its config, whether its checkpoint is FP8) from a config.json, a folder or a GGUF."""
    if path.endswith(".json"):
        return config_from_json(path)
    if path != "default" and not os.path.exists(path):
        raise ValueError(f"--model-config {path}: no such file or folder")
    resolved = resolve_model_path(path)
    if resolved.endswith(".gguf"):
        return WeightSource(resolved, vocabulary=False).config, False
    return config_from_json(os.path.join(resolved, "config.json"))


def config_from_json(path: str) -> tuple[ModelConfig, bool]:
    if not os.path.isfile(path):
        raise ValueError(f"--model-config {path}: no such file")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--model-config {path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"--model-config {path}: expected a JSON object of model fields")
    try:
        cfg = family_for_hf_config(hf).config_from_hf(hf)
    except KeyError as e:
        raise ValueError(f"--model-config {path}: the config has no {e.args[0]!r}, which its "
                         "architecture needs") from None
    quant = hf.get("quantization_config")
    return cfg, isinstance(quant, dict) and quant.get("quant_method") == "fp8"


def precision_of(ns, fp8_checkpoint: bool) -> Precision:
    def named(value: str, flag: str) -> str:
        dtype = DTYPE_NAMES.get(value.lower())
        if dtype is None:
            raise ValueError(f"{flag} {value!r}: known dtypes are "
                             f"{', '.join(sorted(DTYPE_NAMES))}")
        return dtype
    weights = ("fp8" if fp8_checkpoint else ns.dtype) if ns.weight_dtype == "auto" \
        else named(ns.weight_dtype, "--weight-dtype")
    kv = ns.dtype if ns.kv_cache_dtype == "auto" else named(ns.kv_cache_dtype,
                                                            "--kv-cache-dtype")
    return Precision(weights, ns.dtype, kv)


# -- the machine ----------------------------------------------------------------------------
def read_hardware(ns) -> Hardware:
    if ns.hardware == THIS_CPU:
        if ns.measure_seconds <= 0:
            raise ValueError("--measure-seconds must be positive")
        hw = this_cpu(ns.measure_seconds)
    elif ns.hardware in PRESETS:
        hw = PRESETS[ns.hardware]
    else:
        hw = load_hardware_file(ns.hardware)
    fields = {name: getattr(ns, flag[2:].replace("-", "_"))
              for flag, (name, _, _) in OVERRIDE_FLAGS.items()}
    tflops = parse_tflops_flag(ns.device_tflops) if ns.device_tflops else {}
    return Overrides(tflops=tflops, **fields).apply(hw)


def describe_hardware(hw: Hardware, devices: int) -> str:
    nodes = -(-devices // hw.devices_per_node)
    rates = ", ".join(f"{d} {r / 1e12:.3g}" for d, r in sorted(hw.flops.items()))
    return (f"hardware {hw.name}: {devices} devices ({nodes} node(s) of "
            f"{hw.devices_per_node}); TFLOP/s {rates}; {hw.memory_bytes / GB:.3g} GB at "
            f"{hw.memory_bandwidth / GB:.4g} GB/s; within a node "
            f"{hw.intra_node.bandwidth / GB:.4g} GB/s after {hw.intra_node.latency * 1e6:.3g} "
            f"us, across nodes {hw.inter_node.bandwidth / GB:.4g} GB/s after "
            f"{hw.inter_node.latency * 1e6:.3g} us; efficiency {hw.efficiency:g}, "
            f"{hw.chunk_overhead * 1e3:.3g} ms a chunk and stage besides\n"
            f"  ({hw.source})")


# -- the search -----------------------------------------------------------------------------
def smooth_grid(text: str) -> list[float]:
    if text == "auto":
        return sorted({*SMOOTH_GRID, 0.8})
    try:
        sigma = float(text)
    except ValueError:
        sigma = -1.0
    if not 0.0 <= sigma <= 1.0:
        raise ValueError(f"--smooth-factor {text!r}: a number in [0, 1] or auto")
    return [sigma]


def pinned_layouts(ns, hw: Hardware, cfg: ModelConfig, devices: int) -> list[Layout] | None:
    if ns.pp_size is None and ns.tp_size is None:
        return None
    found = [lay for lay in layouts(cfg, hw, devices)
             if ns.pp_size in (None, lay.pp) and ns.tp_size in (None, lay.tp)]
    if not found:
        raise ValueError(f"no layout of {devices} devices has --pp-size {ns.pp_size} and "
                         f"--tp-size {ns.tp_size} (PP x TP x threads must be {devices}, PP at "
                         f"most {cfg.num_layers} layers, TP at most {cfg.num_heads} heads)")
    return found


def check_numbers(ns) -> None:
    for flag, value in (("--input-len", ns.input_len), ("--nodes", ns.nodes),
                        ("--page-size", ns.page_size), ("--max-chunk", ns.max_chunk),
                        ("--top", ns.top)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if ns.devices is not None and ns.devices < 1:
        raise ValueError(f"--devices must be at least 1, got {ns.devices}")


def run(ns: argparse.Namespace) -> int:
    check_numbers(ns)  # the flags and the model first: this-cpu measures for seconds
    smooths = smooth_grid(ns.smooth_factor)
    cfg, fp8 = read_model(ns.model_config)
    precision = precision_of(ns, fp8)
    hw = read_hardware(ns)
    devices = ns.devices or ns.nodes * hw.devices_per_node
    c0s = None if ns.chunked_prefill_size == "auto" else [ns.chunked_prefill_size]
    plans = search(cfg, hw, devices, precision, ns.input_len, c0s, smooths, ns.page_size,
                   ns.max_chunk, pinned_layouts(ns, hw, cfg, devices))
    print(describe_model(cfg, precision))
    print(describe_hardware(hw, devices))
    print_best(plans[0], ns.input_len, hw)
    print_table(plans[:ns.top])
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"input_len": ns.input_len, "devices": devices, "hardware": hw.name,
                       "efficiency": hw.efficiency,
                       "plans": [p.summary() for p in plans]}, f, indent=2)
    return 0


# -- the printout ---------------------------------------------------------------------------
def describe_model(cfg: ModelConfig, precision: Precision) -> str:
    kinds = layer_kinds(cfg)
    active = sum(k.fixed_weights + k.top_k * k.expert_weights for k in kinds)
    stored = sum(k.fixed_weights + k.num_experts * k.expert_weights for k in kinds)
    return (f"model {cfg.model_type}: {cfg.num_layers} layers, {active / 1e9:.3g}B of "
            f"{stored / 1e9:.3g}B layer weights active a token; {precision.weights} GEMMs, "
            f"{precision.compute} attention, {precision.kv} KV cache")


def serve_command(plan: Plan, hw: Hardware) -> str:
    lay = plan.layout
    parts = [f"pipefill serve --pp-size {lay.pp} --tp-size {lay.tp}"]
    if hw.devices_are_cores:
        parts.append(f"--threads-per-stage {lay.threads}")
    else:
        parts.append("--device cuda")
    nodes = -(-lay.devices // hw.devices_per_node)
    if nodes > 1:
        parts.append(f"--nnodes {nodes} --node-rank N --dist-init-addr HOST:PORT")
    parts.append(f"--chunked-prefill-size {plan.c0}")
    if plan.smooth > 0:
        parts.append(f"--enable-dynamic-chunking --dynamic-chunking-smooth-factor "
                     f"{plan.smooth:g}")
    return " ".join(parts)


def print_best(plan: Plan, input_len: int, hw: Hardware) -> None:
    chunks = (f"dynamic chunks from C0 {plan.c0}, sigma {plan.smooth:g}" if plan.smooth > 0
              else f"chunks of {plan.c0}")
    fits = "" if plan.fits else " (NOTHING FITS: this is the fastest that does not)"
    links = plan.link_bytes
    print(f"best for {input_len} tokens{fits}: {plan.layout}, {chunks}: TTFT "
          f"{plan.ttft_s:.4g} s (bubble {plan.bubble_ratio:.3f}, {plan.num_chunks} chunks); "
          f"{plan.throughput_tok_s:,.0f} tokens/s with prompts back to back")
    print(f"  per device: weights {plan.weight_bytes / GB:.3g} GB + KV "
          f"{plan.kv_bytes / GB:.3g} GB of {hw.memory_bytes * plan.layout.threads / GB:.3g} "
          f"GB; a prompt puts {links['intra_node'] / GB:.3g} GB on links within a node and "
          f"{links['inter_node'] / GB:.3g} GB across nodes "
          f"({sum(links.values()) / plan.ttft_s / GB:.3g} GB/s over the TTFT)")
    print(f"  layers per stage: {', '.join(map(str, plan.stage_layers))}")
    print(f"  run: {serve_command(plan, hw)}")


def print_table(plans: list[Plan]) -> None:
    print(f"{'layout':>14} {'C0':>6} {'sigma':>5} {'TTFT s':>9} {'bubble':>6} {'chunks':>6} "
          f"{'tok/s':>9} {'weights GB':>10} {'KV GB':>7} {'intra GB':>8} {'inter GB':>8} fits")
    for p in plans:
        print(f"{str(p.layout):>14} {p.c0:>6} {p.smooth:>5.2f} {p.ttft_s:>9.4g} "
              f"{p.bubble_ratio:>6.3f} {p.num_chunks:>6} {p.throughput_tok_s:>9.0f} "
              f"{p.weight_bytes / GB:>10.3g} {p.kv_bytes / GB:>7.3g} "
              f"{p.link_bytes['intra_node'] / GB:>8.3g} {p.link_bytes['inter_node'] / GB:>8.3g} "
              f"{'yes' if p.fits else 'no'}")
