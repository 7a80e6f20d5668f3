"""Peak resident memory of the stage processes beside what the model needs.

"Needed" is computed from the model config and the flags, per stage: the weight matrices in
the compute dtype (norms in float32), the decode GEMM's packed copies when that path runs on
this CPU — or, where the stage keeps a GGUF file's blocks (--weight-dtype gguf, or auto where
its rule keeps them: model/auto_weights.py), the matrices as blocks and no packed copies, since
the quantized linear layers are their own decode copies; where a stage keeps an FP8
checkpoint's codes (fp8, or auto), those matrices at a byte a weight plus their block scales,
without packed copies of them — and the KV of the prompt's pages at
the KV dtype; "pool" is the same with the whole allocated KV pool instead of the prompt's
pages (the pool is allocated lazily: pages become resident only when written, so the prompt's
KV is the bar and the pool is an upper bound).

Peak RSS is each stage process's VmHWM (/proc/<pid>/status). Before a measurement the peak is
reset to the current RSS (`5` into /proc/<pid>/clear_refs), so a length's peak covers that
length only (plus whatever was already resident: weights, and KV pages earlier prompts
touched). The sum of the stages' peaks bounds the peak of their sum from above. The bench also
gives each stage's peak while it started (loading and converting the weights), and the bench
process's own peak (the front end, plus the HF baseline when that runs).
"""
from __future__ import annotations

import torch

from pipefill.base.platform import resolve_dtype, usable_cpu_flags
from pipefill.config import Kernels, Layout, ServerArgs
from pipefill.kernels import decode_gemm
from pipefill.kernels.gguf_blocks import BLOCK_TYPES, row_bytes, supports
from pipefill.kv.cache import frees_window_pages
from pipefill.kv.window import held_window_pages
from pipefill.model.attention import resolve_kv_dtype
from pipefill.model.auto_weights import AutoFacts
from pipefill.model.config import ModelConfig
from pipefill.model.families import family_of
from pipefill.model.loader import (fp8_kept_matrices, hidden_decode_paths, resolve_weight_dtype,
                                   stage_keeps_blocks, tensor_names)


def proc_status_bytes(pid: int, field: str) -> int:
    """A memory field of /proc/<pid>/status ("VmHWM", "VmRSS") in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/{pid}/status has no {field} line")


def reset_peak_rss(pid: int) -> bool:
    """Sets the process's VmHWM to its current RSS; False where the kernel refuses."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def stage_weight_bytes(cfg: ModelConfig, num_layers: int, first: bool, last: bool,
                       dtype: torch.dtype) -> int:
    """Bytes of one stage's weights as the loader keeps them: matrices (and biases) in the
    compute dtype, norms in float32, a tied LM head shared with the embedding on one stage."""
    matrices = layer_matrix_params(cfg, num_layers)
    biases = (cfg.q_size + 2 * cfg.kv_size) if cfg.attention_bias else 0
    norms = 2 * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_norm else 0)
    total = matrices * dtype.itemsize + num_layers * (biases * dtype.itemsize + norms * 4)
    embed = cfg.vocab_size * cfg.hidden_size * dtype.itemsize
    if first:
        total += embed
    if last:
        total += cfg.hidden_size * 4 + (0 if first and cfg.tie_word_embeddings else embed)
    return total


def stage_packed_bytes(cfg: ModelConfig, num_layers: int, last: bool,
                       weight_dtype: torch.dtype) -> int:
    """Bytes of the decode GEMM's packed copies (every linear layer, and the LM head)."""
    head = cfg.vocab_size * cfg.hidden_size if last else 0
    return (layer_matrix_params(cfg, num_layers) + head) * weight_dtype.itemsize


def layer_matrix_params(cfg: ModelConfig, num_layers: int) -> int:
    """Matrix elements of num_layers layers: attention, and the dense MLP or (a sparse layer of
    a mixture-of-experts model) the router, every expert and the shared expert. The sparse
    share is the model's own, so a stage of any layers gets the model's average."""
    h = cfg.hidden_size
    attention = ((cfg.q_size + 2 * cfg.kv_size) * h + h * cfg.q_size if cfg.mla is None
                 else cfg.mla.projection_weights(h, cfg.num_heads))
    dense = 3 * cfg.intermediate_size * h
    if cfg.moe is None:
        return num_layers * (attention + dense)
    moe = cfg.moe
    sparse = h * (moe.num_experts + bool(moe.shared_width) + 3 * moe.num_experts * moe.expert_width
                  + 3 * moe.shared_width)
    share = sum(moe.sparse_layers) / len(moe.sparse_layers)
    return round(num_layers * (attention + share * sparse + (1 - share) * dense))


def packs_decode_weights(layout: Layout, kernels: Kernels) -> bool:
    """Whether the stages keep packed decode copies (the same choice build_stage makes)."""
    if kernels.decode_gemm_max_rows <= 0 or layout.device != "cpu":
        return False
    dtype = resolve_dtype(layout.dtype, usable_cpu_flags(kernels.hide_cpu_flags))
    weight_dtype = resolve_weight_dtype(kernels.weight_dtype, dtype)
    disable = decode_gemm.hidden_isas(kernels.hide_cpu_flags)
    return decode_gemm.choose_isa(dtype, weight_dtype, disable)[0] is not None


def blocks_change(source, facts: AutoFacts, first: bool, last: bool,
                  dtype: torch.dtype) -> int:
    """Bytes a stage that keeps blocks holds more than stage_weight_bytes counts (negative:
    fewer): its matrices in blocks instead of the compute dtype (the facts count a tied head,
    which is the embedding on a stage that holds both: one copy of the blocks), and the
    embedding in blocks too where the kernels read its type (loader._embedding)."""
    cfg = source.config
    change = facts.block_bytes - facts.dense_bytes
    if first and not (last and cfg.tie_word_embeddings):
        gname, _ = source.family.gguf_tensor(source.family.embed_name)
        qtype = source.gguf.tensor_type(gname)
        if qtype in BLOCK_TYPES and supports(qtype, cfg.hidden_size):
            change += cfg.vocab_size * (row_bytes(qtype, cfg.hidden_size)
                                        - cfg.hidden_size * dtype.itemsize)
    return change


def stage_needs(args: ServerArgs, cfg: ModelConfig, prompt_tokens: int,
                pool_tokens: int, source=None) -> list[dict]:
    """Per stage of resolved args: weights, packed copies, KV of the prompt and of the
    allocated pool, bytes. `source`: the model's WeightSource, for a GGUF file's blocks or an
    FP8 checkpoint's codes where the stage keeps them (without it, every matrix counts
    dequantized)."""
    layout, kernels, page_size = args.layout, args.kernels, args.cache.page_size
    dtype = resolve_dtype(layout.dtype, usable_cpu_flags(kernels.hide_cpu_flags))
    kv_dtype = resolve_kv_dtype(args.cache.kv_cache_dtype, dtype)
    weight_dtype = resolve_weight_dtype(kernels.weight_dtype, dtype)
    packed = packs_decode_weights(layout, kernels)
    frees = frees_window_pages(args, cfg.has_windows)
    rows = []
    for rank, layers in enumerate(layout.ranges):
        first, last = rank == 0, rank == layout.pp_size - 1
        specs = family_of(cfg).kv_specs(cfg, layers, kv_dtype)
        row = {"rank": rank,
               "weights": stage_weight_bytes(cfg, len(layers), first, last, dtype),
               "packed": stage_packed_bytes(cfg, len(layers), last, weight_dtype)
               if packed else 0,
               "kv_prompt": prompt_kv_bytes(specs, prompt_tokens, page_size, frees),
               "kv_pool": pool_tokens * sum(s.bytes_per_token for s in specs)}
        if source is not None and (source.gguf is not None or source.fp8):
            keeps, row["blocks_why"], facts = stage_keeps_blocks(
                kernels.weight_dtype, source, layers, first, last, layout.device, layout.dtype,
                dtype, layout.tp_size, hidden_decode_paths(kernels.hide_cpu_flags))
            row["blocks"] = keeps
            if keeps and source.gguf is not None:
                row["weights"] += blocks_change(source, facts, first, last, dtype)
                row["packed"] = 0
            elif keeps:  # FP8 codes: their own decode copies too
                kept, nbytes = fp8_kept_matrices(source, tensor_names(cfg, layers, first, last))
                row["weights"] += nbytes - kept * dtype.itemsize
                row["packed"] = max(0, row["packed"] - kept * weight_dtype.itemsize)
        rows.append(row)
    return rows


def prompt_kv_bytes(specs, prompt_tokens: int, page_size: int,
                    frees_windows: bool = False) -> int:
    """KV bytes of a prompt's pages over layers of these specs: every token's in a global
    layer; in a sliding-window layer whose pages are freed outside the window (frees_windows),
    the most its ring and the prompt's last window hold (ARCHITECTURE.md, 'Window pages')."""
    pages = -(-prompt_tokens // page_size)
    total = 0
    for spec in specs:
        held = pages
        if spec.window is not None and frees_windows:
            held = held_window_pages(prompt_tokens, page_size, spec.window)
        total += held * page_size * spec.bytes_per_token
    return total


def held_kv_bytes(args: ServerArgs, cfg: ModelConfig, pages: int, window_pages: int) -> int:
    """KV bytes behind `pages` pages of the global layers and `window_pages` pages of the
    sliding-window layers (which keep pages of their own: ARCHITECTURE.md, 'Window pages')."""
    dtype = resolve_dtype(args.layout.dtype, usable_cpu_flags(args.kernels.hide_cpu_flags))
    kv_dtype = resolve_kv_dtype(args.cache.kv_cache_dtype, dtype)
    specs = family_of(cfg).kv_specs(cfg, range(cfg.num_layers), kv_dtype)
    per_page = {w: args.cache.page_size * sum(s.bytes_per_token for s in specs
                                              if (s.window is not None) == w)
                for w in (False, True)}
    return pages * per_page[False] + window_pages * per_page[True]


def memory_report(needs: list[dict], stage_peaks: list[int], engine_peak: int) -> dict:
    """Peaks beside needs: per stage, the sum over stages, and the two ratios."""
    stages = []
    for need, peak in zip(needs, stage_peaks):
        weights = need["weights"] + need["packed"]
        stages.append({**need, "peak_rss": peak,
                       "ratio_prompt": peak / (weights + need["kv_prompt"]),
                       "ratio_pool": peak / (weights + need["kv_pool"])})
    total = {k: sum(s[k] for s in stages)
             for k in ("weights", "packed", "kv_prompt", "kv_pool", "peak_rss")}
    weights = total["weights"] + total["packed"]
    return {"stages": stages, **{f"total_{k}": v for k, v in total.items()},
            "engine_peak_rss": engine_peak,
            "ratio_prompt": total["peak_rss"] / (weights + total["kv_prompt"]),
            "ratio_pool": total["peak_rss"] / (weights + total["kv_pool"])}


def add_baselines(report: dict, marks: list[dict]) -> None:
    """Adds each stage's baseline (its RSS before any weight: the interpreter, torch,
    pipefill), its RSS once loaded and its weight tensors' bytes (the stage's own
    stats["memory"], runtime/worker.stage_memory_marks) to a memory_report, with the peak above
    the baseline and its ratio to weights + prompt KV: what the model costs beside what it
    needs, without the process's fixed part. Stages that gave no marks leave the report as it
    is (all or none: a sum over some stages would mislead)."""
    if not marks or not all(m.get("baseline", {}).get("rss") for m in marks):
        return
    for stage, m in zip(report["stages"], marks):
        stage["baseline_rss"] = m["baseline"]["rss"]
        stage["loaded_rss"] = m["loaded"]["rss"]
        stage["weight_tensors"] = sum(m["weights"].values())
        stage["above_baseline"] = stage["peak_rss"] - stage["baseline_rss"]
        stage["ratio_above_baseline"] = stage["above_baseline"] / (
            stage["weights"] + stage["packed"] + stage["kv_prompt"])
    stages = report["stages"][:len(marks)]
    for key in ("baseline_rss", "loaded_rss", "weight_tensors", "above_baseline"):
        report[f"total_{key}"] = sum(s[key] for s in stages)
    need = sum(s["weights"] + s["packed"] + s["kv_prompt"] for s in stages)
    report["ratio_above_baseline"] = report["total_above_baseline"] / need


def format_report(mem: dict) -> str:
    mib = lambda b: b / 2**20  # noqa: E731
    w = mem["total_weights"] + mem["total_packed"]
    per_stage = ", ".join(f"stage {s['rank']} {mib(s['peak_rss']):.0f} MiB "
                          f"(x{s['ratio_prompt']:.2f})" for s in mem["stages"])
    return (f"peak RSS of the stages {mib(mem['total_peak_rss']):.0f} MiB [{per_stage}]; "
            f"weights {mib(mem['total_weights']):.0f}"
            f"{' (GGUF blocks kept)' if any(s.get('blocks') for s in mem['stages']) else ''}"
            f" + packed {mib(mem['total_packed']):.0f} MiB; KV of the prompt "
            f"{mib(mem['total_kv_prompt']):.0f} MiB -> "
            f"x{mem['ratio_prompt']:.2f} of weights + prompt KV "
            f"({mib(w + mem['total_kv_prompt']):.0f} MiB); allocated pool "
            f"{mib(mem['total_kv_pool']):.0f} MiB -> x{mem['ratio_pool']:.2f}; "
            + (f"stages' RSS before {mib(mem['total_rss_before']):.0f} MiB, peak while "
               f"loading {mib(mem['total_load_peak_rss']):.0f} MiB; "
               if "total_load_peak_rss" in mem else "")
            + (f"stages' baseline (before any weight) {mib(mem['total_baseline_rss']):.0f} MiB, "
               f"loaded {mib(mem['total_loaded_rss']):.0f} MiB (weight tensors "
               f"{mib(mem['total_weight_tensors']):.0f} MiB); peak above the baseline "
               f"{mib(mem['total_above_baseline']):.0f} MiB -> x{mem['ratio_above_baseline']:.2f} "
               "of weights + prompt KV; " if "total_baseline_rss" in mem else "")
            + f"bench process peak {mib(mem['engine_peak_rss']):.0f} MiB"
            + (f"; most pages in use: {p['pages_peak']} of the global layers, "
               f"{p['window_pages_peak']} of the window layers: KV held at most "
               f"{mib(p['kv_held']):.1f} MiB (global layers + one window per local layer "
               f"{mib(p['kv_one_window']):.1f} MiB, + a window and a piece (the ring) "
               f"{mib(p['kv_ring']):.1f} MiB, every layer every token "
               f"{mib(p['kv_every_token']):.1f} MiB)" if (p := mem.get("pages")) else ""))
