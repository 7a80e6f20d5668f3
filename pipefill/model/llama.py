"""A Llama-family decoder over a contiguous slice of layers: one pipeline stage.

Stage 0 has the embedding, the last stage the final norm and lm_head; missing parts are None.
Activations between layers (and between stages) are `hidden` in the compute dtype and `residual`
in float32, so the residual stream keeps full precision across layers and stage borders.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipefill.kernels.prefill_gemm import torch_linear
from pipefill.model.attention import SeqMeta, kv_writer, last_rows_attention, paged_attention
from pipefill.model.config import ModelConfig
from pipefill.model.decode_step import DecodeRunner
from pipefill.model.rope import apply_rope_, cos_sin, inverse_frequencies


@dataclass
class ForwardMeta:
    """Per-forward metadata, built per stage from the micro-batch's plan."""
    positions: torch.Tensor  # [num_tokens] long
    seqs: list[SeqMeta]
    # Last stage: per sequence, whether its last row's output is used (logits); None = every
    # row of every sequence is. With a list, forward returns only those rows, in order: the
    # last layer then computes K/V for all rows but attention and MLP for those rows only.
    last_rows: list[bool] | None = None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden] float32
    # The four matrices are None once moved into `prefill` (loader.reorder_prefill_weights).
    qkv: torch.Tensor | None  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor | None  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden] float32
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]
    down: torch.Tensor | None  # [hidden, intermediate]
    q_norm: torch.Tensor | None  # [head_dim] float32 (Qwen3)
    k_norm: torch.Tensor | None
    # Decode copies of qkv/o_proj/gate_up/down for the small-M GEMM (kernels.decode_gemm),
    # by field name; None: torch for every M.
    packed: dict | None = None
    # oneDNN copies of the same four for larger M (kernels.prefill_gemm), by field name;
    # None: F.linear on the plain matrices.
    prefill: dict | None = None


@dataclass
class StageWeights:
    layers: list[LayerWeights]
    embed: torch.Tensor | None  # [vocab, hidden], first stage only
    final_norm: torch.Tensor | None  # last stage only
    lm_head: torch.Tensor | None  # [vocab, hidden], last stage only
    lm_head_packed: object | None = None  # kernels.decode_gemm.PackedLinear


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias=None, packed=None,
           large=None) -> torch.Tensor:
    """Decode-sized x (at most packed.max_rows rows) runs the packed small-M GEMM, which reads
    every weight once for all rows (torch's matmul slows down at M = 4..16); larger x runs
    `large` (a oneDNN-layout copy, which holds the bias too) where there is one, else
    F.linear (oneDNN for bfloat16 on CPU: rows padded as for `large`, see prefill_gemm)."""
    if packed is not None and x.shape[0] <= packed.max_rows:
        return packed(x)
    if large is not None:
        return large(x)
    return torch_linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype):
    """Normalises in float32 (as HF does) and returns the compute dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(dtype)


class TorchOps:
    """The elementwise steps of a layer in plain torch (any CPU, any device)."""

    @staticmethod
    def add_rms_norm(residual, hidden, weight, eps, dtype):
        """residual += hidden (in place; None: residual is hidden.float()); -> normed."""
        residual = hidden.float() if residual is None else residual.add_(hidden)
        return rms_norm(residual, weight, eps, dtype), residual

    @staticmethod
    def rope_(x, cos, sin):
        apply_rope_(x, cos.to(x.dtype), sin.to(x.dtype))

    @staticmethod
    def silu_mul(gate_up):
        inter = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])


class FusedOps:
    """The same steps as one pass each (pipefill.kernels.fused_ops, AVX-512)."""

    def __init__(self):
        from pipefill.kernels import fused_ops
        self.k = fused_ops

    def add_rms_norm(self, residual, hidden, weight, eps, dtype):
        if residual is None:
            residual = hidden.float()
            return self.k.add_rms_norm(residual, None, weight, eps, dtype=dtype), residual
        return self.k.add_rms_norm(residual, hidden, weight, eps), residual

    def rope_(self, x, cos, sin):
        self.k.rope_(x, cos, sin)

    def silu_mul(self, gate_up):
        return self.k.silu_mul(gate_up)


def elementwise_ops(cfg: ModelConfig, device: torch.device,
                    dtype: torch.dtype = torch.float32, flags: frozenset[str] | None = None):
    """Fused kernels where the CPU, the dtype and the shapes allow, else torch. The kernels
    take float32 and bfloat16 only: float16 (issue 11) stays on torch. `flags`: the CPU flags
    to trust (--hide-cpu-flags removed), so a hidden capability is never executed."""
    widths = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim)
    fits = dtype in (torch.float32, torch.bfloat16) and all(w % 16 == 0 for w in widths)
    if device.type == "cpu" and fits:
        from pipefill.kernels.fused_ops import fused_available
        if fused_available(flags=flags)[0]:
            return FusedOps()
    return TorchOps()


class StageModel:
    def __init__(self, cfg: ModelConfig, layer_start: int, weights: StageWeights,
                 dtype: torch.dtype, attention=paged_attention, ops=None):
        self.cfg = cfg
        self.attention = attention  # (q, k, v, k_cache, v_cache, seqs, scale) -> out
        self.kv_writer = kv_writer(attention)  # K/V into the cache without attention, or None
        self.ops = ops or TorchOps()
        self.layer_start = layer_start
        self.w = weights
        self.dtype = dtype
        self.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.scale = cfg.head_dim ** -0.5
        # Decode steps on the packed GEMM, fused ops and a vector attention kernel take the lean
        # path (model.decode_step: same kernels, same bits, no per-call overhead); tests and
        # benchmarks set fast_decode = False to run _layer instead.
        self.fast_decode = True
        self._decode = DecodeRunner(self) if DecodeRunner.supports(self) else None

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
        cos, sin = cos_sin(meta.positions, self.inv_freq)
        # A step of one-token rows where some row feeds no logit (a one-token prompt chunk)
        # trims on the general path: the lean decode path returns every row.
        trim = self.trims(meta)
        if (not trim and self.fast_decode and self._decode is not None
                and self._decode.fits(hidden, meta)):
            return self._decode.forward(hidden, residual, meta, cos, sin, k_cache, v_cache)
        last = len(self.w.layers) - 1
        for i, layer in enumerate(self.w.layers):
            hidden, residual = self._layer(layer, hidden, residual, meta, cos, sin,
                                           k_cache[i], v_cache[i], trim and i == last)
        return hidden, residual

    def trims(self, meta: ForwardMeta) -> bool:
        """Whether the last layer computes only the rows meta.last_rows asks for (the last
        stage's final layer feeds nothing but the logits; its K/V are still written for all)."""
        return meta.last_rows is not None and self.is_last and self.kv_writer is not None

    def _layer(self, w: LayerWeights, hidden, residual, meta, cos, sin, k_cache, v_cache,
               trim: bool = False):
        cfg, ops = self.cfg, self.ops
        x, residual = ops.add_rms_norm(residual, hidden, w.input_norm, cfg.rms_norm_eps,
                                       self.dtype)
        packed, large = w.packed or {}, w.prefill or {}
        qkv = linear(x, w.qkv, w.qkv_bias, packed.get("qkv"), large.get("qkv"))
        num_tokens = qkv.shape[0]
        q = qkv[:, :cfg.q_size].view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].view(num_tokens, cfg.num_kv_heads, -1)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, cfg.rms_norm_eps, self.dtype)
            k = rms_norm(k, w.k_norm, cfg.rms_norm_eps, self.dtype)
            ops.rope_(q, cos, sin)
            ops.rope_(k, cos, sin)
        else:
            # q and k are adjacent columns of qkv: rotate both heads in one pass.
            qk = qkv[:, :cfg.q_size + cfg.kv_size].view(num_tokens, -1, cfg.head_dim)
            ops.rope_(qk, cos, sin)
        if trim:
            attn, rows = last_rows_attention(self.attention, self.kv_writer, q, k, v, k_cache,
                                             v_cache, meta.seqs, meta.last_rows, self.scale)
            residual = residual[rows]
            if residual.shape[0] == 0:  # no logits this step (a chunk before a prompt's last)
                return attn.new_empty((0, cfg.hidden_size)), residual
        else:
            attn = self.attention(q, k, v, k_cache, v_cache, meta.seqs, self.scale)
        hidden = linear(attn.reshape(attn.shape[0], cfg.q_size), w.o_proj, None,
                        packed.get("o_proj"), large.get("o_proj"))
        x, residual = ops.add_rms_norm(residual, hidden, w.post_norm, cfg.rms_norm_eps,
                                       self.dtype)
        gate_up = linear(x, w.gate_up, None, packed.get("gate_up"), large.get("gate_up"))
        return linear(ops.silu_mul(gate_up), w.down, None, packed.get("down"),
                      large.get("down")), residual

    @torch.inference_mode()
    def logits(self, hidden, residual, rows: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head on the selected rows only -> float32 [len(rows), vocab]."""
        final = residual[rows].add_(hidden[rows])
        x = rms_norm(final, self.w.final_norm, self.cfg.rms_norm_eps, self.dtype)
        head = self.w.lm_head_packed
        if head is not None and x.shape[0] <= head.max_rows:  # float32 logits straight away
            return head(x, out=torch.empty(x.shape[0], head.out_features))
        return torch_linear(x, self.w.lm_head).float()
