"""DeepSeek-V2 and V3 from GGUF files written the way llama.cpp's converter writes them
("deepseek2": names from the gguf package's own tensor map, a layer's experts stacked per
projection, kv_b_proj split into attn_k_b (transposed) and attn_v_b, the MQA view in
key_length/value_length and the heads' sizes in key_length_mla/value_length_mla, yarn's
mscale_all_dim as 0.1 x in yarn_log_multiplier) load to the same model as their safetensors:
the same config, logits within 1e-5 in float32 for F32 and Q8_0 files (against safetensors
holding the same rounded values), HF transformers' greedy tokens and logprobs from an engine
and from `pipefill generate` at PP 2. A tiny V2 (no q LoRA, softmax greedy routing, two shared
experts) and a tiny V3 (q LoRA, noaux_tc sigmoid routing in 2 groups of which 1 is searched,
a correction bias, a dense first layer, yarn). Older files (attn_kv_b whole), multi-token-
prediction layers (skipped with one log line), --weight-dtype gguf, and refusals with a
sentence: an unknown gating function, a missing tensor, a router the family would misread."""
import json
import logging
import os
import subprocess
import sys
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_matches_hf, hf_reference, shared_layout_bytes, single_stage, track
from pipefill import Engine
from pipefill.kernels import huge_pages
from pipefill.kernels.quant_gemm import QuantLinear
from pipefill.model.config import hf_rope
from pipefill.model.loader import WeightSource
from test_deepseek import PROMPT, save_deepseek
from test_moe_gguf import gguf_and_reference, gguf_tensors, prompt_logits, write_tensors

PAGE = 16
# Widths of 64 and 32 where Q8_0's 32-weight blocks should quantize a matrix (hidden, the
# experts, q LoRA); the latent and head sizes odd or off the blocks, so those stay F32.
MODELS = {
    "v3": ("DeepseekV3Config", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=32,
        kv_lora_rank=21, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=14,
        n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True,
        # a GGUF file states one mscale (llama.cpp takes mscale = mscale_all_dim)
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.8})),
    "v2": ("DeepseekV2Config", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
        kv_lora_rank=18, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=10,
        n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
        topk_method="greedy", routed_scaling_factor=1.5)),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    return {k: save_deepseek(k, tmp_path_factory.mktemp(k), models=MODELS) for k in MODELS}


def converter_tensors(hf: dict, cfg: dict, split: bool) -> dict[str, torch.Tensor]:
    """What llama.cpp's converter does to a DeepSeek state dict before naming: the correction
    bias renamed to a .bias, kv_b_proj split per head into k_b (transposed) and v_b."""
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    out = {}
    for name, t in hf.items():
        if name.endswith("e_score_correction_bias"):
            out[name.replace("e_score_correction_bias", "e_score_correction.bias")] = t
        elif name.endswith("kv_b_proj.weight") and split:
            k_b, v_b = t.view(heads, nope + v, -1).split([nope, v], dim=1)
            out[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2).contiguous()
            out[name.replace("kv_b_proj", "v_b_proj")] = v_b.contiguous()
        else:
            out[name] = t
    return out


def add_metadata(w, cfg: dict, split: bool, mtp: int) -> None:
    """The deepseek2 keys as the converter writes them (a V2 file leaves the gating function
    out, as older converters did: llama.cpp then reads softmax)."""
    theta, scaling = hf_rope(cfg)
    rank, rope, v = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qk = cfg["qk_nope_head_dim"] + rope
    w.add_block_count(cfg["num_hidden_layers"] + mtp)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1 if split else cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(theta)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if split:  # llama.cpp's MQA view of the latent, then the heads
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(qk)
        w.add_value_length_mla(v)
    else:
        w.add_key_length(qk)
        w.add_value_length(v)
    w.add_rope_dimension_count(rope)
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg["model_type"] == "deepseek_v3":
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    if scaling.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
        w.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
    if mtp:
        w.add_nextn_predict_layers(mtp)
    # a byte-level BPE vocabulary, for the engine's tokenizer
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"] + [f"w{i}" for i in range(3, cfg["vocab_size"])])
    w.add_token_merges(["a b"])
    for key in ("bos_token_id", "eos_token_id"):
        if cfg.get(key) is not None:
            getattr(w, f"add_{key}")(cfg[key])


def write_deepseek_gguf(hf_path: str, out_path, qtype: str = "F32", split: bool = True,
                        fields: dict | None = None, config: dict | None = None,
                        drop: tuple[str, ...] = (), extra: dict | None = None,
                        mtp: int = 0) -> dict[str, torch.Tensor]:
    """A deepseek2 GGUF of the HF folder's weights (fields: more deepseek2.* uint32 keys;
    config: config values changed for the metadata only; drop: GGUF tensors left out; extra:
    tensors added as they are; mtp: that many more blocks, stated by nextn_predict_layers).
    Returns the HF state dict as the file holds it."""
    cfg, hf = load_folder(hf_path)
    w = gguf.GGUFWriter(str(out_path), "deepseek2")
    add_metadata(w, {**cfg, **(config or {})}, split, mtp)
    for key, value in (fields or {}).items():
        w.add_uint32(f"deepseek2.{key}", value)
    tensors = {n: t for n, t in file_tensors(cfg, hf, split).items() if n not in drop}
    return write_tensors(w, hf, tensors, qtype, extra)


def load_folder(hf_path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    with open(os.path.join(hf_path, "config.json")) as f:
        return json.load(f), load_file(os.path.join(hf_path, "model.safetensors"))


def file_tensors(cfg: dict, hf: dict, split: bool = True) -> dict[str, torch.Tensor]:
    """GGUF name -> tensor, as the converter writes the state dict."""
    return gguf_tensors(converter_tensors(hf, cfg, split), cfg, "deepseek2")


FLOAT32_HELD = ("mscale", "mscale_all_dim")  # 0.1 x mscale_all_dim, in float32


def assert_same_config(a, b):
    """Equal configs, but for the layout flag and the values a GGUF file holds in float32
    (the yarn mscales, so the softmax scale, and the norms' epsilon)."""
    assert a.mla.kv_b_split and not b.mla.kv_b_split
    assert a.mla.softmax_scale == pytest.approx(b.mla.softmax_scale, rel=1e-6)
    assert replace(a.mla, kv_b_split=False, softmax_scale=0) == replace(b.mla, softmax_scale=0)
    assert a.moe == b.moe
    for key in FLOAT32_HELD:
        if key in b.rope_scaling:
            assert a.rope_scaling[key] == pytest.approx(b.rope_scaling[key], rel=1e-6)
    assert ({k: v for k, v in a.rope_scaling.items() if k not in FLOAT32_HELD}
            == {k: v for k, v in b.rope_scaling.items() if k not in FLOAT32_HELD})
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-6)
    plain = dict(mla=None, rope_scaling={}, rms_norm_eps=0.0)
    assert replace(a, **plain) == replace(b, **plain)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("kind", MODELS)
def test_gguf_equals_safetensors(kind, qtype, hf_models, tmp_path):
    path, reference = gguf_and_reference(write_deepseek_gguf, hf_models[kind], tmp_path, qtype)
    if qtype != "F32":  # the file quantized some matrices
        held, given = load_folder(reference)[1], load_folder(hf_models[kind])[1]
        assert sum(not torch.equal(held[n], t) for n, t in given.items()) > 5
    from_gguf, from_hf = WeightSource(path), WeightSource(reference)
    assert from_gguf.family is from_hf.family and from_gguf.family.name == "deepseek"
    assert_same_config(from_gguf.config, from_hf.config)
    ours, want = prompt_logits(path, PROMPT[:40]), prompt_logits(reference, PROMPT[:40])
    assert (ours - want).abs().max().item() < 1e-5


def test_the_router_and_attention_read_from_the_metadata(hf_models, tmp_path):
    path = str(tmp_path / "m.gguf")
    write_deepseek_gguf(hf_models["v3"], path)
    cfg = WeightSource(path).config
    assert cfg.model_type == "deepseek_v3" and cfg.num_layers == 3
    assert (cfg.moe.scoring, cfg.moe.topk_method, cfg.moe.num_groups, cfg.moe.topk_groups,
            cfg.moe.routed_scale, cfg.moe.normalize) == ("sigmoid", "noaux_tc", 2, 1, 2.5, True)
    assert cfg.moe.sparse_layers == (False, True, True) and cfg.moe.shared_width == 32
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.qk_nope_head_dim,
            cfg.mla.v_head_dim, cfg.mla.latent_dim) == (32, 21, 10, 14, 27)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 4.0
    path = str(tmp_path / "v2.gguf")
    write_deepseek_gguf(hf_models["v2"], path)
    cfg = WeightSource(path).config
    assert cfg.model_type == "deepseek_v2" and cfg.mla.q_lora_rank is None
    assert (cfg.moe.scoring, cfg.moe.topk_method, cfg.moe.routed_scale,
            cfg.moe.normalize, cfg.moe.shared_width) == ("softmax", "greedy", 1.5, False, 64)


def test_an_older_file_with_kv_b_whole(hf_models, tmp_path):
    """Files from converters before the split keep attn_kv_b, and their key_length and
    value_length are the heads' sizes."""
    path = str(tmp_path / "m.gguf")
    write_deepseek_gguf(hf_models["v2"], path, split=False)
    cfg = WeightSource(path).config
    assert not cfg.mla.kv_b_split and (cfg.mla.qk_nope_head_dim, cfg.mla.v_head_dim) == (12, 10)
    ours, want = prompt_logits(path, PROMPT[:40]), prompt_logits(hf_models["v2"], PROMPT[:40])
    assert (ours - want).abs().max().item() < 1e-5


def test_multi_token_prediction_layers_are_skipped_with_one_log_line(hf_models, tmp_path,
                                                                       caplog):
    """A file keeping V3's MTP layer (a whole layer's tensors plus blk.N.nextn.*, stated by
    nextn_predict_layers) loads as the file without it."""
    cfg, hf = load_folder(hf_models["v3"])
    extra = {n.replace("blk.2.", "blk.3."): t.numpy()
             for n, t in file_tensors(cfg, hf).items() if n.startswith("blk.2.")}
    extra["blk.3.nextn.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    extra["blk.3.nextn.enorm.weight"] = np.ones(64, np.float32)
    path = str(tmp_path / "m.gguf")
    write_deepseek_gguf(hf_models["v3"], path, extra=extra, mtp=1)
    with caplog.at_level(logging.INFO, logger="pipefill.model.families.deepseek"):
        cfg = WeightSource(path).config
    assert cfg.num_layers == 3
    assert [r.getMessage() for r in caplog.records if "multi-token" in r.getMessage()] == [
        "deepseek: skipping 1 multi-token-prediction layer(s) (blk.3 and on): pipefill does "
        "not decode speculatively"]
    ours = prompt_logits(path, PROMPT[:40])
    assert (ours - prompt_logits(hf_models["v3"], PROMPT[:40])).abs().max().item() < 1e-5


def quant_linears(obj, found: dict | None = None, depth: int = 0) -> list:
    """The distinct QuantLinears reachable from a stage's weights."""
    found = {} if found is None else found
    if isinstance(obj, QuantLinear):
        found[id(obj)] = obj
    elif isinstance(obj, dict) and depth < 6:
        for child in obj.values():
            quant_linears(child, found, depth + 1)
    elif isinstance(obj, (list, tuple)) and depth < 6:
        for child in obj:
            quant_linears(child, found, depth + 1)
    elif type(obj).__module__.startswith("pipefill.") and depth < 6:
        for child in vars(obj).values():
            quant_linears(child, found, depth + 1)
    return list(found.values())


def test_weight_dtype_gguf_keeps_the_blocks(hf_models, tmp_path):
    """--weight-dtype gguf: the Q8_0 linear layers stay in their blocks, the rope rows
    reordered whole (q_proj and kv_a_proj_with_mqa in one layer) before their decode layout
    is written (a layout of the file's order, dropped, kept its bytes in a shared mapping),
    and give the logits of the dequantized file (prefill dequantizes per call:
    --gguf-int8-prefill-max-rows 0, as the integer path's rounding of the activations is
    bounded in test_gguf_blocks.py)."""
    path, reference = gguf_and_reference(write_deepseek_gguf, hf_models["v2"], tmp_path, "Q8_0")
    before = huge_pages.shared_bytes()
    weights = single_stage(path, "float32", weight_dtype="gguf").model.w
    assert huge_pages.shared_bytes() - before == shared_layout_bytes(quant_linears(weights)) > 0
    layer = weights.layers[1]
    assert layer.qkv_a is None and layer.packed["qkv_a"].types == "Q8_0"
    ours = prompt_logits(path, PROMPT[:40], weight_dtype="gguf", gguf_int8_prefill_max_rows=0)
    assert (ours - prompt_logits(reference, PROMPT[:40])).abs().max().item() < 1e-4


def test_an_engine_on_the_gguf_matches_hf(hf_models, tmp_path):
    """The V3 file in an engine, prefill in chunks of 37: HF transformers' prompt logprobs
    (1e-4) and 16 greedy tokens on the same weights."""
    path = str(tmp_path / "m.gguf")
    write_deepseek_gguf(hf_models["v3"], path)
    ref = hf_reference(hf_models["v3"], PROMPT, 16, full_forwards=True)
    with track(Engine(path, dtype="float32", page_size=PAGE, chunked_prefill_size=37,
                      threads_per_stage=1)) as engine:
        assert_matches_hf(engine, PROMPT, ref, 37)


@pytest.mark.slow  # ~40 s: two stage processes after a CLI start, and HF's reference
def test_pipefill_generate_pp2_on_the_gguf(hf_models, tmp_path):
    """`pipefill generate` on the V2 file split over two stages: HF transformers' greedy
    tokens for the same prompt ids."""
    path = str(tmp_path / "m.gguf")
    write_deepseek_gguf(hf_models["v2"], path)
    out = tmp_path / "out.json"
    run = subprocess.run(
        [sys.executable, "-m", "pipefill.cli.main", "generate", "--model-path", path,
         "--dtype", "float32", "--pp-size", "2", "--input-len", "50", "--seed", "3",
         "--max-new-tokens", "12", "--chunked-prefill-size", "32", "--page-size", "16",
         "--threads-per-stage", "1", "--output-json", str(out)],
        capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    got = json.loads(out.read_text())
    _, tokens = hf_reference(hf_models["v2"], got["prompt_ids"], 12, full_forwards=True)
    assert got["output_ids"] == tokens[:len(got["output_ids"])]
    assert len(got["output_ids"]) == 12 or got["finish_reason"] == "stop"


REFUSALS = [
    ("v2", dict(fields={"expert_gating_func": 3}),
     r"expert gating function 3 is not supported \(pipefill runs softmax, 1, as DeepSeek-V2 "
     r"routes, and sigmoid, 2, with a correction bias, as DeepSeek-V3 does\)"),
    ("v2", dict(drop=("blk.1.attn_kv_a_mqa.weight",)),
     r"tensor blk.1.attn_kv_a_mqa.weight is missing \(deepseek_v2 reads it"),
    ("v3", dict(drop=("blk.2.exp_probs_b.bias",)), "tensor blk.2.exp_probs_b.bias is missing"),
    ("v3", dict(drop=("blk.1.exp_probs_b.bias", "blk.2.exp_probs_b.bias")),
     r"a sigmoid router without a correction bias \(blk.N.exp_probs_b.bias\) is not supported"),
    ("v2", dict(extra={"blk.1.ffn_gate.0.weight": np.zeros((32, 64), np.float32)}),
     "tensor blk.1.ffn_gate.0.weight is not part of the DeepSeek layout pipefill reads"),
    ("v2", dict(config={"first_k_dense_replace": 2}),
     "blk.1 has a router .* but deepseek2.leading_dense_block_count makes it dense"),
    ("v2", dict(fields={"expert_group_count": 4}),
     "6 routed experts do not split into n_group 4 groups"),
]


@pytest.mark.parametrize("kind,change,sentence", REFUSALS)
def test_a_file_pipefill_would_misread_is_refused_with_a_sentence(kind, change, sentence,
                                                                   hf_models, tmp_path):
    path = str(tmp_path / "m.gguf")
    write_deepseek_gguf(hf_models[kind], path, **change)
    with pytest.raises(ValueError, match=sentence):
        WeightSource(path)
