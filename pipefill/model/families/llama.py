"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Pre-norm decoder layers: RMSNorm, grouped-query attention with rotary positions, RMSNorm, a
SwiGLU MLP. The layer's q/k/v and gate/up projections are stacked into one matrix each, so a
layer runs four GEMMs; decode steps on the fused kernels take model.decode_step's lean path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipefill.model.attention import last_rows_attention
from pipefill.model.config import ModelConfig, hf_common, hf_head_dim, hf_rope
from pipefill.model.decode_step import DecodeRunner
from pipefill.model.family import KVSpec, ModelFamily, WeightReader
from pipefill.model.gguf_file import gguf_layer_name
from pipefill.model.layers import by_row_tiles, linear, rms_norm


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden] float32
    # The four matrices are None once moved into `prefill` (loader.reorder_prefill_weights), or
    # when kept as GGUF blocks (loader.place_quant_linears: then in `packed` and `prefill`).
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
    # A sparse MLP (mixture-of-experts families) in place of gate_up/down (then None).
    moe: object | None = None


# Hugging Face layer tensor names (after model.layers.{i}.) -> GGUF names (after blk.{i}.).
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


class LlamaFamily(ModelFamily):
    name = "llama"
    hf_model_types = ("llama", "mistral", "qwen2", "qwen3")
    hf_architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                        "Qwen3ForCausalLM")
    # Mistral GGUFs use the llama architecture.
    gguf_architectures = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
    matrices = {"qkv": "qkv_bias", "o_proj": None, "gate_up": None, "down": None}

    def config_from_hf(self, d: dict) -> ModelConfig:
        model_type = d.get("model_type") or _model_type_of(d.get("architectures") or [])
        theta, scaling = hf_rope(d)
        num_heads = d["num_attention_heads"]
        window = d.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
            window = None
        return ModelConfig(
            model_type=model_type,
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=hf_head_dim(d),
            rope_theta=theta,
            attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_scaling=scaling,
            sliding_window=window,
            **hf_common(d),
        )

    def config_from_gguf(self, gguf) -> ModelConfig:
        field = gguf.arch_field
        num_heads = field("attention.head_count")
        hidden = field("embedding_length")
        eos = gguf.field("tokenizer.ggml.eos_token_id")
        scaling = gguf.rope_scaling()
        return ModelConfig(
            model_type=self.gguf_architectures[gguf.arch],
            vocab_size=field("vocab_size") or gguf.array_length("tokenizer.ggml.tokens"),
            hidden_size=hidden,
            intermediate_size=field("feed_forward_length"),
            num_layers=field("block_count"),
            num_heads=num_heads,
            num_kv_heads=field("attention.head_count_kv", num_heads),
            head_dim=field("attention.key_length", hidden // num_heads),
            rms_norm_eps=field("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=float(field("rope.freq_base", 10000.0)),
            max_position_embeddings=field("context_length", 2048),
            tie_word_embeddings=not gguf.has("output.weight"),
            attention_bias=gguf.has("blk.0.attn_q.bias"),
            qk_norm=gguf.has("blk.0.attn_q_norm.weight"),
            rope_scaling=scaling,
            bos_token_id=gguf.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (eos,),
        )

    def layer_tensor_names(self, cfg: ModelConfig, layer: int) -> list[str]:
        p = f"model.layers.{layer}."
        names = [p + n for n in ("input_layernorm.weight", "self_attn.q_proj.weight",
                                 "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                 "self_attn.o_proj.weight", "post_attention_layernorm.weight")]
        names += self.mlp_tensor_names(cfg, layer)
        if cfg.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    def mlp_tensor_names(self, cfg: ModelConfig, layer: int) -> list[str]:
        p = f"model.layers.{layer}.mlp."
        return [p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"]

    def gguf_name(self, hf_name: str) -> str:
        return gguf_layer_name(hf_name, GGUF_LAYER_NAMES)

    def gguf_rotary_heads(self, cfg: ModelConfig, arch: str, hf_name: str) -> int | None:
        # llama.cpp's converter interleaves q and k rows for the llama architecture only.
        if arch != "llama":
            return None
        if hf_name.endswith("q_proj.weight"):
            return cfg.num_heads
        return cfg.num_kv_heads if hf_name.endswith("k_proj.weight") else None

    def load_layer(self, cfg: ModelConfig, layer: int, read: WeightReader) -> LayerWeights:
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        return LayerWeights(
            input_norm=read.vec(p + "input_layernorm.weight"),
            qkv=read.linear(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            qkv_bias=(read.mat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
                      if cfg.attention_bias else None),
            o_proj=read.linear(a + "o_proj.weight"),
            post_norm=read.vec(p + "post_attention_layernorm.weight"),
            q_norm=read.vec(a + "q_norm.weight") if cfg.qk_norm else None,
            k_norm=read.vec(a + "k_norm.weight") if cfg.qk_norm else None,
            **self.load_mlp(cfg, layer, read),
        )

    def load_mlp(self, cfg: ModelConfig, layer: int, read: WeightReader) -> dict:
        """The MLP's fields of LayerWeights (a family with another MLP overrides this)."""
        p = f"model.layers.{layer}.mlp."
        return dict(gate_up=read.linear(p + "gate_proj.weight", p + "up_proj.weight"),
                    down=read.linear(p + "down_proj.weight"))

    def kv_specs(self, cfg: ModelConfig, layers: range, kv_dtype: torch.dtype) -> list[KVSpec]:
        # Every layer alike; the attention sees the whole prefix (a config's sliding_window is
        # not applied by this family).
        return [KVSpec(cfg.num_kv_heads, cfg.head_dim, kv_dtype) for _ in layers]

    def layer_forward(self, model, w: LayerWeights, hidden, residual, meta, cos, sin, k_cache,
                      v_cache, trim: bool = False):
        cfg, ops = model.cfg, model.ops
        x, residual = ops.add_rms_norm(residual, hidden, w.input_norm, cfg.rms_norm_eps,
                                       model.dtype)
        packed, large = w.packed or {}, w.prefill or {}
        qkv = linear(x, w.qkv, w.qkv_bias, packed.get("qkv"), large.get("qkv"))
        q, k, v = self._rotated_heads(model, w, qkv, cos, sin)
        if trim:
            attn, rows = last_rows_attention(model.attention, model.kv_writer, q, k, v, k_cache,
                                             v_cache, meta.seqs, meta.last_rows, model.scale)
            residual = residual[rows]
            if residual.shape[0] == 0:  # no logits this step (a chunk before a prompt's last)
                return attn.new_empty((0, cfg.hidden_size)), residual
        else:
            attn = model.attention(q, k, v, k_cache, v_cache, meta.seqs, model.scale)
        hidden = model.tp_sum(linear(attn.reshape(attn.shape[0], cfg.q_size), w.o_proj, None,
                                     packed.get("o_proj"), large.get("o_proj")))
        x, residual = ops.add_rms_norm(residual, hidden, w.post_norm, cfg.rms_norm_eps,
                                       model.dtype)
        return model.tp_sum(self.mlp(model, w, x)), residual

    @staticmethod
    def mlp(model, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP on the normed rows x: SwiGLU, or the sparse MLP in its place."""
        if w.moe is not None:
            return w.moe(x)
        packed, large = w.packed or {}, w.prefill or {}

        def swiglu(rows: torch.Tensor) -> torch.Tensor:
            # gate/up is freed before the down projection runs, which reuses its memory
            # (ARCHITECTURE.md, 'What a stage's memory is made of').
            act = model.ops.silu_mul(linear(rows, w.gate_up, None, packed.get("gate_up"),
                                            large.get("gate_up")))
            return linear(act, w.down, None, packed.get("down"), large.get("down"))
        return by_row_tiles(swiglu, x)

    @staticmethod
    def _rotated_heads(model, w: LayerWeights, qkv, cos, sin):
        """q [T, Hq, D], k and v [T, Hkv, D] as views of qkv, q and k normed (Qwen3) and
        rotated in place."""
        cfg, ops = model.cfg, model.ops
        num_tokens = qkv.shape[0]
        q = qkv[:, :cfg.q_size].view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].view(num_tokens, cfg.num_kv_heads, -1)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, cfg.rms_norm_eps, model.dtype)
            k = rms_norm(k, w.k_norm, cfg.rms_norm_eps, model.dtype)
            ops.rope_(q, cos, sin)
            ops.rope_(k, cos, sin)
        else:
            # q and k are adjacent columns of qkv: rotate both heads in one pass.
            qk = qkv[:, :cfg.q_size + cfg.kv_size].view(num_tokens, -1, cfg.head_dim)
            ops.rope_(qk, cos, sin)
        return q, k, v

    def decode_runner(self, model):
        return DecodeRunner(model) if DecodeRunner.supports(model) else None


def _model_type_of(architectures: list[str]) -> str:
    """The model_type of a config.json that names only its architectures (the registry
    matched one of LlamaFamily.hf_architectures)."""
    for arch in architectures:
        if arch in LlamaFamily.hf_architectures:
            return arch.removesuffix("ForCausalLM").lower()
    raise AssertionError(architectures)


LLAMA = LlamaFamily()
