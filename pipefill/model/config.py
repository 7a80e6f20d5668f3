"""ModelConfig: the architecture facts a stage needs, read from config.json or GGUF metadata
by the model's family (pipefill.model.families), with the readers families share."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts family (model/moe.py)."""
    num_experts: int
    top_k: int
    expert_width: int  # each routed expert's intermediate size
    normalize: bool  # the top-k router weights renormalised to sum to one
    sparse_layers: tuple[bool, ...]  # per layer: a sparse MLP (else a dense one)
    shared_width: int = 0  # a shared expert every token passes (Qwen2-MoE); 0: none
    # DeepSeek's routers (families/deepseek.py); the defaults are the softmax top-k of the
    # Qwen and Mixtral families.
    scoring: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    topk_method: str = "greedy"  # or "group_limited_greedy" (V2), "noaux_tc" (V3)
    num_groups: int = 1  # experts split into this many groups ...
    topk_groups: int = 1  # ... of which the best this many are searched
    routed_scale: float = 1.0  # the routed experts' weights multiplied by this
    # Tensor parallelism split by expert: the global ids of the experts this rank holds
    # (model/tensor_parallel.py); None: all of them.
    local_experts: range | None = None

    @property
    def held_experts(self) -> range:
        return range(self.num_experts) if self.local_experts is None else self.local_experts


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, model/mla.py): keys and values of every
    head come from one latent vector per token (kv_lora_rank values, normed) and one rotary
    key (qk_rope_head_dim values) shared by the heads; the cache keeps only those two."""
    q_lora_rank: int | None  # None: q projected straight from the hidden state (V2)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # (nope + rope)^-0.5, times yarn's mscale(all_dim)^2 where set
    rope_interleaved: bool  # the rotary dims stored as (x0, x1), (x2, x3) pairs
    # The file stores kv_b_proj as llama.cpp's converter splits it for its absorbed attention:
    # each head's key part (transposed) and value part (families/deepseek_gguf.py).
    kv_b_split: bool = False

    @property
    def latent_dim(self) -> int:
        """Values one token keeps per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def projection_weights(self, hidden: int, heads: int) -> int:
        """Weights a token multiplies by in a layer's attention projections: q (through its
        low rank or not), kv_a, kv_b (once per token, as a prefill decompresses) and o."""
        rank = self.q_lora_rank
        q = (hidden * rank + rank * heads * self.qk_head_dim if rank
             else hidden * heads * self.qk_head_dim)
        return (q + hidden * self.latent_dim
                + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
                + heads * self.v_head_dim * hidden)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # config.json's model_type; names the family (families.family_of)
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
    moe: MoEConfig | None = None  # mixture-of-experts families only
    # Sliding-window attention per layer (Gemma 3): True where a layer sees only the last
    # sliding_window tokens; () when every layer sees the whole prefix.
    sliding_layers: tuple[bool, ...] = ()
    local_rope_theta: float | None = None  # the sliding layers' own rope base (no scaling)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: head_dim
    embed_scale: float | None = None  # the embedding's output multiplied by this (Gemma)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Added to every stored RMSNorm weight at load: Gemma's norms scale by (1 + w) and its
    # Hugging Face files store w (GGUF files store 1 + w already).
    norm_weight_offset: float = 0.0
    # Multi-head latent attention (DeepSeek); then head_dim is the rotary part's width
    # (what StageModel's rope tables are built for) and num_kv_heads is not used.
    mla: MLAConfig | None = None
    # A TP rank's query heads per KV head where they differ (model/tensor_parallel.local_groups:
    # a straddled GQA group); (): num_heads / num_kv_heads each.
    q_per_kv: tuple[int, ...] = ()

    def window_of(self, layer: int) -> int | None:
        """The tokens layer `layer` attends to (its query's own included); None: all."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else None

    @property
    def has_windows(self) -> bool:
        return any(self.sliding_layers)

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_weights(self) -> int:
        """Weights one token multiplies by in a layer's attention projections (q, k, v, o;
        a latent layer's as MLAConfig.projection_weights counts them)."""
        h = self.hidden_size
        if self.mla is None:
            return h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        return self.mla.projection_weights(h, self.num_heads)

    def mlp_weights(self, layer: int) -> int:
        """Weights one token multiplies by in a layer's MLP: the dense SwiGLU, or a sparse
        layer's router, its top-k routed experts and the shared expert."""
        if not self.is_sparse(layer):
            return 3 * self.hidden_size * self.intermediate_size
        return self.router_and_shared_weights + self.moe.top_k * self.expert_weights

    @property
    def expert_weights(self) -> int:
        """One routed expert's weights (gate, up and down); 0 without experts."""
        return 3 * self.hidden_size * self.moe.expert_width if self.moe else 0

    @property
    def router_and_shared_weights(self) -> int:
        """A sparse layer's weights every token multiplies by besides its routed experts."""
        moe = self.moe
        return self.hidden_size * (moe.num_experts + 3 * moe.shared_width) if moe else 0

    def kv_values(self, layer: int) -> int:
        """Values one token keeps in a layer's cache: K and V of the KV heads, or a latent
        layer's latent and rotary key."""
        return 2 * self.kv_size if self.mla is None else self.mla.latent_dim

    @property
    def attention_width(self) -> int:
        """Multiply-adds of one query against one key, its score and its weighted value:
        heads x (q/k head size + v head size)."""
        if self.mla is None:
            return 2 * self.q_size
        return self.num_heads * (self.mla.qk_head_dim + self.mla.v_head_dim)


def hf_rope(d: dict) -> tuple[float, dict]:
    """(rope theta, rope scaling without the default type) of a config.json: transformers 5
    writes rope_parameters, 4.x wrote rope_theta + rope_scaling."""
    rope = dict(d.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    scaling = dict(d.get("rope_scaling") or {}) or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    scaling = {} if rope_type == "default" else {**scaling, "rope_type": rope_type}
    return float(theta), scaling


def hf_common(d: dict) -> dict:
    """The ModelConfig fields that config.json states alike for every family."""
    return dict(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"), eos_token_ids=hf_eos_token_ids(d))


def hf_eos_token_ids(d: dict) -> tuple[int, ...]:
    """config.json's eos_token_id (one id, a list, or none) as a tuple."""
    eos = d.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def hf_head_dim(d: dict) -> int:
    return d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
