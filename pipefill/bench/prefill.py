"""`pipefill bench prefill`: TTFT of long prompts, pipefill beside HF transformers.

For each length, the same random prompt goes through each pipefill configuration (real stage
processes) and through Hugging Face transformers' forward (sdpa, logits_to_keep=1) on the same
weights in this process, alternating A B C A B C ... so that the machine's drift hits all alike;
medians are reported with their spread [min-max] over the repetitions, and pipefill / HF is
the median of the per-repetition ratios (each pair timed back to back). Achieved TFLOP/s are given against a matmul peak measured by the same
command.

With --pp-size 1,2 every pipeline size runs with the same threads per stage (default: usable
cores // largest pp size), plus PP1 on all usable cores; the strong-scaling efficiency is
T(PP1, same threads per stage) / (P * T(PP P)), and with --trace-dir the measured bubble ratio
of the last repetition is printed next to the theory (P-1)/(P-1+M). --with-auto times every
configuration again with --chunked-prefill-size auto (PP1 auto is then the efficiency's base).

Every repetition is a cold prefill (the prefix cache is off). Each row also gives the peak RSS
of its stage processes during that length beside weights + KV (pipefill.bench.memory).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import time
from dataclasses import dataclass

import torch

from pipefill.bench.memory import (add_baselines, format_report, held_kv_bytes,
                                   memory_report, proc_status_bytes, reset_peak_rss,
                                   stage_needs)
from pipefill.bench.roofline import matmul_peak_flops, prefill_flops
from pipefill.config import (ServerArgs, server_args_from_namespace,
                             server_args_parser_group)
from pipefill.kv.window import ring_pages
from pipefill.model.attention import KERNEL_BACKENDS

log = logging.getLogger("pipefill.bench")


def add_parser(sub) -> None:
    p = sub.add_parser("prefill", help="prefill TTFT against HF transformers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", default="1024,4096,8192",
                   help="comma-separated prompt lengths in tokens")
    p.add_argument("--pp-size", default="1", dest="pp_sizes",
                   help="comma-separated pipeline sizes to compare, e.g. 1,2")
    p.add_argument("--reps", type=int, default=3, help="repetitions per length (median)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--no-split", action="store_true",
                   help="skip the linear/attention/overhead time split")
    p.add_argument("--json", metavar="FILE", help="write every number to this JSON file")
    p.add_argument("--compare-chunking", action="store_true",
                   help="fixed chunks (--chunk-grid) vs dynamic chunks (vs auto with "
                        "--with-auto) through --pp-size, with the simulator's predictions")
    p.add_argument("--chunk-grid", default="1024,2048,4096",
                   help="C0 values of the fixed configurations of --compare-chunking")
    p.add_argument("--with-auto", action="store_true",
                   help="add --chunked-prefill-size auto to --compare-chunking; without it, "
                        "time every --pp-size configuration once more with auto chunking "
                        "(efficiency against PP1 with auto)")
    p.add_argument("--compare-prefill-gemm", metavar="LIST", default="",
                   help="also time every configuration with each of these --prefill-gemm "
                        "values (comma-separated: torch, onednn), in turn with it in every "
                        "repetition, named <configuration>-<value>")
    p.add_argument("--compare-attention-backend", metavar="LIST", default="",
                   help="likewise for --attention-backend values (comma-separated, e.g. auto "
                        "beside --attention-backend sdpa)")
    p.add_argument("--compare-weight-dtype", metavar="LIST", default="",
                   help="likewise for --weight-dtype values (comma-separated, e.g. bfloat16,gguf: "
                        "a GGUF file dequantized against its blocks kept quantized)")
    p.add_argument("--compare-tp-size", metavar="LIST", default="",
                   help="also time every configuration whose processes then still fit the "
                        "usable cores with each of these --tp-size values (comma-separated, "
                        "e.g. 2), named <configuration>-tp<N>: tensor parallelism inside a "
                        "stage beside pipeline parallelism")
    p.add_argument("--compare-tp-moe-split", metavar="LIST", default="",
                   help="time every tensor-parallel configuration (--tp-size or "
                        "--compare-tp-size) once with each of these --tp-moe-split values "
                        "(comma-separated: width, expert) in its place, named "
                        "<configuration>-<value>, in turn in every repetition")
    p.add_argument("--compare-tp-stage-transport", metavar="LIST", default="",
                   help="also time every configuration with --pp-size > 1 and --tp-size > 1 "
                        "with each of these --tp-stage-transport values (comma-separated: "
                        "per_rank, leader), named <configuration>-<value>")
    add_peer_flags(p)
    server_args_parser_group(p, skip=("pp_size",))
    p.set_defaults(run=run)


def add_peer_flags(p) -> None:
    """--peer and --peer-python, shared with `bench decode`."""
    p.add_argument("--peer", choices=("llama.cpp",), default=None,
                   help="also time llama.cpp (llama-cpp-python) on the same GGUF file with the "
                        "same threads, in turn with pipefill in every repetition")
    p.add_argument("--peer-python", metavar="PATH", default=None,
                   help="the Python whose environment has llama-cpp-python (default: "
                        "$PIPEFILL_LLAMA_PYTHON, then ~/peers-work/llama-venv/bin/python, "
                        "then this Python)")


def start_peer(ns, model_path: str, threads: int, n_ctx: int):
    """The llama.cpp peer --peer asks for, or None."""
    if ns.peer is None:
        return None
    from pipefill.bench.llama_peer import LlamaPeer, peer_python
    peer = LlamaPeer(model_path, threads, n_ctx, peer_python(ns.peer_python))
    log.info("llama.cpp peer: llama-cpp-python %s, %d threads", peer.version, threads)
    return peer


def parse_ints(text: str, flag: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{flag} needs values of at least {minimum}")
    return values


@dataclass
class Config:
    name: str
    args: ServerArgs


def make_configs(args: ServerArgs, pp_sizes: list[int], with_auto: bool = False
                 ) -> list[Config]:
    """The configurations to time; with_auto adds each one again with --chunked-prefill-size
    auto (and dynamic chunking where pp > 1), named "<name>-auto"."""
    cores = len(os.sched_getaffinity(0))
    if pp_sizes == [1]:
        tp = f"-tp{args.tp_size}" if args.tp_size > 1 else ""
        configs = [Config(f"pp1-t{args.layout.num_threads}{tp}", args)]
    else:
        threads = args.threads_per_stage or max(1, cores // max(pp_sizes))
        configs = [Config(f"pp{p}-t{threads}",
                          args.replace(pp_size=p, threads_per_stage=threads))
                   for p in sorted(set([1] + pp_sizes))]
        if cores > threads:
            configs.append(Config(f"pp1-t{cores}",
                                  args.replace(pp_size=1, threads_per_stage=cores)))
    if with_auto and args.chunked_prefill_size != "auto":
        configs += [Config(f"{c.name}-auto", c.args.replace(
            chunked_prefill_size="auto", enable_dynamic_chunking=c.args.pp_size > 1))
            for c in configs]
    return configs


def tp_variants(configs: list[Config], values: str) -> list[Config]:
    """Every configuration again with each --tp-size of `values` where pp x tp processes of
    its threads fit the usable cores (one thread per rank against a stage of several)."""
    if not values.strip():
        return []
    cores = len(os.sched_getaffinity(0))
    return [Config(f"{c.name}-tp{t}", c.args.replace(tp_size=t))
            for t in parse_ints(values, "--compare-tp-size", minimum=2) for c in configs
            if c.args.pp_size * t * c.args.layout.num_threads <= cores]


def moe_split_variants(configs: list[Config], values: str) -> list[Config]:
    """The configurations with each tensor-parallel one replaced by one per --tp-moe-split
    value of `values` (none given: the configurations as they are)."""
    if not values.strip():
        return configs
    tp = [c for c in configs if c.args.tp_size > 1]
    if not tp:
        raise ValueError("--compare-tp-moe-split needs a tensor-parallel configuration: pass "
                         "--tp-size or --compare-tp-size")
    return [c for c in configs if c.args.tp_size == 1] + flag_variants(
        tp, "tp_moe_split", values, ("width", "expert"))


def gemm_variants(configs: list[Config], values: str) -> list[Config]:
    """Every configuration again with each --prefill-gemm value of `values`."""
    from pipefill.kernels.prefill_gemm import CHOICES
    return flag_variants(configs, "prefill_gemm", values, CHOICES)


def attention_variants(configs: list[Config], values: str) -> list[Config]:
    return flag_variants(configs, "attention_backend", values,
                         ("auto", *KERNEL_BACKENDS, "sdpa"))


def weight_variants(configs: list[Config], values: str) -> list[Config]:
    """Every configuration again with each --weight-dtype value of `values` (auto against
    gguf: dequantized weights against GGUF blocks kept quantized)."""
    from pipefill.model.loader import WEIGHT_DTYPES
    return flag_variants(configs, "weight_dtype", values, WEIGHT_DTYPES)


def transport_variants(configs: list[Config], values: str) -> list[Config]:
    """The configurations with stages of several TP ranks again with each
    --tp-stage-transport value of `values`."""
    staged = [c for c in configs if c.args.pp_size > 1 and c.args.tp_size > 1]
    return flag_variants(staged, "tp_stage_transport", values, ("per_rank", "leader"))


def flag_variants(configs: list[Config], flag: str, values: str,
                  choices: tuple[str, ...]) -> list[Config]:
    """Every configuration again with each value of `values` (comma-separated) for `flag`,
    named <configuration>-<value>."""
    wanted = [v.strip() for v in values.split(",") if v.strip()]
    for v in wanted:
        if v not in choices:
            raise ValueError(f"--compare-{flag.replace('_', '-')} {v!r}: choose from "
                             f"{', '.join(choices)}")
    return [Config(f"{c.name}-{v}", c.args.replace(**{flag: v})) for v in wanted
            for c in configs]


def run(ns: argparse.Namespace) -> int:
    from pipefill.config import resolve
    from pipefill.model.loader import WeightSource, resolve_model_path
    from pipefill.base.platform import resolve_dtype

    lengths = parse_ints(ns.input_len, "--input-len")
    pp_sizes = parse_ints(ns.pp_sizes, "--pp-size")
    # Timed runs need the fitted chunk policy from the first request on: profile before serving.
    args = server_args_from_namespace(ns).replace(dynamic_chunking_profile="blocking")
    source = WeightSource(resolve_model_path(args.model_path))
    need = max(lengths) + 1  # the prompt and its first token
    if args.max_model_len is None and max(lengths) <= source.config.max_position_embeddings:
        args = args.replace(max_model_len=max(need, source.config.max_position_embeddings))
    # Every repetition is a cold prefill: with the prefix cache on, repetitions 2.. would
    # reuse the first one's pages and time only the last partial page.
    args = resolve(args, source.config, source.family.layer_costs(source.config)).replace(
        disable_radix_cache=True)
    if need > args.max_model_len:
        raise ValueError(f"--input-len {max(lengths)} does not fit --max-model-len "
                         f"{args.max_model_len}; pass --max-model-len {need} or more")
    if ns.compare_chunking:
        return run_compare_chunking(ns, args, source, lengths, pp_sizes)
    configs = make_configs(args, pp_sizes, ns.with_auto)
    base = configs
    configs = configs + gemm_variants(base, ns.compare_prefill_gemm) \
        + attention_variants(base, ns.compare_attention_backend) \
        + weight_variants(base, ns.compare_weight_dtype) \
        + tp_variants(base, ns.compare_tp_size) \
        + transport_variants(base, ns.compare_tp_stage_transport)
    configs = moe_split_variants(configs, ns.compare_tp_moe_split)
    dtype = resolve_dtype(args.dtype)
    threads = len(os.sched_getaffinity(0)) if len(configs) > 1 else \
        args.layout.num_threads
    torch.set_num_threads(threads)
    peak = matmul_peak_flops(dtype)
    print(f"matmul peak ({args.dtype}, {threads} threads): {peak / 1e12:.2f} TFLOP/s")
    rng = random.Random(args.seed)
    prompts = {n: [rng.randrange(100, source.config.vocab_size) for _ in range(n)]
               for n in lengths}
    peer = start_peer(ns, resolve_model_path(args.model_path), threads, need + 16)
    hf = None if ns.no_hf else load_hf_model(source, dtype)
    try:
        rows = run_configs(configs, hf, source, prompts, ns.reps, peak, peer)
    finally:
        if peer is not None:
            peer.close()
    if hf is None:
        print("peak RSS of the bench process (front end): "
              f"{proc_status_bytes(os.getpid(), 'VmHWM') / 2**20:.0f} MiB")
    if not ns.no_split:
        from pipefill.bench.time_split import prefill_time_split
        split_cfg = max((c for c in configs if c.args.pp_size == 1 and c.args.tp_size == 1),
                        key=lambda c: c.args.layout.num_threads, default=None)
        for row in rows:  # no split where every configuration is tensor-parallel
            if split_cfg is not None and row["config"] == split_cfg.name:
                args = split_cfg.args
                if args.chunked_prefill_size == "auto":  # the C0 auto chose in the timed run
                    args = args.replace(chunked_prefill_size=row["chunk_sizes"][0])
                row["split"] = prefill_time_split(args, source, prompts[row["len"]])
                print_split(row, peak)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": args.flags(), "matmul_peak_flops": peak,
                       "bench_threads": threads,
                       "torch": torch.__version__, "rows": rows}, f, indent=2)
        print(f"wrote {ns.json}")
    return 0


def run_compare_chunking(ns, args, source, lengths, pp_sizes) -> int:
    from pipefill.bench.compare_chunking import run_compare
    if max(pp_sizes) < 2:
        raise ValueError("--compare-chunking needs --pp-size 2 or more: dynamic chunking "
                         "only changes pipeline bubbles")
    args = args.replace(pp_size=max(pp_sizes))
    rng = random.Random(args.seed)
    results = []
    for n in lengths:
        prompt = [rng.randrange(100, source.config.vocab_size) for _ in range(n)]
        print(f"--- {n} tokens, PP{args.pp_size}, {args.layout.num_threads} thread(s) per "
              "stage")
        results.append({"len": n, **run_compare(args, source.config, prompt,
                                                parse_ints(ns.chunk_grid, "--chunk-grid"),
                                                ns.reps, ns.with_auto)})
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": args.flags(), "results": results}, f, indent=2)
        print(f"wrote {ns.json}")
    return 0


def run_configs(configs: list[Config], hf, source, prompts: dict, reps: int, peak: float,
                peer=None):
    from pipefill.engine import Engine
    cfg = source.config
    engines = {}
    try:
        load_peaks = {}  # each stage's peak RSS while it started (loading the weights)
        for c in configs:
            engines[c.name] = Engine(**c.args.flags())
            load_peaks[c.name] = [proc_status_bytes(pid, "VmHWM")
                                  for pid in engines[c.name].stage_pids()]
        rows = []
        for n, prompt in prompts.items():
            times = {c.name: [] for c in configs}
            chunks, traces = {}, {}
            hf_times, peer_times = [], []
            rss_before = {}  # resident before this length: weights, KV pages touched earlier
            for name, engine in engines.items():
                for pid in engine.stage_pids():
                    reset_peak_rss(pid)
                rss_before[name] = [proc_status_bytes(pid, "VmRSS")
                                    for pid in engine.stage_pids()]
            reset_peak_rss(os.getpid())
            for rep in range(reps):
                for c in configs:  # A B C A B C: drift hits every configuration alike
                    engine = engines[c.name]
                    if c.args.trace_dir:
                        engine.collect_trace()  # drop spans of earlier runs
                    out = engine.generate([prompt], max_new_tokens=1)[0]
                    times[c.name].append(out.metrics["ttft_s"])
                    chunks[c.name] = out.metrics["chunk_sizes"]
                    if c.args.trace_dir and rep == reps - 1:
                        traces[c.name] = engine.write_trace(f"{c.name}-len{n}")
                if hf is not None:
                    hf_times.append(hf_prefill_seconds(hf, prompt))
                if peer is not None:
                    peer_times.append(peer.prefill_seconds(prompt))
            flops = prefill_flops(cfg, n)
            hf_row = summary(hf_times, flops, peak, n) if hf_times else None
            engine_peak = proc_status_bytes(os.getpid(), "VmHWM")
            for c in configs:
                row = {"len": n, "config": c.name, "pp_size": c.args.pp_size,
                       "tp_size": c.args.tp_size,
                       "threads_per_stage": c.args.layout.num_threads,
                       "chunk_sizes": chunks[c.name],
                       "pipefill": summary(times[c.name], flops, peak, n),
                       "memory": stage_memory(engines[c.name], c.args, source, n, engine_peak,
                                              load_peaks[c.name], rss_before[c.name]),
                       "trace": traces.get(c.name)}
                if hf_row:
                    row["hf"] = hf_row
                    row["ratio_ttft_pipefill_over_hf"] = paired_ratio(times[c.name], hf_times)
                if peer_times:
                    row["llama.cpp"] = summary(peer_times, flops, peak, n)
                    row["ratio_ttft_pipefill_over_llama_cpp"] = paired_ratio(times[c.name],
                                                                             peer_times)
                rows.append(row)
            add_scaling(rows[-len(configs):])
            for row in rows[-len(configs):]:
                print_row(row)
        return rows
    finally:
        for e in engines.values():
            e.shutdown()


def stage_memory(engine, args: ServerArgs, source, n: int, engine_peak: int,
                 load_peaks: list[int], rss_before: list[int]) -> dict:
    """Peak RSS of the engine's stage processes since the last reset, beside weights + KV
    (a GGUF file's blocks where the stages keep them), with each stage's RSS before this
    length and its peak while it started."""
    cfg = source.config
    needs = stage_needs(args, cfg, n, engine.kv_capacity_tokens, source=source)
    peaks = [proc_status_bytes(pid, "VmHWM") for pid in engine.stage_pids()]
    report = memory_report(needs, peaks, engine_peak)
    for stage, load_peak, before in zip(report["stages"], load_peaks, rss_before):
        stage["load_peak_rss"], stage["rss_before"] = load_peak, before
    report["total_load_peak_rss"] = sum(load_peaks)
    report["total_rss_before"] = sum(rss_before)
    stats = engine.stats()
    add_baselines(report, [stage.get("memory", {}) for stage in stats["stages"]])
    if "window_pages_peak" in stats:  # window layers with pages of their own
        # The pools' peaks since the stages started: the longest prompt's, run alone.
        pages, window = stats["pages_peak"], stats["window_pages_peak"]
        one_window = -(-cfg.sliding_window // args.page_size)
        # A request's window layers cycle through a ring of a window and a piece, whatever
        # its chunks (ARCHITECTURE.md, 'Window pages').
        ring = ring_pages(args.page_size, cfg.sliding_window)
        report["pages"] = {"pages_peak": pages, "window_pages_peak": window,
                           "kv_held": held_kv_bytes(args, cfg, pages, window),
                           "kv_one_window": held_kv_bytes(args, cfg, pages, one_window),
                           "kv_ring": held_kv_bytes(args, cfg, pages, ring),
                           "kv_every_token": held_kv_bytes(args, cfg, pages, pages)}
    return report


def add_scaling(rows: list[dict]) -> None:
    """Strong-scaling efficiency against one process (PP1, TP1) with the same threads per
    process, and the speed-up over one process on every core."""
    def key(r):  # same threads per stage, same chunking (fixed or auto)
        return r["threads_per_stage"], r["config"].endswith("-auto")

    def processes(r):
        return r["pp_size"] * r.get("tp_size", 1)
    base = {key(r): r for r in rows if processes(r) == 1}
    for r in rows:
        b = base.get(key(r))
        if processes(r) > 1 and b:
            r["scaling_efficiency"] = b["pipefill"]["ttft_s"] / (
                processes(r) * r["pipefill"]["ttft_s"])
        others = [x for x in rows
                  if processes(x) == 1 and x is not b and key(x)[1] == key(r)[1]]
        if processes(r) > 1 and others:
            r["speedup_vs_pp1_all_cores"] = others[0]["pipefill"]["ttft_s"] / r["pipefill"]["ttft_s"]


def summary(times: list[float], flops: dict, peak: float, n: int) -> dict:
    med = statistics.median(times)
    return {"ttft_s": med, "times_s": times, "min_s": min(times), "max_s": max(times),
            "tok_per_s": n / med, "tflops": flops["total"] / med / 1e12,
            "of_peak": flops["total"] / med / peak}


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median over repetitions of ours / theirs, each pair timed back to back: a slow
    phase of the machine hits both sides of a pair, so it cancels in the ratio."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def load_hf_model(source, dtype: torch.dtype):
    """HF transformers model on the same weights: a HF folder as is; a GGUF file through
    pipefill's dequantizer into the matching transformers class."""
    from transformers import AutoModelForCausalLM
    log.info("loading the HF transformers baseline on the same weights")
    if source.gguf is None:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype,
                                                     attn_implementation="sdpa")
    else:
        model = hf_model_from_source(source, dtype)
    model.eval()
    hf_prefill_seconds(model, list(range(100, 356)))  # warm-up
    return model


def hf_model_from_source(source, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM
    c = source.config
    hf_cfg = AutoConfig.for_model(
        c.model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    state = {name: source.load(name) for name in model.state_dict() if source.has(name)}
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
    assert not missing, f"HF baseline: weights missing from the source: {missing[:3]}"
    return model.to(dtype)


def hf_prefill_seconds(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        out.logits[:, -1].argmax(-1)
        return time.perf_counter() - t0


def print_row(row: dict) -> None:
    p = row["pipefill"]
    line = (f"len {row['len']:>6} {row['config']:>7}  TTFT {p['ttft_s']:7.3f} s "
            f"[{p['min_s']:.3f}-{p['max_s']:.3f}] {p['tok_per_s']:6.0f} tok/s  {p['tflops']:.3f} TF/s ({100 * p['of_peak']:.0f}% "
            f"of peak)")
    if "scaling_efficiency" in row:
        line += f"  efficiency {row['scaling_efficiency']:.2f}"
    if "speedup_vs_pp1_all_cores" in row:
        line += f"  vs PP1 all cores x{row['speedup_vs_pp1_all_cores']:.2f}"
    if row.get("trace"):
        t = row["trace"]
        line += f"  bubble {t['bubble_ratio']:.3f} (theory {t['bubble_theory']:.3f})"
    if "hf" in row:
        h = row["hf"]
        line += (f"  |  HF TTFT {h['ttft_s']:7.3f} s [{h['min_s']:.3f}-{h['max_s']:.3f}] "
                 f"{h['tflops']:.3f} TF/s"
                 f"  |  pipefill/HF {row['ratio_ttft_pipefill_over_hf']:.2f}")
    if "llama.cpp" in row:
        lc = row["llama.cpp"]
        line += (f"  |  llama.cpp TTFT {lc['ttft_s']:7.3f} s [{lc['min_s']:.3f}-{lc['max_s']:.3f}]"
                 f"  |  pipefill/llama.cpp {row['ratio_ttft_pipefill_over_llama_cpp']:.2f}")
    print(line, flush=True)
    print(f"len {row['len']:>6} {row['config']:>7}  {format_report(row['memory'])}", flush=True)


def print_split(row: dict, peak: float) -> None:
    s = row["split"]
    w = s["wall_s"]
    print(f"len {row['len']:>6} {row['config']:>7}  time split: linear {s['linear_s']:.2f} s "
          f"({100 * s['linear_s'] / w:.0f}%), attention {s['attention_s']:.2f} s "
          f"({100 * s['attention_s'] / w:.0f}%), other {s['other_s']:.2f} s "
          f"({100 * s['other_s'] / w:.0f}%) of {w:.2f} s", flush=True)
    if "experts_s" in s:  # a mixture-of-experts model: the routed experts on their own
        t = s["experts_s"]
        flops = s["expert_flops"] / t if t > 0 else 0.0
        s["experts_flops_per_s"], s["experts_of_peak"] = flops, flops / peak
        print(f"len {row['len']:>6} {row['config']:>7}  routed experts {t:.2f} s "
              f"({100 * t / w:.0f}% of the stage's time) at {flops / 1e12:.3f} TF/s = "
              f"{100 * flops / peak:.0f}% of the matmul peak", flush=True)
