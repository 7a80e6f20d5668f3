"""The Gemma 3 family (text): Gemma3ForCausalLM, the language model of a
Gemma3ForConditionalGeneration checkpoint, and GGUF's `gemma3` architecture.

A Gemma 3 layer differs from a Llama layer in its norms and its attention: RMSNorm scales by
(1 + w) (folded into the weights at load), the attention and the MLP each have a norm before
and after, q and k are RMS-normed per head before rope, the MLP is GeGLU (tanh-approximated
GELU), the scores are scaled by 1/sqrt(query_pre_attn_scalar), and the embedding's output is
multiplied by sqrt(hidden). Most layers are local: they attend to the last `sliding_window`
tokens only and rotate with their own rope base; every sixth (or as config.json's layer_types
says) is global (ARCHITECTURE.md, 'Model families').
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipefill.model.attention import attention_in_pieces, last_rows_attention
from pipefill.model.config import ModelConfig, hf_eos_token_ids, hf_rope
from pipefill.model.family import KVSpec, ModelFamily, WeightReader
from pipefill.model.gguf_file import gguf_layer_name
from pipefill.model.families.gemma3_decode import GemmaDecodeRunner
from pipefill.model.layers import linear


@dataclass
class GemmaLayerWeights:
    layer: int  # the model's layer index (which says whether it is a sliding-window layer)
    input_norm: torch.Tensor  # [hidden] float32, 1 + w
    qkv: torch.Tensor | None  # [q_size + 2 * kv_size, hidden]; None once in `prefill`
    q_norm: torch.Tensor  # [head_dim] float32, 1 + w
    k_norm: torch.Tensor
    o_proj: torch.Tensor | None  # [hidden, q_size]
    post_attn_norm: torch.Tensor  # [hidden] float32, 1 + w
    pre_mlp_norm: torch.Tensor
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]
    down: torch.Tensor | None  # [hidden, intermediate]
    post_mlp_norm: torch.Tensor
    packed: dict | None = None  # decode copies (kernels.decode_gemm), as LayerWeights'
    prefill: dict | None = None  # oneDNN copies (kernels.prefill_gemm), as LayerWeights'


# Hugging Face layer tensor names (after model.layers.{i}.) -> GGUF names (after blk.{i}.).
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm")
MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# Gemma3TextConfig's defaults for what a config.json may leave out (a multimodal checkpoint's
# text_config often lists only what differs).
HF_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=131_072, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
                   sliding_window=4096, tie_word_embeddings=True, eos_token_id=1, bos_token_id=2,
                   rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)
# One global layer after every five local ones, where neither file says otherwise
# (config.json's sliding_window_pattern; llama.cpp fixes it for gemma3).
SLIDING_WINDOW_PATTERN = 6


class Gemma3Family(ModelFamily):
    name = "gemma3"
    hf_model_types = ("gemma3_text", "gemma3")
    hf_architectures = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    gguf_architectures = {"gemma3": "gemma3_text"}
    matrices = {"qkv": None, "o_proj": None, "gate_up": None, "down": None}

    def config_from_hf(self, d: dict) -> ModelConfig:
        if d.get("model_type") == "gemma3" or "text_config" in d:  # the multimodal checkpoint
            d = {"tie_word_embeddings": d.get("tie_word_embeddings", True),
                 **(d.get("text_config") or {})}
        d = {**HF_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
        _refuse_unsupported(d)
        theta, scaling, local_theta = _hf_ropes(d)
        num_layers = d["num_hidden_layers"]
        types = d.get("layer_types") or [_kind(i, d.get("sliding_window_pattern"))
                                         for i in range(num_layers)]
        return ModelConfig(
            model_type="gemma3_text",
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=num_layers,
            num_heads=d["num_attention_heads"],
            num_kv_heads=d["num_key_value_heads"],
            head_dim=d["head_dim"],
            rms_norm_eps=d["rms_norm_eps"],
            rope_theta=theta,
            max_position_embeddings=d["max_position_embeddings"],
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            qk_norm=True,
            rope_scaling=scaling,
            sliding_window=d["sliding_window"],
            bos_token_id=d["bos_token_id"],
            eos_token_ids=hf_eos_token_ids(d),
            sliding_layers=tuple(t == "sliding_attention" for t in types),
            local_rope_theta=local_theta,
            query_pre_attn_scalar=float(d["query_pre_attn_scalar"]),
            embed_scale=d["hidden_size"] ** 0.5,
            final_logit_softcapping=d.get("final_logit_softcapping"),
            norm_weight_offset=1.0,  # Hugging Face files store w of (1 + w)
        )

    def config_from_gguf(self, gguf) -> ModelConfig:
        field = gguf.arch_field
        hidden, num_heads = field("embedding_length"), field("attention.head_count")
        num_layers = field("block_count")
        head_dim = field("attention.key_length", 256)
        eos = gguf.field("tokenizer.ggml.eos_token_id")
        # llama.cpp scales by 1/sqrt(head_dim), except Gemma 3 27B (62 layers), whose
        # query_pre_attn_scalar is hidden / heads.
        scalar = hidden / num_heads if num_layers == 62 else head_dim
        return ModelConfig(
            model_type="gemma3_text",
            vocab_size=field("vocab_size") or gguf.array_length("tokenizer.ggml.tokens"),
            hidden_size=hidden,
            intermediate_size=field("feed_forward_length"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=field("attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=field("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=float(field("rope.freq_base", 1_000_000.0)),
            max_position_embeddings=field("context_length", 131_072),
            tie_word_embeddings=not gguf.has("output.weight"),
            qk_norm=True,
            rope_scaling=gguf.rope_scaling(),
            sliding_window=field("attention.sliding_window", 4096),
            bos_token_id=gguf.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (eos,),
            sliding_layers=tuple(_kind(i, None) == "sliding_attention"
                                 for i in range(num_layers)),
            local_rope_theta=10_000.0,  # llama.cpp's fixed local base for gemma3
            query_pre_attn_scalar=float(scalar),
            embed_scale=hidden ** 0.5,
            final_logit_softcapping=field("final_logit_softcapping"),
            norm_weight_offset=0.0,  # llama.cpp's converter stored 1 + w
        )

    def layer_tensor_names(self, cfg: ModelConfig, layer: int) -> list[str]:
        p = f"model.layers.{layer}."
        return ([p + n + ".weight" for n in NORMS + MATRICES]
                + [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"])

    def gguf_name(self, hf_name: str) -> str:
        return gguf_layer_name(hf_name, GGUF_LAYER_NAMES)

    def load_layer(self, cfg: ModelConfig, layer: int, read: WeightReader) -> GemmaLayerWeights:
        p = f"model.layers.{layer}."
        a, m = p + "self_attn.", p + "mlp."

        def norm(name: str) -> torch.Tensor:
            return read.vec(name) + cfg.norm_weight_offset

        return GemmaLayerWeights(
            layer=layer,
            input_norm=norm(p + "input_layernorm.weight"),
            qkv=read.linear(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            q_norm=norm(a + "q_norm.weight"),
            k_norm=norm(a + "k_norm.weight"),
            o_proj=read.linear(a + "o_proj.weight"),
            post_attn_norm=norm(p + "post_attention_layernorm.weight"),
            pre_mlp_norm=norm(p + "pre_feedforward_layernorm.weight"),
            gate_up=read.linear(m + "gate_proj.weight", m + "up_proj.weight"),
            down=read.linear(m + "down_proj.weight"),
            post_mlp_norm=norm(p + "post_feedforward_layernorm.weight"),
        )

    def kv_specs(self, cfg: ModelConfig, layers: range, kv_dtype: torch.dtype) -> list[KVSpec]:
        # A local layer's spec carries its window: the stage keeps those layers' pages apart
        # and frees them outside the window (ARCHITECTURE.md, 'Window pages').
        return [KVSpec(cfg.num_kv_heads, cfg.head_dim, kv_dtype, cfg.window_of(i))
                for i in layers]

    def layer_forward(self, model, w: GemmaLayerWeights, hidden, residual, meta, cos, sin,
                      k_cache, v_cache, trim: bool = False):
        cfg, ops, dtype = model.cfg, model.ops, model.dtype
        eps = cfg.rms_norm_eps
        x, residual = ops.add_rms_norm(residual, hidden, w.input_norm, eps, dtype)
        packed, large = w.packed or {}, w.prefill or {}
        qkv = linear(x, w.qkv, None, packed.get("qkv"), large.get("qkv"))
        q, k, v = _rotated_heads(model, w, qkv, cos, sin)
        window = cfg.window_of(w.layer)
        # A window layer's pages are its own where the stage keeps them apart (ARCHITECTURE.md,
        # 'Window pages').
        seqs = meta.window_seqs if window is not None and meta.window_seqs is not None \
            else meta.seqs
        # Their pages form a ring that a long chunk wraps onto: computed piece by piece.
        piece = meta.window_piece if seqs is meta.window_seqs else 0
        if trim:
            attn, rows = last_rows_attention(model.attention, model.kv_writer, q, k, v, k_cache,
                                             v_cache, seqs, meta.last_rows, model.scale,
                                             window, piece)
            residual = residual[rows]
            if residual.shape[0] == 0:  # no logits this step (a chunk before a prompt's last)
                return attn.new_empty((0, cfg.hidden_size)), residual
        elif window is None:
            attn = model.attention(q, k, v, k_cache, v_cache, seqs, model.scale)
        else:
            attn = attention_in_pieces(model.attention, q, k, v, k_cache, v_cache, seqs,
                                       model.scale, window, piece)
        # Under tensor parallelism o_proj and down give partial sums, summed before the
        # post-norms (ARCHITECTURE.md, 'Tensor parallelism inside a stage').
        out = model.tp_sum(linear(attn.reshape(attn.shape[0], cfg.q_size), w.o_proj, None,
                                  packed.get("o_proj"), large.get("o_proj")))
        out = ops.rms_norm(out, w.post_attn_norm, eps, dtype)
        x, residual = ops.add_rms_norm(residual, out, w.pre_mlp_norm, eps, dtype)
        gate_up = linear(x, w.gate_up, None, packed.get("gate_up"), large.get("gate_up"))
        out = model.tp_sum(linear(ops.gelu_mul(gate_up), w.down, None, packed.get("down"),
                                  large.get("down")))
        return ops.rms_norm(out, w.post_mlp_norm, eps, dtype), residual

    def decode_runner(self, model):
        """Decode steps on the lean path with Gemma's norms, GeGLU, local ropes and windows
        (families/gemma3_decode.py): the same kernels in the same order as layer_forward."""
        return GemmaDecodeRunner(model) if GemmaDecodeRunner.supports(model) else None


def _rotated_heads(model, w: GemmaLayerWeights, qkv, cos, sin):
    """q [T, Hq, D], k and v [T, Hkv, D] as views of qkv, q and k RMS-normed per head and
    rotated in place (adjacent columns: one pass over both)."""
    cfg = model.cfg
    num_tokens = qkv.shape[0]
    qk = qkv[:, :cfg.q_size + cfg.kv_size].view(num_tokens, -1, cfg.head_dim)
    model.ops.qk_norm_rope_(qk, cfg.num_heads, w.q_norm, w.k_norm, cfg.rms_norm_eps, cos, sin)
    v = qkv[:, cfg.q_size + cfg.kv_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    return qk[:, :cfg.num_heads], qk[:, cfg.num_heads:], v


def _kind(layer: int, pattern: int | None) -> str:
    """A layer's attention kind by the sliding-window pattern: global every `pattern`-th."""
    every = pattern or SLIDING_WINDOW_PATTERN
    return "sliding_attention" if (layer + 1) % every else "full_attention"


def _hf_ropes(d: dict) -> tuple[float, dict, float]:
    """(global rope theta, its scaling, the local layers' theta) from config.json:
    transformers 5 writes rope_parameters per layer kind, 4.x rope_theta + rope_scaling (for
    the global layers) and rope_local_base_freq."""
    params = d.get("rope_parameters") or {}
    if "full_attention" in params:
        theta, scaling = hf_rope({"rope_parameters": params["full_attention"]})
        local_theta, local_scaling = hf_rope({"rope_parameters": params.get(
            "sliding_attention") or {"rope_theta": d["rope_local_base_freq"]}})
        if local_scaling:
            raise ValueError(f"gemma3: rope scaling {local_scaling.get('rope_type')!r} on the "
                             "sliding-window layers is not supported")
        return theta, scaling, local_theta
    theta, scaling = hf_rope({k: v for k, v in d.items() if k != "rope_parameters"})
    return theta, scaling, float(d["rope_local_base_freq"])


def _refuse_unsupported(d: dict) -> None:
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("gemma3: attn_logit_softcapping is not supported (Gemma 3 checkpoints "
                         "have none)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("gemma3: use_bidirectional_attention (an encoder) is not supported")
    if d["hidden_activation"] != "gelu_pytorch_tanh":
        raise ValueError(f"gemma3: hidden_activation {d['hidden_activation']!r} is not "
                         "supported (pipefill runs 'gelu_pytorch_tanh')")


GEMMA3 = Gemma3Family()
