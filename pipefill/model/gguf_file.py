"""GGUF files: architecture metadata, tensors (dequantized by the `gguf` package), tokenizer."""
from __future__ import annotations

import numpy as np
import torch

from pipefill.model.config import ModelConfig

# GGUF architecture -> Hugging Face model_type. Mistral GGUFs use the llama architecture.
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_LAYER_NAMES = {
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
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def hf_to_gguf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    model, layers, index, rest = name.split(".", 3)
    assert (model, layers) == ("model", "layers"), name
    return f"blk.{index}.{_LAYER_NAMES[rest]}"


class GGUFFile:
    def __init__(self, path: str):
        import gguf  # imported here: only GGUF users pay for it
        self.path = path
        self.reader = gguf.GGUFReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.field("general.architecture")

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def model_config(self) -> ModelConfig:
        if self.arch not in _ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.arch!r} in {self.path} is not supported: "
                             f"pipefill runs {', '.join(_ARCHITECTURES)}")
        a = self.arch
        num_heads = self.field(f"{a}.attention.head_count")
        hidden = self.field(f"{a}.embedding_length")
        vocab = self.field(f"{a}.vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        eos = self.field("tokenizer.ggml.eos_token_id")
        scaling = {}
        if f"{a}.rope.scaling.type" in self.reader.fields:
            kind = self.field(f"{a}.rope.scaling.type")
            if kind == "linear":
                scaling = {"rope_type": "linear",
                           "factor": self.field(f"{a}.rope.scaling.factor")}
            elif kind != "none":
                raise ValueError(f"GGUF rope scaling {kind!r} is not supported")
        if "rope_freqs.weight" in self.tensors:
            raise ValueError("GGUF files with per-dimension rope frequency factors "
                             "(rope_freqs.weight, Llama 3.1 style) are not supported yet; use "
                             "the Hugging Face folder of the model instead")
        return ModelConfig(
            model_type=_ARCHITECTURES[a],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self.field(f"{a}.feed_forward_length"),
            num_layers=self.field(f"{a}.block_count"),
            num_heads=num_heads,
            num_kv_heads=self.field(f"{a}.attention.head_count_kv", num_heads),
            head_dim=self.field(f"{a}.attention.key_length", hidden // num_heads),
            rms_norm_eps=self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
            max_position_embeddings=self.field(f"{a}.context_length", 2048),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            rope_scaling=scaling,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (eos,),
        )

    def has(self, hf_name: str) -> bool:
        return hf_to_gguf_name(hf_name) in self.tensors

    def load(self, hf_name: str, cfg: ModelConfig) -> torch.Tensor:
        """Dequantized float32 tensor in Hugging Face layout."""
        import gguf
        t = self.tensors[hf_to_gguf_name(hf_name)]
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        data = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
        # F32 tensors come back as read-only views of the memory-mapped file.
        w = torch.from_numpy(data if data.flags.writeable else data.copy())
        if self.arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads
            w = _unpermute_rotary(w, heads)
        return w


def _unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp interleaves the two rotary halves of each head's rows; undo it.
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape).contiguous())
