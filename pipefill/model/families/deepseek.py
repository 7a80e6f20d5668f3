"""The DeepSeek family: DeepSeek-V3 (and V3.1, R1) and DeepSeek-V2 (and V2-Lite, V2.5).

Pre-norm decoder layers whose attention is multi-head latent attention (model/mla.py): q from
a low-rank projection with its own RMSNorm (V3's q_a_proj, q_a_layernorm, q_b_proj) or
straight from the hidden state (V2's q_proj); kv_a_proj_with_mqa gives each token's latent
(normed by kv_a_layernorm) and its rotary key, which is all the cache keeps; kv_b_proj turns
latents into every head's keys and values. Rope turns only the qk_rope_head_dim part; DeepSeek
stores those dimensions in interleaved pairs, which load reorders into the halves that the
rotate-half rope turns (the rows of q and of the rotary key alike, so every score is the same).
Yarn scaling stretches the rope and scales cos and sin (model/rope.py) and, with
mscale_all_dim, the softmax (MLAConfig.softmax_scale), as transformers does.

The MLP is SwiGLU in the first first_k_dense_replace layers (and those moe_layer_freq skips),
DeepSeekMoE in the others: model/moe.py's experts with DeepSeek's router (DeepSeekRouter:
V3's sigmoid scores with a correction bias that only chooses, within the best groups; V2's
softmax, greedy or group-limited) and ungated shared experts. Multi-token-prediction layers
(layers from num_hidden_layers on in a V3 checkpoint) are not read.

From an FP8 checkpoint (V3's release) the linear layers read through read.linear (q_a/q_proj
with kv_a_proj_with_mqa, q_b_proj, o_proj, a dense layer's MLP, the routed experts) stay FP8
where --weight-dtype keeps them (the rows reordered above keep their own scales: read.linear's
order); kv_b_proj (split per head by model/mla.py) and the shared experts are dequantized
at load (ARCHITECTURE.md, 'FP8 block-quantized checkpoints').

GGUF files (llama.cpp's "deepseek2", V2 and V3 alike) hold the same weights under their own
names, read as families/deepseek_gguf.py says; under --weight-dtype gguf the same linear layers
stay in their blocks (the reorder moves whole rows of blocks, before their decode layout).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from pipefill.model.attention import SeqMeta
from pipefill.model.config import MLAConfig, ModelConfig, MoEConfig, hf_common, hf_rope
from pipefill.model.family import KVSpec, ModelFamily, WeightReader
from pipefill.model.families.deepseek_gguf import (GGUF_LAYER_NAMES, check_tensors, hf_config,
                                                    read_kv_b, splits_kv_b, stored_tensor)
from pipefill.model.families.llama import LlamaFamily
from pipefill.model.gguf_file import gguf_layer_name
from pipefill.model.layers import linear, rms_norm
from pipefill.model.mla import LatentAttention, LatentUp, latent_attention, write_latent
from pipefill.model.moe import Experts, MoEBlock, RouterSpec, SharedExpert
from pipefill.model.rope import apply_rope_, yarn_mscale

log = logging.getLogger(__name__)

ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2"}
# Router options each version implements: (config key, its default, what pipefill runs).
ROUTERS = {"deepseek_v3": (("scoring_func", "sigmoid", ("sigmoid",)),
                           ("topk_method", "noaux_tc", ("noaux_tc",))),
           "deepseek_v2": (("scoring_func", "softmax", ("softmax",)),
                           ("topk_method", "greedy", ("greedy", "group_limited_greedy")))}


@dataclass
class DeepSeekLayerWeights:
    input_norm: torch.Tensor  # [hidden] float32
    # q_a_proj (V3) or q_proj (V2) and kv_a_proj_with_mqa stacked: one GEMM from the normed
    # input; None once moved into `prefill` (loader.reorder_prefill_weights).
    qkv_a: torch.Tensor | None  # [q_lora_rank or heads * qk_head_dim + latent_dim, hidden]
    q_a_norm: torch.Tensor | None  # [q_lora_rank] float32; None without q LoRA
    q_b: torch.Tensor | None  # [heads * qk_head_dim, q_lora_rank]; None without q LoRA
    kv_a_norm: torch.Tensor  # [kv_lora_rank] float32
    up: LatentUp  # kv_b_proj
    o_proj: torch.Tensor | None  # [hidden, heads * v_head_dim]
    post_norm: torch.Tensor  # [hidden] float32
    gate_up: torch.Tensor | None  # a dense layer's [2 * intermediate, hidden]
    down: torch.Tensor | None
    packed: dict | None = None  # decode copies, by field name (as LayerWeights')
    prefill: dict | None = None  # oneDNN copies, by field name
    moe: MoEBlock | None = None  # a sparse layer's MLP


@dataclass(frozen=True)
class DeepSeekRouter:
    """DeepSeekMoE's choice of experts from the router's logits (MoEBlock.rule): scores by
    softmax (V2) or sigmoid (V3); the top-k of them (greedy), of those in the topk_groups
    groups with the best maximum (group_limited_greedy), or, with the correction bias added
    for the choice only, in the groups with the best sum of their two best (noaux_tc); the
    chosen scores renormalised where norm_topk_prob says, times routed_scaling_factor."""
    scoring: str
    method: str
    num_groups: int
    topk_groups: int
    scale: float
    normalize: bool
    bias: torch.Tensor | None = None  # e_score_correction_bias [experts] float32 (V3)

    def __call__(self, logits: torch.Tensor, spec: RouterSpec, dtype: torch.dtype):
        logits = logits.float()
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        if self.method == "noaux_tc":
            choice = self._in_best_groups(scores + self.bias, float("-inf"))
            ids = torch.topk(choice, spec.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        else:
            if self.method == "group_limited_greedy":
                scores = self._in_best_groups(scores, 0.0)
            weights, ids = torch.topk(scores, spec.top_k, dim=-1)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scale).to(dtype), ids

    def _in_best_groups(self, scores: torch.Tensor, fill: float) -> torch.Tensor:
        """scores with every expert outside the topk_groups best groups set to `fill`."""
        grouped = scores.view(scores.shape[0], self.num_groups, -1)
        if self.method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        best = torch.topk(group_scores, self.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], fill).view_as(scores)


class DeepSeekFamily(ModelFamily):
    name = "deepseek"
    hf_model_types = tuple(ROUTERS)
    hf_architectures = tuple(ARCHITECTURES)
    # llama.cpp writes both versions as "deepseek2"; V3 files are told by their router.
    gguf_architectures = {"deepseek2": "deepseek_v2"}
    layout_hint = (" (pipefill reads one tensor per expert, as in "
                   "model.layers.N.mlp.experts.E.gate_proj.weight, in bfloat16, float16 or "
                   "float32, or FP8 e4m3 with a weight_scale_inv per 128 x 128 block)")
    matrices = {"qkv_a": None, "q_b": None, "o_proj": None, "gate_up": None, "down": None}

    def config_from_hf(self, d: dict) -> ModelConfig:
        model_type = d.get("model_type") or next(
            ARCHITECTURES[a] for a in d.get("architectures") or [] if a in ARCHITECTURES)
        refuse_unsupported(d, model_type)
        theta, scaling = hf_rope(d)
        if scaling.get("rope_type") == "yarn":
            scaling = yarn_defaults(d, scaling)
        skip_mtp_layers(d)
        return ModelConfig(
            model_type=model_type,
            num_heads=d["num_attention_heads"],
            num_kv_heads=d["num_attention_heads"],  # not used: the cache keeps latents
            head_dim=d["qk_rope_head_dim"],  # the rope tables' width (ModelConfig.mla)
            rope_theta=theta,
            rope_scaling=scaling,
            moe=moe_config(d, model_type),
            mla=mla_config(d, model_type, scaling),
            **hf_common(d),
        )

    def config_from_gguf(self, gguf) -> ModelConfig:
        """The file's metadata read as the config.json it came from (families/deepseek_gguf.py),
        the file's tensors checked against it."""
        d, mtp = hf_config(gguf)
        cfg = self.config_from_hf(d)
        if mtp:
            log_skipped_mtp(mtp, f"blk.{cfg.num_layers}")
        cfg = replace(cfg, mla=replace(cfg.mla, kv_b_split=splits_kv_b(gguf)))
        check_tensors(gguf, cfg, self)
        return cfg

    def gguf_name(self, hf_name: str) -> str:
        return gguf_layer_name(hf_name, GGUF_LAYER_NAMES)

    def gguf_tensor(self, hf_name: str) -> tuple[str, int | None]:
        return stored_tensor(hf_name)

    def layer_tensor_names(self, cfg: ModelConfig, layer: int) -> list[str]:
        p = f"model.layers.{layer}."
        names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + "self_attn." + n for n in attention_names(cfg.mla)]
        if not cfg.is_sparse(layer):
            return names + [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        names += [p + "mlp.gate.weight"]
        if cfg.moe.topk_method == "noaux_tc":
            names.append(p + "mlp.gate.e_score_correction_bias")
        for e in cfg.moe.held_experts:
            names += expert_names(layer, e)
        if cfg.moe.shared_width:
            names += shared_names(layer)
        return names

    def load_layer(self, cfg: ModelConfig, layer: int, read: WeightReader
                   ) -> DeepSeekLayerWeights:
        p, mla = f"model.layers.{layer}.", cfg.mla
        a = p + "self_attn."
        q_first = a + ("q_a_proj.weight" if mla.q_lora_rank else "q_proj.weight")
        # Rotary pairs into halves (the rotate-half layout), as the rows are read: blocks kept
        # quantized move before their decode layout is written (kernels.quant_gemm).
        q_proj_rows = None if mla.q_lora_rank else cfg.num_heads * mla.qk_head_dim
        qkv_a = read.linear(q_first, a + "kv_a_proj_with_mqa.weight", order=(
            (lambda rows: qkv_a_order(rows, mla, q_proj_rows)) if mla.rope_interleaved
            else None))
        q_b = read.linear(a + "q_b_proj.weight", order=(
            (lambda rows: rope_halves_order(rows, mla.qk_head_dim, mla.qk_nope_head_dim))
            if mla.rope_interleaved else None)) if mla.q_lora_rank else None
        mlp = (self.load_sparse_mlp(cfg, layer, read) if cfg.is_sparse(layer) else
               dict(gate_up=read.linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=read.linear(p + "mlp.down_proj.weight")))
        return DeepSeekLayerWeights(
            input_norm=read.vec(p + "input_layernorm.weight"),
            qkv_a=qkv_a,
            q_a_norm=read.vec(a + "q_a_layernorm.weight") if mla.q_lora_rank else None,
            q_b=q_b,
            kv_a_norm=read.vec(a + "kv_a_layernorm.weight"),
            up=LatentUp(read_kv_b(read, a, mla), cfg.num_heads, mla.qk_nope_head_dim,
                        mla.v_head_dim),
            o_proj=read.linear(a + "o_proj.weight"),
            post_norm=read.vec(p + "post_attention_layernorm.weight"),
            **mlp)

    def load_sparse_mlp(self, cfg: ModelConfig, layer: int, read: WeightReader) -> dict:
        moe, p = cfg.moe, f"model.layers.{layer}.mlp."
        held = moe.held_experts  # a tensor-parallel rank split by expert: its own
        experts = Experts.read(read, [expert_names(layer, e) for e in held])
        experts.first = held.start
        shared = None
        if moe.shared_width:
            gate, up, down = shared_names(layer)
            shared = SharedExpert(read.mat(gate, up), read.mat(down))
        bias = (read.vec(p + "gate.e_score_correction_bias") if moe.topk_method == "noaux_tc"
                else None)
        rule = DeepSeekRouter(moe.scoring, moe.topk_method, moe.num_groups, moe.topk_groups,
                              moe.routed_scale, moe.normalize, bias)
        block = MoEBlock(read.mat(p + "gate.weight"),
                         RouterSpec(moe.num_experts, moe.top_k, moe.normalize), experts,
                         shared, rule=rule)
        return dict(gate_up=None, down=None, moe=block)

    def kv_specs(self, cfg: ModelConfig, layers: range, kv_dtype: torch.dtype) -> list[KVSpec]:
        return [KVSpec.latent(cfg.mla.latent_dim, kv_dtype) for _ in layers]

    def layer_forward(self, model, w: DeepSeekLayerWeights, hidden, residual, meta, cos, sin,
                      k_cache, v_cache, trim: bool = False):
        cfg, mla = model.cfg, model.cfg.mla
        x, residual = model.ops.add_rms_norm(residual, hidden, w.input_norm, cfg.rms_norm_eps,
                                             model.dtype)
        q_nope, q_pe, latent = self._project(model, w, x, cos, sin)
        write_latent(k_cache, v_cache, latent, meta.seqs)
        seqs = meta.seqs
        if trim:  # the last rows only, after every row's latent is in the cache
            rows, seqs = last_rows_only(meta)
            q_nope, q_pe, residual = q_nope[rows], q_pe[rows], residual[rows]
            if residual.shape[0] == 0:  # no logits this step (a chunk before a prompt's last)
                return x.new_empty((0, cfg.hidden_size)), residual
        how = (model.attention if isinstance(model.attention, LatentAttention)
               else LatentAttention())  # a stage built without one (tests): torch
        attn = latent_attention(q_nope, q_pe, k_cache, v_cache, seqs, w.up, mla.latent_dim,
                                mla.softmax_scale, how, meta.derived)
        packed, large = w.packed or {}, w.prefill or {}
        # Under tensor parallelism o_proj holds this rank's heads' columns and the MLP its
        # share: both give partial sums (model/tensor_parallel.py).
        out = model.tp_sum(linear(attn.reshape(attn.shape[0], -1), w.o_proj, None,
                                  packed.get("o_proj"), large.get("o_proj")))
        x, residual = model.ops.add_rms_norm(residual, out, w.post_norm, cfg.rms_norm_eps,
                                             model.dtype)
        return model.tp_sum(LlamaFamily.mlp(model, w, x)), residual

    @staticmethod
    def _project(model, w: DeepSeekLayerWeights, x, cos, sin):
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated) and the latents [T, latent_dim]
        (c normed, k_pe rotated) of the normed rows x."""
        cfg, mla, dtype = model.cfg, model.cfg.mla, model.dtype
        packed, large = w.packed or {}, w.prefill or {}
        a = linear(x, w.qkv_a, None, packed.get("qkv_a"), large.get("qkv_a"))
        q = a[:, :a.shape[1] - mla.latent_dim]
        if w.q_a_norm is not None:  # q LoRA (V3): q_b_proj after q_a_layernorm
            q = linear(rms_norm(q, w.q_a_norm, cfg.rms_norm_eps, dtype), w.q_b, None,
                       packed.get("q_b"), large.get("q_b"))
        q = q.reshape(x.shape[0], cfg.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q[..., :mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
        kv = a[:, a.shape[1] - mla.latent_dim:]
        latent = torch.cat([rms_norm(kv[:, :mla.kv_lora_rank], w.kv_a_norm, cfg.rms_norm_eps,
                                     dtype), kv[:, mla.kv_lora_rank:]], dim=1)
        cos, sin = cos.to(dtype), sin.to(dtype)
        apply_rope_(q_pe, cos, sin)
        apply_rope_(latent[:, None, mla.kv_lora_rank:], cos, sin)
        return q_nope, q_pe, latent

    def layer_costs(self, cfg: ModelConfig) -> list[float]:
        """Weights a token multiplies by in each layer: the latent attention's projections
        (kv_b_proj once per token, as a prefill decompresses it), then the dense MLP or the
        router, its top-k experts and the shared experts."""
        h, moe = cfg.hidden_size, cfg.moe
        attention = cfg.mla.projection_weights(h, cfg.num_heads)
        dense = 3 * h * cfg.intermediate_size
        sparse = (h * (moe.num_experts + 3 * moe.top_k * moe.expert_width
                       + 3 * moe.shared_width) if moe else dense)
        return [float(attention + (sparse if cfg.is_sparse(i) else dense))
                for i in range(cfg.num_layers)]


def last_rows_only(meta):
    """(rows, seqs) for a trimmed layer: the last row of each sequence meta.last_rows keeps,
    as a one-query sequence at the end of its tokens (its latents are in the cache)."""
    rows, seqs = [], []
    for seq, wanted in zip(meta.seqs, meta.last_rows):
        if wanted:
            seqs.append(SeqMeta(len(rows), 1, seq.prefix_len + seq.num_new - 1, slice(0, 0),
                                seq.read_slots, seq.page_table))
            rows.append(seq.row_start + seq.num_new - 1)
    return torch.tensor(rows, dtype=torch.long), seqs


def rope_halves_order(num_rows: int, head_dim: int, nope_dim: int) -> torch.Tensor:
    """Row order of a q projection ([heads * head_dim] rows) that turns each head's rotary
    rows from pairs (x0, x1), (x2, x3), ... into halves (x0, x2, ..., x1, x3, ...)."""
    order = torch.arange(num_rows).view(-1, head_dim)
    rope = order[:, nope_dim:]
    order[:, nope_dim:] = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
    return order.reshape(-1)


def qkv_a_order(num_rows: int, mla: MLAConfig, q_rows: int | None) -> torch.Tensor:
    """Row order of the stacked q_a (or q_proj: q_rows of them, reordered per head too) and
    kv_a_proj_with_mqa: the rotary key's rows (the last qk_rope_head_dim) into halves."""
    order = torch.arange(num_rows)
    if q_rows is not None:
        order[:q_rows] = rope_halves_order(q_rows, mla.qk_head_dim, mla.qk_nope_head_dim)
    order[num_rows - mla.latent_dim:] = (num_rows - mla.latent_dim) + rope_halves_order(
        mla.latent_dim, mla.latent_dim, mla.kv_lora_rank)
    return order


def attention_names(mla: MLAConfig) -> list[str]:
    q = (["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"] if mla.q_lora_rank
         else ["q_proj.weight"])
    kv_b = (["k_b_proj.weight", "v_b_proj.weight"] if mla.kv_b_split  # a GGUF file's halves
            else ["kv_b_proj.weight"])
    return q + ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", *kv_b, "o_proj.weight"]


def expert_names(layer: int, e: int) -> tuple[str, str, str]:
    p = f"model.layers.{layer}.mlp.experts.{e}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def shared_names(layer: int) -> tuple[str, str, str]:
    p = f"model.layers.{layer}.mlp.shared_experts."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def refuse_unsupported(d: dict, model_type: str) -> None:
    """A sentence for a config this family would misread."""
    for key, default, runs in ROUTERS[model_type]:
        if d.get(key) is not None and d[key] not in runs:
            raise ValueError(f"{model_type}: {key} {d[key]!r} is not supported (pipefill runs "
                             f"{' and '.join(map(repr, runs))})")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_type}: hidden_act {d['hidden_act']!r} is not supported "
                         "(pipefill runs 'silu')")
    if d.get("attention_bias"):
        raise ValueError(f"{model_type}: attention_bias is not supported (DeepSeek "
                         "checkpoints have none)")
    if model_type == "deepseek_v2" and d.get("norm_topk_prob"):
        raise ValueError("deepseek_v2: norm_topk_prob is not supported (transformers does not "
                         "renormalise V2's router weights, and no published V2 does)")
    experts, groups = d.get("n_routed_experts") or 0, d.get("n_group") or 1
    if experts and experts % groups:
        raise ValueError(f"{model_type}: {experts} routed experts do not split into n_group "
                         f"{groups} groups")


def yarn_defaults(d: dict, scaling: dict) -> dict:
    """Yarn's factor and original context as transformers fills them when a config.json
    leaves them out."""
    old = scaling.get("original_max_position_embeddings") or d.get(
        "original_max_position_embeddings") or d.get("max_position_embeddings", 2048)
    factor = scaling.get("factor") or d.get("max_position_embeddings", old) / old
    return {**scaling, "original_max_position_embeddings": old, "factor": factor}


def skip_mtp_layers(d: dict) -> None:
    """One log line: a V3 checkpoint's multi-token-prediction layers (layer num_hidden_layers
    and on) are not read (pipefill does not decode speculatively)."""
    mtp = d.get("num_nextn_predict_layers") or 0
    if mtp:
        log_skipped_mtp(mtp, f"model.layers.{d['num_hidden_layers']}")


def log_skipped_mtp(count: int, first: str) -> None:
    log.info("deepseek: skipping %d multi-token-prediction layer(s) (%s and on): pipefill "
             "does not decode speculatively", count, first)


def mla_config(d: dict, model_type: str, scaling: dict) -> MLAConfig:
    qk_head_dim = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    scale = qk_head_dim ** -0.5
    if scaling and scaling.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return MLAConfig(q_lora_rank=d.get("q_lora_rank") or None, kv_lora_rank=d["kv_lora_rank"],
                     qk_nope_head_dim=d["qk_nope_head_dim"],
                     qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
                     softmax_scale=scale,
                     # V2 always pairs its rotary dims (a complex product in transformers).
                     rope_interleaved=(model_type == "deepseek_v2"
                                       or d.get("rope_interleave", True)))


def moe_config(d: dict, model_type: str) -> MoEConfig | None:
    experts = d.get("n_routed_experts") or 0
    if not experts:
        return None
    layers, first_dense = d["num_hidden_layers"], d.get("first_k_dense_replace") or 0
    freq = d.get("moe_layer_freq") or 1
    v3 = model_type == "deepseek_v3"
    return MoEConfig(
        num_experts=experts, top_k=d["num_experts_per_tok"],
        expert_width=d["moe_intermediate_size"],
        normalize=v3 and bool(d.get("norm_topk_prob", True)),
        sparse_layers=tuple(i >= first_dense and i % freq == 0 for i in range(layers)),
        shared_width=d["moe_intermediate_size"] * (d.get("n_shared_experts") or 0),
        scoring="sigmoid" if v3 else "softmax",
        topk_method="noaux_tc" if v3 else d.get("topk_method") or "greedy",
        num_groups=d.get("n_group") or 1, topk_groups=d.get("topk_group") or 1,
        routed_scale=float(d.get("routed_scaling_factor") or 1.0))


DEEPSEEK = DeepSeekFamily()
