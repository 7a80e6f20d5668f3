"""`pipefill bench prefill`: TTFT of long prompts, pipefill beside HF transformers.

For each length, the same random prompt goes through pipefill (real stage processes) and
through Hugging Face transformers' forward (sdpa, logits_to_keep=1) on the same weights in this
process, alternating A B A B so that the machine's drift hits both alike. Achieved TFLOP/s are
given against a matmul peak measured by the same command.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time

import torch

from pipefill.bench.roofline import matmul_peak_flops, prefill_flops
from pipefill.config import server_args_from_namespace

log = logging.getLogger("pipefill.bench")


def add_parser(sub) -> None:
    from pipefill.cli.main import server_args_parser_group
    p = sub.add_parser("prefill", help="prefill TTFT against HF transformers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", default="1024,4096,8192",
                   help="comma-separated prompt lengths in tokens")
    p.add_argument("--reps", type=int, default=3, help="repetitions per length (median)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--no-split", action="store_true",
                   help="skip the linear/attention/overhead time split")
    p.add_argument("--json", metavar="FILE", help="write every number to this JSON file")
    server_args_parser_group(p)
    p.set_defaults(run=run)


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--input-len {text!r}: expected comma-separated integers") from None
    if not lengths or min(lengths) < 1:
        raise ValueError("--input-len needs positive lengths")
    return lengths


def run(ns: argparse.Namespace) -> int:
    from pipefill.config import resolve
    from pipefill.engine import Engine
    from pipefill.model.loader import WeightSource, resolve_model_path
    from pipefill.runtime.platform import resolve_dtype

    lengths = parse_lengths(ns.input_len)
    args = server_args_from_namespace(ns)
    source = WeightSource(resolve_model_path(args.model_path))
    need = max(lengths) + 1  # the prompt and its first token
    trained = source.config.max_position_embeddings
    if args.max_model_len is None and max(lengths) <= trained:
        args = args.replace(max_model_len=max(need, trained))
    args = resolve(args, source.config)
    if need > args.max_model_len:
        raise ValueError(f"--input-len {max(lengths)} does not fit --max-model-len "
                         f"{args.max_model_len}; pass --max-model-len {need} or more")
    dtype = resolve_dtype(args.dtype)
    threads = args.num_threads
    torch.set_num_threads(threads)
    peak = matmul_peak_flops(dtype)
    print(f"matmul peak ({args.dtype}, {threads} threads): {peak / 1e12:.2f} TFLOP/s")
    rng = random.Random(args.seed)
    prompts = {n: [rng.randrange(100, source.config.vocab_size) for _ in range(n)]
               for n in lengths}
    hf = None if ns.no_hf else load_hf_model(source, dtype)
    rows = []
    with Engine(**vars(args)) as engine:
        for n in lengths:
            rows.append(bench_length(engine, hf, source.config, prompts[n], ns.reps, peak))
            print_row(rows[-1])
    if not ns.no_split:
        from pipefill.bench.time_split import prefill_time_split
        for row in rows:
            row["split"] = prefill_time_split(args, source, prompts[row["len"]])
            print_split(row)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": vars(args), "threads": threads, "matmul_peak_flops": peak,
                       "torch": torch.__version__, "rows": rows}, f, indent=2)
        print(f"wrote {ns.json}")
    return 0


def bench_length(engine, hf, cfg, prompt: list[int], reps: int, peak: float) -> dict:
    flops = prefill_flops(cfg, len(prompt))
    ours, theirs, chunks = [], [], None
    for _ in range(reps):
        out = engine.generate([prompt], max_new_tokens=1)[0]
        ours.append(out.metrics["ttft_s"])
        chunks = out.metrics["chunk_sizes"]
        if hf is not None:
            theirs.append(hf_prefill_seconds(hf, prompt))
    row = {"len": len(prompt), "flops": flops, "chunk_sizes": chunks,
           "pipefill": summary(ours, flops, peak, len(prompt))}
    if theirs:
        row["hf"] = summary(theirs, flops, peak, len(prompt))
        row["ratio_ttft_pipefill_over_hf"] = row["pipefill"]["ttft_s"] / row["hf"]["ttft_s"]
    return row


def summary(times: list[float], flops: dict, peak: float, n: int) -> dict:
    med = statistics.median(times)
    return {"ttft_s": med, "times_s": times, "tok_per_s": n / med,
            "tflops": flops["total"] / med / 1e12, "of_peak": flops["total"] / med / peak}


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
    state = {name: source.load(name) for name in model.state_dict()
             if source.has(name)}
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
    line = (f"len {row['len']:>6}  pipefill TTFT {p['ttft_s']:7.3f} s  {p['tok_per_s']:7.0f} tok/s"
            f"  {p['tflops']:.3f} TF/s ({100 * p['of_peak']:.0f}% of peak)")
    if "hf" in row:
        h = row["hf"]
        line += (f"  |  HF TTFT {h['ttft_s']:7.3f} s  {h['tflops']:.3f} TF/s"
                 f"  |  pipefill/HF {row['ratio_ttft_pipefill_over_hf']:.2f}")
    print(line, flush=True)


def print_split(row: dict) -> None:
    s = row["split"]
    w = s["wall_s"]
    print(f"len {row['len']:>6}  time split: linear {s['linear_s']:.2f} s "
          f"({100 * s['linear_s'] / w:.0f}%), attention {s['attention_s']:.2f} s "
          f"({100 * s['attention_s'] / w:.0f}%), other {s['other_s']:.2f} s "
          f"({100 * s['other_s'] / w:.0f}%) of {w:.2f} s", flush=True)
