"""`pipefill sim`: the pipeline simulator on the command line (ARCHITECTURE.md, 'The chunking
room')."""
from __future__ import annotations

import argparse
import json

from pipefill.chunking.cost import fit_quadratic
from pipefill.chunking.sim import (SMOOTH_GRID, CostModel, Transfer, chunk_plan, default_c0_grid,
                                   describe_chunks, pick, plot_timeline, simulate, tune)
from pipefill.base.partition import partition_layers
from pipefill.config.args import chunk_size_flag
from pipefill.model.families import family_for_hf_config


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sim", help="simulate chunked pipeline prefill from a cost model",
        description="Replay a prompt's chunks through P stages from a fitted cost model "
                    "f(l) = a*l^2 + b*l + c (stage 0's seconds for an l-token prefill): TTFT, "
                    "per-stage busy time, bubble ratio, the chunk list and a PNG timeline.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--coefficients", metavar="A,B,C", help="cost model coefficients")
    src.add_argument("--profile", metavar="FILE",
                     help="a start-up profile JSON (from ~/.cache/pipefill/profiles) to fit")
    src.add_argument("--model-config", metavar="FILE",
                     help="a model's config.json (dense or mixture-of-experts): the cost model "
                          "from its active weights and attention shape at --tflops, its layers "
                          "split as pipefill would (balanced by their costs)")
    p.add_argument("--tflops", type=float, default=100.0,
                   help="with --model-config: the FLOP/s (in TFLOP/s) one stage achieves")
    p.add_argument("--overhead-ms", type=float, default=1.0,
                   help="with --model-config: fixed milliseconds per chunk and stage")
    p.add_argument("--input-len", type=int, required=True, help="prompt tokens")
    p.add_argument("--pp-size", type=int, default=2, help="pipeline stages")
    p.add_argument("--stage-scale", metavar="S0,S1,...",
                   help="per-stage cost multipliers (uneven partitions); default all 1")
    p.add_argument("--chunked-prefill-size", default=2048, type=chunk_size_flag,
                   help="C0 in tokens, or auto (grid search)")
    p.add_argument("--dynamic", action="store_true", help="dynamic chunking")
    p.add_argument("--smooth-factor", type=float, default=0.75, help="sigma of dynamic chunks")
    p.add_argument("--compare", action="store_true", help="fixed and dynamic side by side")
    p.add_argument("--page-size", type=int, default=64, help="chunk alignment")
    p.add_argument("--pp-async-batch-depth", type=int, default=0,
                   help="micro-batches in flight beyond pp-size")
    p.add_argument("--latency-us", type=float, default=200.0, help="per-transfer latency")
    p.add_argument("--bandwidth-gbps", type=float, default=3.0, help="GB/s between stages")
    p.add_argument("--bytes-per-token", type=int, default=576 * 6,
                   help="activation bytes per token crossing a border")
    p.add_argument("--png", metavar="FILE", help="write the timeline(s) here")
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.set_defaults(run=run)


def parse_floats(text: str, flag: str, count: int | None = None) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated numbers") from None
    if count is not None and len(values) != count:
        raise ValueError(f"{flag} needs {count} values, got {len(values)}")
    return values


def model_cost(ns) -> CostModel:
    """The cost model a config.json implies (see CostModel.from_shapes)."""
    with open(ns.model_config) as f:
        d = json.load(f)
    family = family_for_hf_config(d)
    cfg = family.config_from_hf(d)
    params = family.layer_costs(cfg)
    counts = [len(r) for r in partition_layers(cfg.num_layers, ns.pp_size, costs=params)]
    if ns.tflops <= 0:
        raise ValueError("--tflops must be positive")
    model = CostModel.from_shapes(params, cfg.attention_width, counts, ns.tflops * 1e12,
                                  ns.overhead_ms * 1e-3)
    active = sum(params) / 1e9
    print(f"{cfg.model_type}: {cfg.num_layers} layers, {active:.1f}B weights a token "
          f"multiplies by in its layers, stages of {counts} layers at {ns.tflops:g} TFLOP/s: "
          f"f(l) = {model.a:.3g} l^2 + {model.b:.3g} l + {model.c:.3g} s on stage 0")
    return model


def cost_model(ns) -> CostModel:
    if ns.model_config:
        return model_cost(ns)
    if ns.coefficients:
        a, b, c = parse_floats(ns.coefficients, "--coefficients", 3)
    else:
        with open(ns.profile) as f:
            data = json.load(f)
        a, b, c = fit_quadratic(data["lengths"], data["seconds"])
    if a <= 0:
        raise ValueError(f"the cost model's a = {a:.3g} must be positive (costs must grow "
                         "with position)")
    scale = parse_floats(ns.stage_scale, "--stage-scale", ns.pp_size) if ns.stage_scale \
        else [1.0] * ns.pp_size
    return CostModel(a, max(b, 0.0), c, tuple(scale))


def run(ns: argparse.Namespace) -> int:
    if ns.pp_size < 1 or ns.input_len < 1:
        raise ValueError("--pp-size and --input-len must be at least 1")
    model = cost_model(ns)
    transfer = Transfer(ns.latency_us * 1e-6, ns.bytes_per_token, ns.bandwidth_gbps * 1e9)
    inflight = ns.pp_size + ns.pp_async_batch_depth
    if ns.chunked_prefill_size == "auto":
        grid = default_c0_grid(ns.input_len, ns.page_size, 1 << 30)
        sigmas = list(SMOOTH_GRID) if ns.dynamic else [0.0]
        ranked = tune(model, ns.input_len, grid, sigmas, transfer, inflight, ns.page_size)
        for cand in ranked[:5]:
            print(f"C0 {cand.c0:>6} smooth {cand.smooth:.2f}: TTFT {cand.ttft_s:8.3f} s, bubble "
                  f"{cand.bubble_ratio:.3f}, {cand.num_chunks} chunks")
        chosen, _ = pick(ranked)
        print(f"auto picks C0 {chosen.c0}, smooth {chosen.smooth:.2f} (fewest chunks among "
              "those within 3% of the fastest)")
        c0, ns.smooth_factor = chosen.c0, chosen.smooth
    else:
        c0 = ns.chunked_prefill_size
    policies = [("fixed", 0.0), ("dynamic", ns.smooth_factor)] if ns.compare else \
        [("dynamic" if ns.dynamic else "fixed", ns.smooth_factor if ns.dynamic else 0.0)]
    results = {}
    for name, sigma in policies:
        chunks = chunk_plan(model, ns.input_len, c0, sigma, ns.page_size)
        r = simulate(model, chunks, transfer, inflight)
        results[name] = {**r.summary(), "c0": c0, "smooth_factor": sigma}
        busy = ", ".join(f"{b:.2f}" for b in r.busy_s)
        print(f"{name:>7} C0 {c0} (smooth {sigma:.2f}), P = {ns.pp_size}: TTFT "
              f"{r.ttft_s:.3f} s, bubble {r.bubble_ratio:.3f} (theory for M = "
              f"{len(chunks)}: {r.bubble_theory:.3f}); busy per stage [{busy}] s")
        print(f"        chunks: {describe_chunks(chunks)}")
        if ns.png:
            path = ns.png if len(policies) == 1 else ns.png.replace(".png", f"-{name}.png")
            plot_timeline(r, path, f"{name} chunks, P = {ns.pp_size}, {ns.input_len} tokens: "
                                   f"TTFT {r.ttft_s:.2f} s, bubble {r.bubble_ratio:.3f}")
            print(f"        timeline: {path}")
    if ns.compare:
        gain = 1 - results["dynamic"]["ttft_s"] / results["fixed"]["ttft_s"]
        print(f"dynamic vs fixed: TTFT {100 * gain:.1f}% lower" if gain >= 0 else
              f"dynamic vs fixed: TTFT {-100 * gain:.1f}% higher")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"model": [model.a, model.b, model.c], "stage_scale": model.stage_scale,
                       "results": results}, f, indent=2)
    return 0
