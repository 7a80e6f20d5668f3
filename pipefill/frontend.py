"""What every front end (the Python Engine, the HTTP server) does before it starts the stages:
resolve the arguments against the model and reject impossible settings with a sentence."""
from __future__ import annotations

import logging

import torch

from pipefill.config import ServerArgs, resolve
from pipefill.kernels.prefill_gemm import choose_prefill_gemm
from pipefill.model.attention import choose_backend, resolve_kv_dtype
from pipefill.model.loader import WeightSource, resolve_model_path, resolve_weight_dtype
from pipefill.base.platform import cpu_vendor, resolve_dtype, usable_cpu_flags

log = logging.getLogger(__name__)

CUDA_NEVER_RUN = ("--device cuda: this code path (NCCL between stages, one GPU per stage) is "
                  "written but has never run on a GPU; expect failures, and use --device cpu "
                  "for a tested server")


def prepare(args: ServerArgs) -> tuple[ServerArgs, WeightSource]:
    """Resolves model-dependent defaults and rejects impossible settings up front."""
    if args.device == "cuda":
        log.warning(CUDA_NEVER_RUN)
    if args.disaggregation_mode != "null" and args.nnodes > 1:
        raise ValueError(f"--disaggregation-mode {args.disaggregation_mode} runs on one node "
                         "(--nnodes 1) for now")
    source = WeightSource(resolve_model_path(args.model_path))
    args = resolve(args, source.config)  # also checks the layer partition against the model
    if args.attention_backend not in ("auto", "sdpa"):  # a named kernel must fit, or a sentence
        dtype = resolve_dtype(args.dtype)
        choose_backend(args.attention_backend, dtype, source.config.head_dim, args.page_size,
                       torch.device(args.device), resolve_kv_dtype(args.kv_cache_dtype, dtype),
                       usable_cpu_flags(args.hide_cpu_flags))
    if args.prefill_gemm == "onednn":  # likewise
        dtype = resolve_dtype(args.dtype, usable_cpu_flags(args.hide_cpu_flags))
        choose_prefill_gemm("onednn", dtype, resolve_weight_dtype(args.weight_dtype, dtype),
                            torch.device(args.device), cpu_vendor())
    return args, source
