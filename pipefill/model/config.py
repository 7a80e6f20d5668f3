"""ModelConfig: the architecture facts a stage needs, read from config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field

# Families we run, by Hugging Face model_type; all are Llama-style decoders that differ only in
# the flags below (qkv bias, per-head q/k norm).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q, k and v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope_scaling: dict = field(default_factory=dict)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @staticmethod
    def from_hf_dict(d: dict) -> "ModelConfig":
        model_type = d.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {model_type!r}: pipefill runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        # transformers 5 writes rope_parameters; 4.x wrote rope_theta + rope_scaling.
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        scaling = dict(d.get("rope_scaling") or {}) or rope
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = {} if rope_type == "default" else {**scaling, "rope_type": rope_type}
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = d.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
            window = None
        return ModelConfig(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_scaling=scaling,
            sliding_window=window,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
