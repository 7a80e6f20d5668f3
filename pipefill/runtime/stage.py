"""Building one pipeline stage: its layer slice, weights, KV pool, and a warm-up forward."""
from __future__ import annotations

import logging

import torch

from pipefill.chunking.startup import first_chunk_size
from pipefill.config import ServerArgs, StageInfo
from pipefill.kernels.prefill_gemm import choose_prefill_gemm, experts_in_onednn_layout
from pipefill.kv.cache import (KVCache, WindowedKVCache, WindowedPackedCache, frees_window_pages,
                               stacked_kv_shape)
from pipefill.kv.tiers import build_stage_kv
from pipefill.model.attention import (QuantVectorAttention, backend_attention, choose_backend,
                                       resolve_kv_dtype, uses_packed_cache)
from pipefill.model.layers import FusedOps, elementwise_ops
from pipefill.model.mla import LatentAttention, choose_latent_attention
from pipefill.model.loader import (WeightSource, hidden_decode_paths, load_stage_weights,
                                   pack_stage_weights, quant_linears, reorder_prefill_weights,
                                   resolve_weight_dtype, stage_keeps_blocks)
from pipefill.model.stage_model import StageModel
from pipefill.model.tensor_parallel import (ShardedSource, TPOps, choose_head_split,
                                            resolve_moe_split, straddled_head, tp_shard)
from pipefill.runtime.executor import StageExecutor
from pipefill.base.platform import (cpu_vendor, dtype_name, release_freed_memory, resolve_dtype,
                                    usable_cpu_flags)

log = logging.getLogger(__name__)


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def spans(r: range) -> str:
    return f"{r.start}-{r.stop - 1}"


def build_stage(args: ServerArgs, source: WeightSource, info: StageInfo,
                device: torch.device = torch.device("cpu"), comm=None,
                kv_empty=torch.empty) -> StageExecutor:
    """The stage's executor. With tensor parallelism (info.tp_size > 1) this process is one
    rank of the stage: it loads its slices only (model.tensor_parallel), its KV pool holds its
    own KV heads, and `comm` sums and gathers over the stage's ranks (runtime/tp.TPLink).
    kv_empty allocates the KV tensors (kv/shared.SharedEmpty for a TP rank of a PD stage)."""
    model_cfg, tp = source.config, None
    if info.tp_size > 1:
        split, why = resolve_moe_split(args.tp_moe_split, source.config, info.tp_size)
        shard = tp_shard(source.config, info.tp_rank, info.tp_size, split)
        straddled = straddled_head(source.config, shard) if args.tp_decode_key_split else None
        tp = TPOps(comm, shard, source.config.vocab_size, straddled)
        source = ShardedSource(source, shard)
        log.info("stage %d TP rank %d/%d: query heads %s, KV heads %s%s, MLP columns %s, "
                 "vocabulary rows %s; heads split by %s (%s)", info.rank, info.tp_rank,
                 info.tp_size, spans(shard.q_heads),
                 "(the latent, whole on every rank)" if model_cfg.mla is not None
                 else spans(shard.kv_heads),
                 f" (query heads per KV head {list(shard.q_per_kv)})" if shard.q_per_kv else "",
                 spans(shard.mlp), spans(shard.vocab), shard.head_split,
                 choose_head_split(model_cfg, info.tp_size)[1])
        if model_cfg.moe is not None:
            log.info("stage %d TP rank %d/%d: experts split by %s (%s): experts %s, their "
                     "columns %s", info.rank, info.tp_rank, info.tp_size, split, why,
                     spans(shard.experts), spans(shard.expert_cols))
    cfg = source.config
    flags = usable_cpu_flags(args.hide_cpu_flags)
    dtype = resolve_dtype(args.dtype, flags)
    kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, dtype)
    num_pages = args.cache.capacity_tokens // args.page_size
    kv_specs = source.family.kv_specs(cfg, info.layers, kv_dtype)
    kv_bytes = num_pages * args.page_size * sum(s.bytes_per_token for s in kv_specs)
    avail = available_memory_bytes() if device.type == "cpu" else None
    if avail is not None and kv_bytes > avail:
        raise ValueError(f"stage {info.rank}: the KV pool needs {kv_bytes / 2**30:.1f} GiB for "
                         f"{num_pages * args.page_size} tokens but only {avail / 2**30:.1f} GiB "
                         "of memory is available; lower --max-total-tokens")
    weight_dtype = resolve_weight_dtype(args.weight_dtype, dtype)
    disable = hidden_decode_paths(args.hide_cpu_flags)
    blocks, blocks_why, _ = stage_keeps_blocks(args.weight_dtype, source, info.layers,
                                               info.is_first, info.is_last, device.type,
                                               args.dtype, dtype, info.tp_size, disable)
    weights = load_stage_weights(source, info.layers, info.is_first, info.is_last, dtype,
                                 progress_desc=f"stage {info.rank}: loading layers "
                                               f"{info.layers.start}-{info.layers.stop - 1}",
                                 weight_dtype=weight_dtype, blocks=blocks,
                                 max_rows=args.decode_gemm_max_rows, disable=disable,
                                 int8_prefill_max_rows=args.gguf_int8_prefill_max_rows)
    if source.gguf is not None or source.fp8:
        log_quantized_weights(info.rank, weights, args.weight_dtype, blocks, blocks_why,
                              "GGUF" if source.gguf is not None else "FP8", dtype)
    if device.type != "cpu":
        weights = weights_to(weights, device)
    backend, why = choose_backend(args.attention_backend, dtype, cfg.head_dim, args.page_size,
                                  device, kv_dtype, flags, cfg.has_windows,
                                  latent=cfg.mla is not None,
                                  unequal_groups=bool(cfg.q_per_kv))
    release_freed_memory()  # loading's freed heap: else the pool lies over touched pages
    cache = build_cache(args, cfg, kv_specs, num_pages, uses_packed_cache(backend, kv_dtype),
                        device, kv_empty, info.rank)
    attention = backend_attention(backend, flags, kv_dtype, args.page_size, cfg.q_per_kv)
    if cfg.mla is not None:  # (ARCHITECTURE.md, 'The latent KV cache (MLA)')
        attention = choose_latent_attention(args.kernels, kv_dtype, device, flags)
    # Chosen by the model's widths, not the rank's: every rank of a stage takes the same
    # kernels (and the same decode path), so their residual streams stay equal to the bit.
    ops = elementwise_ops(model_cfg, device, dtype, flags)
    packed_bytes = pack_stage_weights(weights, source.family, dtype, weight_dtype,
                                      args.decode_gemm_max_rows, disable=disable)
    head = weights.lm_head_packed or next(iter((weights.layers[0].packed or {}).values()),
                                          None)
    log.info("stage %d: decode GEMM %s", info.rank,
             f"{head.isa}, packed copies {packed_bytes / 2**20:.0f} MiB "
             f"({dtype_name(weight_dtype)})" if packed_bytes and head
             else "on the quantized weights" if blocks else "off (torch)")
    gemm, gemm_why = choose_prefill_gemm(args.prefill_gemm, dtype, weight_dtype, device,
                                         cpu_vendor())
    reordered = ""
    experts, experts_why = experts_in_onednn_layout(args.prefill_gemm, dtype, weight_dtype,
                                                    device)
    if gemm == "onednn" or (experts and model_cfg.moe is not None):
        # C0 is the layout's row hint ('auto' has not picked one yet: its fallback).
        nbytes = reorder_prefill_weights(weights, source.family, first_chunk_size(args),
                                         experts_only=gemm != "onednn")
        reordered = (f", matrices in its layout {nbytes / 2**20:.0f} MiB" if gemm == "onednn"
                     else f"; experts on oneDNN ({experts_why}), {nbytes / 2**20:.0f} MiB")
    log.info("stage %d: prefill GEMM %s (%s)%s", info.rank, gemm, gemm_why, reordered)
    model = StageModel(cfg, info.layers.start, weights, dtype, attention, ops, tp)
    kv = build_stage_kv(args, cache, source.path, info.rank, info.layers,
                        max(args.layout.layer_counts))
    executor = StageExecutor(model, kv)
    warm_up(executor)
    log.info("stage %d/%d ready: layers %d-%d, %s, attention %s (%s), %s KV cache (%d bytes a "
             "token here), %s elementwise ops, %d KV pages of %d tokens, %d threads", info.rank,
             info.size, info.layers.start, info.layers.stop - 1, args.dtype,
             backend + _decode_note(backend, attention), why,
             dtype_name(kv_dtype), sum(s.bytes_per_token for s in kv_specs),
             "fused" if isinstance(ops, FusedOps) else "torch", num_pages, args.page_size,
             torch.get_num_threads())
    return executor


def build_cache(args: ServerArgs, cfg, kv_specs, num_pages: int, packed: bool, device,
                kv_empty, rank: int):
    """The stage's KV cache: the kernels' packed layout (bf16 or float32) where `packed`, else
    token-major; window layers in pages of their own where frees_window_pages says so
    (ARCHITECTURE.md, 'Window pages')."""
    shape = stacked_kv_shape(kv_specs)
    if frees_window_pages(args, cfg.has_windows):
        windowed = [s.window is not None for s in kv_specs]
        log.info("stage %d: %d sliding-window layers keep pages of their own, freed once older "
                 "than the %d-token window", rank, sum(windowed), cfg.sliding_window)
        if packed:
            return WindowedPackedCache(windowed, num_pages, args.page_size, *shape,
                                       empty=kv_empty)
        return WindowedKVCache(windowed, num_pages, args.page_size, *shape, device,
                               empty=kv_empty)
    if packed:
        from pipefill.kernels.amx_attention import AmxKVCache
        return AmxKVCache(len(kv_specs), num_pages, args.page_size, *shape, empty=kv_empty)
    return KVCache(len(kv_specs), num_pages, args.page_size, *shape, device, empty=kv_empty)


def _decode_note(backend: str, attention) -> str:
    """Where decode rows attend when another kernel than the backend's takes them."""
    if isinstance(attention, QuantVectorAttention):  # (ARCHITECTURE.md, 'The KV room')
        return " (widening the quantized cache's codes in the kernel)"
    if isinstance(attention, LatentAttention):
        return f" ({attention.describe()})"
    if not hasattr(attention, "isa") or backend not in ("amx", "sdpa"):
        return ""
    if backend == "sdpa":  # an int8 cache (ARCHITECTURE.md, 'The KV room')
        return f" (int8 decode rows on the {attention.isa} kernel reading the codes)"
    return f" (decode on {attention.isa})"


def log_quantized_weights(rank: int, weights, name: str, blocks: bool, why: str,
                          kind: str, dtype: torch.dtype) -> None:
    """What a GGUF file's or an FP8 checkpoint's weights became: kept quantized (their types,
    bytes, the decode and prefill paths (in the compute dtype) and what stayed dequantized) or
    dequantized, with the reason."""
    if not blocks:
        log.info("stage %d: %s weights dequantized at load (--weight-dtype: %s)", rank, kind,
                 why)
        return
    quant = quant_linears(weights)
    types = sorted({q.types for q in quant})
    isa = quant[0].decode_path if quant else "none"
    kept = weights.kept_dequantized or []
    log.info("stage %d: %s kept quantized (--weight-dtype %s, %s): %d linear layers (%s), "
             "%.0f MiB, decode on %s; prefill %s; left "
             "dequantized: %s", rank, "GGUF blocks" if kind == "GGUF" else "FP8 weights", name,
             why, len(quant), ", ".join(types),
             sum(q.nbytes for q in quant) / 2**20, isa,
             quant[0].prefill_rule(dtype) if quant else "dequantizes each matrix per call",
             (", ".join(kept[:8]) + (f" and {len(kept) - 8} more" if len(kept) > 8 else ""))
             or "none")


def weights_to(weights, device):
    import dataclasses
    # Tensors move; anything else (a layer's index, None) stays.
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    layers = [type(w)(**{f.name: move(getattr(w, f.name)) for f in dataclasses.fields(w)})
              for w in weights.layers]
    return type(weights)(layers, move(weights.embed), move(weights.final_norm),
                         move(weights.lm_head))


def warm_up(executor: StageExecutor) -> None:
    """One small forward so that kernel set-up is not charged to the first request."""
    executor.scratch_prefill(min(16, executor.cache.page_size))
