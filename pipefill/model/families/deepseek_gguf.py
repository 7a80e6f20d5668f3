"""DeepSeek-V2, V2-Lite and V3 from GGUF files as llama.cpp's converter writes them
(general.architecture "deepseek2"; ARCHITECTURE.md, 'Model families').

The file's metadata is read back into the config.json it was converted from (hf_config), so a
GGUF file and a Hugging Face folder share one reading and one set of refusals
(families/deepseek.py). What the format says, and how it maps back:

* tensors hold the checkpoint's weights unchanged: the converter permutes no rows (llama.cpp
  turns DeepSeek's rotary dims as adjacent pairs, the layout the checkpoints have), and it
  stacks a layer's experts into one tensor per projection (blk.N.ffn_{gate,up,down}_exps);
* kv_b_proj is kept whole (attn_kv_b, older files) or split per head for llama.cpp's absorbed
  attention: attn_k_b holds each head's key rows transposed ([heads, kv_lora_rank, nope]) and
  attn_v_b its value rows ([heads, v, kv_lora_rank]); such files describe llama.cpp's one-head
  view in attention.key_length/value_length and the heads in key_length_mla/value_length_mla;
* the router: expert_gating_func softmax (1; also when absent, as llama.cpp reads V2 files) is
  V2's, greedy, or group-limited where expert_group_used_count is below expert_group_count;
  sigmoid (2) with the correction bias exp_probs_b is V3's noaux_tc. The file does not name
  the method, so these are the readings; a gating function outside them is refused;
* yarn: rope.scaling.yarn_log_multiplier holds 0.1 x mscale_all_dim, and llama.cpp takes
  mscale equal to it (as the published configs have it): cos and sin unscaled, the softmax
  scale times mscale(factor, mscale_all_dim)^2;
* multi-token-prediction layers, where a file keeps them, are the last nextn_predict_layers
  of block_count (their blk.N.nextn.* tensors): not read (one log line, families/deepseek.py).
"""
from __future__ import annotations

import torch

from pipefill.model.config import ModelConfig
from pipefill.model.families.moe import GGUF_EXPERT_NAMES, gguf_width
from pipefill.model.gguf_file import gguf_expert_tensor, gguf_layer_name

GGUF_SOFTMAX, GGUF_SIGMOID = 1, 2  # llama.cpp's expert_gating_func values
# Hugging Face layer tensor names (after model.layers.{i}.) -> GGUF names (after blk.{i}.).
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    # kv_b_proj's halves, named as the converter names them before writing them.
    "self_attn.k_b_proj.weight": "attn_k_b.weight",
    "self_attn.v_b_proj.weight": "attn_v_b.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
# Every layer tensor (after blk.{i}.) of a model layer this family reads.
GGUF_KNOWN = set(GGUF_LAYER_NAMES.values()) | {GGUF_EXPERT_NAMES[p] for p in
                                                ("gate_proj", "up_proj", "down_proj")}
GGUF_STAGE_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight")


def where(gguf) -> str:
    return f"GGUF file {gguf.path} ({gguf.arch})"


def stored_tensor(hf_name: str) -> tuple[str, int | None]:
    """The GGUF tensor holding a Hugging Face tensor (an expert: its index in the stack)."""
    return (gguf_expert_tensor(hf_name, GGUF_EXPERT_NAMES)
            or (gguf_layer_name(hf_name, GGUF_LAYER_NAMES), None))


def splits_kv_b(gguf) -> bool:
    """Whether the file stores kv_b_proj as attn_k_b and attn_v_b (MLAConfig.kv_b_split)."""
    return gguf.has("blk.0.attn_k_b.weight")


def read_kv_b(read, prefix: str, mla) -> torch.Tensor:
    """kv_b_proj [heads * (nope + v), kv_lora_rank]: as stored, or joined back from the halves
    a GGUF file splits it into (k_b [heads, rank, nope] transposed back, then v_b [heads, v,
    rank]: each head's key rows, then its value rows)."""
    if not mla.kv_b_split:
        return read.mat(prefix + "kv_b_proj.weight")
    k_b, v_b = read.mat(prefix + "k_b_proj.weight"), read.mat(prefix + "v_b_proj.weight")
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, mla.kv_lora_rank)


def hf_config(gguf) -> tuple[dict, int]:
    """(the config.json a deepseek2 file was converted from, as families/deepseek.py reads it;
    the multi-token-prediction layers the file keeps after the model's)."""
    f = gguf.arch_field
    for key in ("block_count", "embedding_length", "attention.head_count",
                "attention.kv_lora_rank", "rope.dimension_count"):
        if f(key) is None:
            raise ValueError(f"{where(gguf)}: {gguf.arch}.{key} is missing")
    if not gguf.has("token_embd.weight"):
        raise ValueError(f"{where(gguf)}: tensor token_embd.weight is missing")
    mtp = mtp_layers(gguf)
    layers = f("block_count") - mtp
    nope, v = head_dims(gguf)
    scaling = rope_scaling(gguf)
    d = dict(num_hidden_layers=layers, hidden_size=f("embedding_length"),
             num_attention_heads=f("attention.head_count"),
             q_lora_rank=f("attention.q_lora_rank") or None,
             kv_lora_rank=f("attention.kv_lora_rank"), qk_nope_head_dim=nope,
             qk_rope_head_dim=f("rope.dimension_count"), v_head_dim=v,
             vocab_size=f("vocab_size") or gguf.shape("token_embd.weight")[0],
             rms_norm_eps=f("attention.layer_norm_rms_epsilon", 1e-6),
             rope_theta=float(f("rope.freq_base", 10000.0)), rope_scaling=scaling or None,
             max_position_embeddings=f("context_length", 2048),
             tie_word_embeddings=not gguf.has("output.weight"),
             bos_token_id=gguf.field("tokenizer.ggml.bos_token_id"),
             eos_token_id=gguf.field("tokenizer.ggml.eos_token_id"),
             **router_config(gguf, layers))
    d["intermediate_size"] = f("feed_forward_length") or dense_width(gguf, layers)
    return d, mtp


def mtp_layers(gguf) -> int:
    """The multi-token-prediction layers at the end of block_count: nextn_predict_layers, or
    where the file has blk.N.nextn.* tensors without it, the blocks from the first of them."""
    blocks = gguf.arch_field("block_count")
    holding = sorted({int(n.split(".")[1]) for n in gguf.tensors
                      if n.startswith("blk.") and ".nextn." in n})
    mtp = gguf.arch_field("nextn_predict_layers") or (blocks - holding[0] if holding else 0)
    if mtp >= blocks or holding and holding[0] < blocks - mtp:
        raise ValueError(f"{where(gguf)}: {mtp} multi-token-prediction layer(s) of {blocks} "
                         f"blocks, with nextn tensors in blocks {holding}: the file does not "
                         "fit its metadata")
    return mtp


def head_dims(gguf) -> tuple[int, int]:
    """(qk_nope_head_dim, v_head_dim): key_length_mla/value_length_mla, or in files that keep
    attn_kv_b whole and lack them, key_length/value_length (which then describe the heads)."""
    f = gguf.arch_field
    qk, v = f("attention.key_length_mla"), f("attention.value_length_mla")
    if (qk is None or v is None) and not splits_kv_b(gguf):
        qk, v = f("attention.key_length"), f("attention.value_length")
    if qk is None or v is None:
        raise ValueError(f"{where(gguf)}: the heads' key and value sizes are missing "
                         f"({gguf.arch}.attention.key_length_mla and value_length_mla)")
    return qk - f("rope.dimension_count"), v


def rope_scaling(gguf) -> dict:
    """Yarn in config.json's terms (see the module's docstring); other kinds as GGUFFile
    reads them."""
    f = gguf.arch_field
    if f("rope.scaling.type", "none") != "yarn":
        return gguf.rope_scaling()
    factor = f("rope.scaling.factor")
    if not factor:
        raise ValueError(f"{where(gguf)}: yarn rope scaling without rope.scaling.factor")
    log_mul = f("rope.scaling.yarn_log_multiplier") or 0.0
    mscale = log_mul / 0.1 if log_mul else 1.0
    return {"rope_type": "yarn", "factor": float(factor),
            "original_max_position_embeddings": (f("rope.scaling.original_context_length")
                                                 or f("context_length", 2048)),
            "beta_fast": float(f("rope.scaling.yarn_beta_fast") or 32.0),
            "beta_slow": float(f("rope.scaling.yarn_beta_slow") or 1.0),
            "mscale": mscale, "mscale_all_dim": mscale}


def router_config(gguf, layers: int) -> dict:
    """model_type and the config.json router keys the file's experts and gating say."""
    f = gguf.arch_field
    experts = f("expert_count") or 0
    if not experts:
        return {"model_type": "deepseek_v2"}
    gating = int(f("expert_gating_func") or GGUF_SOFTMAX)
    if gating not in (GGUF_SOFTMAX, GGUF_SIGMOID):
        raise ValueError(f"{where(gguf)}: expert gating function {gating} is not supported "
                         f"(pipefill runs softmax, {GGUF_SOFTMAX}, as DeepSeek-V2 routes, and "
                         f"sigmoid, {GGUF_SIGMOID}, with a correction bias, as DeepSeek-V3 does)")
    sigmoid = gating == GGUF_SIGMOID
    biased = any(n.endswith(".exp_probs_b.bias") for n in gguf.tensors)
    if sigmoid != biased:
        raise ValueError(f"{where(gguf)}: a {'sigmoid' if sigmoid else 'softmax'} router "
                         f"{'without' if sigmoid else 'with'} a correction bias "
                         "(blk.N.exp_probs_b.bias) is not supported (DeepSeek-V3's sigmoid "
                         "router has one, DeepSeek-V2's softmax router none)")
    used = f("expert_used_count")
    first = next((i for i in range(layers) if gguf.has(f"blk.{i}.ffn_gate_inp.weight")), None)
    if not used or first is None:
        raise ValueError(f"{where(gguf)}: a mixture-of-experts file needs "
                         f"{gguf.arch}.expert_used_count and a router "
                         "(blk.N.ffn_gate_inp.weight) in at least one layer")
    width = gguf_width(gguf, f"blk.{first}.ffn_gate_exps.weight",
                       "expert_feed_forward_length", dim=1)
    groups = f("expert_group_count") or 1
    searched = f("expert_group_used_count") or groups
    return dict(
        model_type="deepseek_v3" if sigmoid else "deepseek_v2",
        n_routed_experts=experts, num_experts_per_tok=used, moe_intermediate_size=width,
        n_shared_experts=f("expert_shared_count") or 0,
        first_k_dense_replace=f("leading_dense_block_count") or 0,
        n_group=groups, topk_group=searched,
        routed_scaling_factor=f("expert_weights_scale") or 1.0,
        norm_topk_prob=bool(f("expert_weights_norm", False)),
        scoring_func="sigmoid" if sigmoid else "softmax",
        topk_method=("noaux_tc" if sigmoid else
                     "group_limited_greedy" if searched < groups else "greedy"))


def dense_width(gguf, layers: int) -> int:
    """A dense layer's MLP width from its tensor, for files without feed_forward_length (0
    where every layer is sparse)."""
    return next((gguf.shape(f"blk.{i}.ffn_gate.weight")[0] for i in range(layers)
                 if gguf.has(f"blk.{i}.ffn_gate.weight")), 0)


def check_tensors(gguf, cfg: ModelConfig, family) -> None:
    """A sentence for a file the config would misread: a tensor outside the layout, one the
    model reads that is missing, a router where the metadata says dense (or none where it says
    sparse), or a matrix of another shape than the metadata gives."""
    refuse_unknown_tensors(gguf, cfg.num_layers)
    for i in range(cfg.num_layers):
        if gguf.has(f"blk.{i}.ffn_gate_inp.weight") and not cfg.is_sparse(i):
            raise ValueError(f"{where(gguf)}: blk.{i} has a router (ffn_gate_inp) but "
                             f"{gguf.arch}.leading_dense_block_count makes it dense")
    names = [family.embed_name, family.final_norm_name]
    names += [n for i in range(cfg.num_layers) for n in family.layer_tensor_names(cfg, i)]
    for name in names:
        stored = stored_tensor(name)[0]
        if not gguf.has(stored):
            raise ValueError(f"{where(gguf)}: tensor {stored} is missing ({cfg.model_type} "
                             f"reads it, as {name}, from what the file's metadata says)")
    for i in range(cfg.num_layers):
        for stored, shape in layer_shapes(cfg, i).items():
            if gguf.shape(stored) != shape:
                raise ValueError(f"{where(gguf)}: {stored} has shape "
                                 f"{list(gguf.shape(stored))}, but the metadata gives "
                                 f"{list(shape)}: the file does not fit its metadata")


def refuse_unknown_tensors(gguf, num_layers: int) -> None:
    """A sentence for a tensor of the model's layers (or the stage's) outside the DeepSeek
    layout: per-expert tensors of older converters, rope frequency factors, ... The
    multi-token-prediction layers after num_layers are not read, whatever they hold."""
    for name in gguf.tensors:
        if not name.startswith("blk."):
            known = name in GGUF_STAGE_TENSORS
        else:
            _, index, rest = name.split(".", 2)
            known = int(index) >= num_layers or rest in GGUF_KNOWN
        if not known:
            raise ValueError(
                f"{where(gguf)}: tensor {name} is not part of the DeepSeek layout pipefill "
                "reads (attn_q or attn_q_a, attn_q_a_norm and attn_q_b; attn_kv_a_mqa, "
                "attn_kv_a_norm, attn_kv_b or attn_k_b and attn_v_b, attn_output; "
                "ffn_{gate,up,down}, or ffn_gate_inp, exp_probs_b, ffn_{gate,up,down}_exps "
                "with all experts stacked and ffn_{gate,up,down}_shexp)")


def layer_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape (Hugging Face layout) of layer `layer`'s matrices under cfg."""
    mla, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    q_rows = heads * mla.qk_head_dim
    s = {"attn_kv_a_mqa": (mla.latent_dim, h), "attn_output": (h, heads * mla.v_head_dim)}
    if mla.q_lora_rank:
        s.update(attn_q_a=(mla.q_lora_rank, h), attn_q_b=(q_rows, mla.q_lora_rank))
    else:
        s["attn_q"] = (q_rows, h)
    if mla.kv_b_split:
        s.update(attn_k_b=(heads, mla.kv_lora_rank, mla.qk_nope_head_dim),
                 attn_v_b=(heads, mla.v_head_dim, mla.kv_lora_rank))
    else:
        s["attn_kv_b"] = (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
    if cfg.is_sparse(layer):
        moe = cfg.moe
        e, w, shared = moe.num_experts, moe.expert_width, moe.shared_width
        s.update(ffn_gate_inp=(e, h), ffn_gate_exps=(e, w, h), ffn_up_exps=(e, w, h),
                 ffn_down_exps=(e, h, w))
        if shared:
            s.update(ffn_gate_shexp=(shared, h), ffn_up_shexp=(shared, h),
                     ffn_down_shexp=(h, shared))
    else:
        width = cfg.intermediate_size
        s.update(ffn_gate=(width, h), ffn_up=(width, h), ffn_down=(h, width))
    return {f"blk.{layer}.{name}.weight": shape for name, shape in s.items()}
