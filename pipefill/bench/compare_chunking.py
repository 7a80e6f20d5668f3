"""`pipefill bench prefill --compare-chunking`: fixed chunks (a grid of C0), dynamic chunks and
`auto` side by side through the same pipeline, each with the simulator's prediction from the
stage-0 profile and the prediction error; then the same cost model simulated at larger
pipeline sizes (fixed vs dynamic)."""
from __future__ import annotations

import statistics

from pipefill.chunking.sim import CostModel, Transfer, chunk_plan, default_c0_grid, simulate, tune


def configs(args, c0_grid: list[int], with_auto: bool) -> list[tuple[str, object]]:
    # The comparison needs each engine's fitted policy from its first request on.
    args = args.replace(dynamic_chunking_profile="blocking")
    out = [("dynamic", args.replace(enable_dynamic_chunking=True))]
    if with_auto:
        out.append(("auto", args.replace(enable_dynamic_chunking=True,
                                         chunked_prefill_size="auto")))
    out += [(f"fixed-{c}", args.replace(chunked_prefill_size=c, enable_dynamic_chunking=False))
            for c in c0_grid]
    return out


def run_compare(args, cfg, prompt: list[int], c0_grid: list[int], reps: int,
                with_auto: bool, sim_pp_sizes=(4, 8)) -> dict:
    from pipefill.engine import Engine
    engines = {}
    try:
        for name, a in configs(args.replace(tune_input_len=len(prompt)), c0_grid, with_auto):
            engines[name] = Engine(**a.flags())
        coef = engines["dynamic"].chunking.get("coefficients")
        if coef is None:
            raise ValueError("the dynamic engine has no fitted profile: "
                             f"{engines['dynamic'].chunking.get('fallback')}")
        layers = args.layout.layer_counts
        model = CostModel(coef[0], max(coef[1], 0.0), coef[2]).with_stages(args.pp_size, layers)
        transfer = Transfer(bytes_per_token=cfg.hidden_size * 6)
        times = {n: [] for n in engines}
        chunks, bubbles = {}, {}
        for _ in range(reps):
            for name, e in engines.items():
                if e.args.trace_dir:
                    e.collect_trace()
                out = e.generate([prompt], max_new_tokens=1)[0]
                times[name].append(out.metrics["ttft_s"])
                chunks[name] = out.metrics["chunk_sizes"]
                if e.args.trace_dir:
                    bubbles[name] = e.write_trace(f"chunking-{name}-len{len(prompt)}")
        rows = []
        for name, e in engines.items():
            predicted = simulate(model, chunks[name], transfer, e.args.layout.max_inflight)
            measured = statistics.median(times[name])
            rows.append({"config": name, "c0": e.chunking["c0"],
                         "smooth_factor": e.chunking.get("smooth_factor", 0.0),
                         "chunks": chunks[name], "ttft_s": measured, "times_s": times[name],
                         "predicted_ttft_s": predicted.ttft_s,
                         "prediction_error": predicted.ttft_s / measured - 1,
                         "predicted_bubble": predicted.bubble_ratio,
                         "measured_bubble": bubbles.get(name, {}).get("bubble_ratio"),
                         "auto": e.chunking.get("auto")})
            print_row(rows[-1])
        sims = simulate_larger(model, layers, cfg.num_layers, len(prompt), args, transfer,
                               c0_grid, engines["dynamic"].chunking, sim_pp_sizes)
        return {"cost_model": coef, "rows": rows, "simulated": sims}
    finally:
        for e in engines.values():
            e.shutdown()


def simulate_larger(model: CostModel, layers: list[int], num_layers: int, prompt_len: int,
                    args, transfer, c0_grid, chunking: dict, pp_sizes) -> list[dict]:
    """The measured stage-0 cost model, rescaled per layer, through P stages: the best fixed
    C0 of the grid against dynamic chunks (C0 and smooth factor tuned by the simulator)."""
    per_layer = 1.0 / layers[0]
    out = []
    for p in pp_sizes:
        counts = [num_layers // p + (1 if i >= p - num_layers % p else 0) for i in range(p)]
        m = CostModel(model.a * per_layer * counts[0], model.b * per_layer * counts[0],
                      model.c * per_layer * counts[0]).with_stages(p, counts)
        grid = sorted(set(c0_grid) | set(default_c0_grid(prompt_len, args.page_size,
                                                          args.max_prefill_tokens)))
        fixed = tune(m, prompt_len, grid, [0.0], transfer, p + args.pp_async_batch_depth,
                     args.page_size)[0]
        dyn = tune(m, prompt_len, grid, [0.5, 0.65, 0.75, 0.85, 1.0], transfer,
                   p + args.pp_async_batch_depth, args.page_size)[0]
        row = {"pp_size": p, "fixed": vars(fixed), "dynamic": vars(dyn),
               "dynamic_ttft_gain": 1 - dyn.ttft_s / fixed.ttft_s}
        default_dyn = simulate(m, chunk_plan(m, prompt_len, chunking["c0"],
                                             chunking.get("smooth_factor", 0.75),
                                             args.page_size), transfer, p)
        row["dynamic_at_engine_c0"] = {"ttft_s": default_dyn.ttft_s,
                                       "bubble_ratio": default_dyn.bubble_ratio}
        out.append(row)
        print(f"simulated PP{p}: fixed best C0 {fixed.c0}: TTFT {fixed.ttft_s:.2f} s, bubble "
              f"{fixed.bubble_ratio:.3f} | dynamic C0 {dyn.c0} smooth {dyn.smooth}: TTFT "
              f"{dyn.ttft_s:.2f} s, bubble {dyn.bubble_ratio:.3f} | dynamic "
              f"{100 * row['dynamic_ttft_gain']:.1f}% lower TTFT", flush=True)
    return out


def print_row(r: dict) -> None:
    bubble = (f"  bubble {r['measured_bubble']:.3f} (sim {r['predicted_bubble']:.3f})"
              if r["measured_bubble"] is not None else f"  sim bubble {r['predicted_bubble']:.3f}")
    print(f"{r['config']:>11} C0 {r['c0']:>5} smooth {r['smooth_factor']:.2f}: TTFT "
          f"{r['ttft_s']:7.3f} s  predicted {r['predicted_ttft_s']:7.3f} s "
          f"({100 * r['prediction_error']:+.1f}%){bubble}  {len(r['chunks'])} chunks",
          flush=True)
