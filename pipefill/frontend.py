"""What every front end (the Python Engine, the HTTP server) does before and around the stages:
resolve the arguments against the model, and check requests so that a bad one gets a sentence
before it reaches a stage."""
from __future__ import annotations

import torch

from pipefill.config import ServerArgs, resolve
from pipefill.model.attention import choose_backend
from pipefill.model.loader import WeightSource, resolve_model_path
from pipefill.model.partition import partition_layers
from pipefill.runtime.platform import resolve_dtype
from pipefill.scheduler.plan import SamplingParams


def prepare(args: ServerArgs) -> tuple[ServerArgs, WeightSource]:
    """Resolves model-dependent defaults and rejects impossible settings up front."""
    source = WeightSource(resolve_model_path(args.model_path))
    args = resolve(args, source.config)
    partition_layers(source.config.num_layers, args.pp_size, args.pp_layer_partition)
    if args.attention_backend == "amx":
        choose_backend("amx", resolve_dtype(args.dtype), source.config.head_dim,
                       args.page_size, torch.device(args.device))
    return args, source


def check_prompt(ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                 kv_capacity_tokens: int) -> None:
    """Raises ValueError with a sentence for a request the engine can never run."""
    params.validate()
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    total = len(ids) + params.max_new_tokens
    if total > max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens "
                         f"({params.max_new_tokens}) = {total} exceeds --max-model-len "
                         f"({max_model_len})")
    if total > kv_capacity_tokens:
        raise ValueError(f"prompt + max_new_tokens ({total}) exceeds the KV cache "
                         f"({kv_capacity_tokens} tokens); raise --max-total-tokens")
