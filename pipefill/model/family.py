"""A model family: what one architecture brings to a stage (ARCHITECTURE.md, 'Model families').

Everything else (the stage's embedding and head, loading, packing, the KV pool, the pipeline)
is the same for every family. A family brings three things:

* the weights layout: which checkpoint tensors (Hugging Face names; GGUF names through
  `gguf_name`) a stage's layers read, and how they become the family's layer weights;
* a layer's forward: attention and MLP for prefill chunks and decode steps, over the paged
  KV cache;
* the KV spec of each layer (heads, head size, dtype, window), from which the cache is sized.

The registry (pipefill.model.families) finds the family of a config.json or a GGUF file.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from pipefill.kernels.kv_quant import stored_dim
from pipefill.model.config import ModelConfig


@dataclass(frozen=True)
class KVSpec:
    """What one layer keeps in the KV cache for each token: K and V of num_kv_heads heads of
    head_dim values each, or, for a latent layer, one vector of latent_dim values (multi-head
    latent attention) laid over the two tensors: its first head_dim values in K's one head,
    the rest in V's (ARCHITECTURE.md, 'The latent KV cache (MLA)'). Pages, tiers and PD
    transfers copy K and V alike, so they carry a latent unchanged and count it once."""
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    window: int | None = None  # a sliding window of this many tokens; None: the whole prefix
    latent_dim: int = 0  # > 0: a latent layer (then one head of ceil(latent_dim / 2))

    @classmethod
    def latent(cls, latent_dim: int, dtype: torch.dtype) -> "KVSpec":
        """A latent layer's spec: one head of half the latent in K and in V (an odd latent
        leaves V's last value unused)."""
        return cls(1, (latent_dim + 1) // 2, dtype, latent_dim=latent_dim)

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes a token keeps, the scales of a quantized cache included."""
        return 2 * self.num_kv_heads * stored_dim(self.head_dim, self.dtype) * self.dtype.itemsize


class WeightReader(Protocol):
    """What a family's load_layer reads tensors through (by Hugging Face name)."""

    def mat(self, *names: str) -> torch.Tensor:
        """The rows of the named matrices stacked into one, in the stage's compute dtype."""

    def linear(self, *names: str, order=None):
        """A linear layer's matrix, as mat, or under --weight-dtype gguf its GGUF blocks (under
        fp8, or auto, an FP8 checkpoint's codes and scales) kept quantized
        (kernels.quant_gemm.QuantLinear) where the file's types allow; the loader moves those
        to the layer's decode and prefill copies (loader.place_quant_linears). order: a
        function of the stacked rows' count that gives their order (matrix[order(rows)]),
        applied before a quantized layer's decode layout is written."""

    def vec(self, name: str) -> torch.Tensor:
        """A vector (a norm's weight) as float32."""


class ModelFamily(ABC):
    """One family of architectures; an instance per family is listed in the registry."""
    name: str  # the family's name in messages
    hf_model_types: tuple[str, ...]  # config.json model_type values it runs
    hf_architectures: tuple[str, ...] = ()  # config.json architectures, when model_type is absent
    gguf_architectures: dict[str, str] = {}  # GGUF general.architecture -> model_type
    # Whether its GGUF files carry experts ({arch}.expert_count): llama.cpp writes Mixtral as
    # a llama file with experts, so two families list "llama" and this tells them apart.
    gguf_experts = False
    # Said after "the checkpoint has no tensor X" (a family whose layout has variants).
    layout_hint = ""
    # The layer weights' linear layers (field name -> its bias field or None): the fields that
    # get decode copies (kernels.decode_gemm) and prefill copies (kernels.prefill_gemm).
    matrices: dict[str, str | None] = {}
    # Stage-level tensors (Hugging Face names): the first stage's embedding, the last stage's
    # final norm and head (the head falls back to the embedding when the file ties them).
    embed_name = "model.embed_tokens.weight"
    final_norm_name = "model.norm.weight"
    lm_head_name = "lm_head.weight"

    @abstractmethod
    def config_from_hf(self, hf: dict) -> ModelConfig:
        """The ModelConfig of a config.json of this family."""

    @abstractmethod
    def config_from_gguf(self, gguf) -> ModelConfig:
        """The ModelConfig of a GGUF file (model.gguf_file.GGUFFile) of this family."""

    @abstractmethod
    def layer_tensor_names(self, cfg: ModelConfig, layer: int) -> list[str]:
        """Every tensor layer `layer` reads, by Hugging Face name."""

    @abstractmethod
    def gguf_name(self, hf_name: str) -> str:
        """The GGUF tensor name of a Hugging Face tensor name (layers and stage tensors)."""

    def gguf_tensor(self, hf_name: str) -> tuple[str, int | None]:
        """The GGUF tensor holding a Hugging Face tensor, and its index along that tensor's
        first dimension where llama.cpp stacked several into one (the experts of a layer);
        None: the whole tensor."""
        return self.gguf_name(hf_name), None

    def gguf_rotary_heads(self, cfg: ModelConfig, arch: str, hf_name: str) -> int | None:
        """For a GGUF matrix whose rows llama.cpp interleaved for its rotary layout: the number
        of heads to undo that over (model.gguf_file.unpermute_rotary); None for the others."""
        return None

    @abstractmethod
    def load_layer(self, cfg: ModelConfig, layer: int, read: WeightReader):
        """Layer `layer`'s weights (the family's own dataclass) read through `read`."""

    @abstractmethod
    def kv_specs(self, cfg: ModelConfig, layers: range, kv_dtype: torch.dtype) -> list[KVSpec]:
        """The KV spec of each of `layers`, in order."""

    @abstractmethod
    def layer_forward(self, model, w, hidden, residual, meta, cos, sin, k_cache, v_cache,
                      trim: bool = False):
        """One layer of `model` (a StageModel) with weights w -> (hidden, residual). k_cache,
        v_cache: this layer's cache; trim: compute only the rows meta.last_rows keeps
        (StageModel.trims) after writing every row's K/V."""

    def layer_costs(self, cfg: ModelConfig) -> list[float]:
        """The weights a token multiplies by in each layer (attention's projections and a
        gated MLP): what stages are balanced by (base/partition) and what a prefill's ETA
        weighs against attention (chunking/progress). Alike for every layer unless a family's
        layers differ."""
        h = cfg.hidden_size
        per_layer = h * (2 * cfg.q_size + 2 * cfg.kv_size) + 3 * h * cfg.intermediate_size
        return [float(per_layer)] * cfg.num_layers

    def decode_runner(self, model):
        """A lean decode path for `model` (a runner with fits(hidden, meta) and forward(...)
        as StageModel.forward's), or None: decode steps run layer_forward."""
        return None
