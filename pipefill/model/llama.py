"""A Llama-family decoder over a contiguous slice of layers: one pipeline stage.

Stage 0 has the embedding, the last stage the final norm and lm_head; missing parts are None.
Activations between layers (and between stages) are `hidden` in the compute dtype and `residual`
in float32, so the residual stream keeps full precision across layers and stage borders.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipefill.model.attention import SeqMeta, paged_attention
from pipefill.model.config import ModelConfig
from pipefill.model.rope import apply_rope_, cos_sin, inverse_frequencies


@dataclass
class ForwardMeta:
    """Per-forward metadata, built per stage from the micro-batch's plan."""
    positions: torch.Tensor  # [num_tokens] long
    seqs: list[SeqMeta]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden] float32
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden] float32
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    q_norm: torch.Tensor | None  # [head_dim] float32 (Qwen3)
    k_norm: torch.Tensor | None


@dataclass
class StageWeights:
    layers: list[LayerWeights]
    embed: torch.Tensor | None  # [vocab, hidden], first stage only
    final_norm: torch.Tensor | None  # last stage only
    lm_head: torch.Tensor | None  # [vocab, hidden], last stage only


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype):
    """Normalises in float32 (as HF does) and returns the compute dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(dtype)


class StageModel:
    def __init__(self, cfg: ModelConfig, layer_start: int, weights: StageWeights,
                 dtype: torch.dtype, attention=paged_attention):
        self.cfg = cfg
        self.attention = attention  # (q, k, v, k_cache, v_cache, seqs, scale) -> out
        self.layer_start = layer_start
        self.w = weights
        self.dtype = dtype
        self.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.scale = cfg.head_dim ** -0.5

    @property
    def num_layers(self) -> int:
        return len(self.w.layers)

    @property
    def is_first(self) -> bool:
        return self.w.embed is not None

    @property
    def is_last(self) -> bool:
        return self.w.lm_head is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.w.embed)

    @torch.inference_mode()
    def forward(self, hidden, residual, meta: ForwardMeta, k_cache, v_cache):
        """Runs this stage's layers. k_cache/v_cache: [num_local_layers, slots, Hkv, D]."""
        cos, sin = cos_sin(meta.positions, self.inv_freq, self.dtype)
        for i, layer in enumerate(self.w.layers):
            hidden, residual = self._layer(layer, hidden, residual, meta, cos, sin,
                                           k_cache[i], v_cache[i])
        return hidden, residual

    def _layer(self, w: LayerWeights, hidden, residual, meta, cos, sin, k_cache, v_cache):
        cfg = self.cfg
        residual = hidden.float() if residual is None else residual.add_(hidden)
        x = rms_norm(residual, w.input_norm, cfg.rms_norm_eps, self.dtype)
        qkv = F.linear(x, w.qkv, w.qkv_bias)
        num_tokens = qkv.shape[0]
        q = qkv[:, :cfg.q_size].view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].view(num_tokens, cfg.num_kv_heads, -1)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, cfg.rms_norm_eps, self.dtype)
            k = rms_norm(k, w.k_norm, cfg.rms_norm_eps, self.dtype)
            apply_rope_(q, cos, sin)
            apply_rope_(k, cos, sin)
        else:
            # q and k are adjacent columns of qkv: rotate both heads in one pass.
            qk = qkv[:, :cfg.q_size + cfg.kv_size].view(num_tokens, -1, cfg.head_dim)
            apply_rope_(qk, cos, sin)
        attn = self.attention(q, k, v, k_cache, v_cache, meta.seqs, self.scale)
        hidden = F.linear(attn.reshape(num_tokens, cfg.q_size), w.o_proj)
        residual.add_(hidden)
        x = rms_norm(residual, w.post_norm, cfg.rms_norm_eps, self.dtype)
        gate_up = F.linear(x, w.gate_up)
        inter = gate_up.shape[-1] // 2
        act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
        return F.linear(act, w.down), residual

    @torch.inference_mode()
    def logits(self, hidden, residual, rows: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head on the selected rows only -> float32 [len(rows), vocab]."""
        final = residual[rows].add_(hidden[rows])
        x = rms_norm(final, self.w.final_norm, self.cfg.rms_norm_eps, self.dtype)
        return F.linear(x, self.w.lm_head).float()
