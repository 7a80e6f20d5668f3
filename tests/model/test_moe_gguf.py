"""Mixture-of-experts models from GGUF: the tiny random Qwen3-MoE (a dense layer among sparse
ones), Qwen2-MoE (a gated shared expert) and Mixtral (a "llama" file with experts) written the
way llama.cpp's converter writes them — the experts of a layer stacked into one tensor per
projection, names from the gguf package's own tensor map, Mixtral's q/k rows interleaved —
load to the same model as their safetensors: logits identical in float32, for F32 files and for
Q8_0 ones (against safetensors holding the same rounded values). A file naming a router or
expert layout pipefill does not read is refused with a sentence."""
import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import single_stage
from pipefill.base.plan import SeqWork, StepPlan
from pipefill.model.config import hf_rope
from pipefill.model.loader import WeightSource
from pipefill.runtime.executor import build_meta
from test_moe_family import MOE, PROMPT, save_moe

PAGE = 16
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    return {k: save_moe(k, tmp_path_factory.mktemp(k)) for k in MOE}


def interleave_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The llama.cpp converter's q/k row order for the llama architecture (each head's two
    rotary halves interleaved)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def gguf_tensors(hf: dict, cfg: dict, arch: str) -> dict[str, torch.Tensor]:
    """GGUF name -> tensor: each layer's experts stacked per projection as the converter does,
    names from the gguf package's tensor map (the dense map for a dense layer's MLP, which the
    MoE architectures' maps leave out)."""
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    layers = cfg["num_hidden_layers"]
    maps = [gguf.get_tensor_name_map(arch_id, layers),
            gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, layers)]
    merged, experts = {}, {}
    for name, t in hf.items():
        parts = name.split(".")
        if len(parts) == 8 and parts[4] == "experts":  # ...experts.{e}.{proj}.weight
            key = ".".join(parts[:5] + parts[6:])
            experts.setdefault(key, {})[int(parts[5])] = t
        else:
            merged[name] = t
    for key, by_expert in experts.items():
        merged[key] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    out = {}
    for name, t in merged.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            t = interleave_rotary(t, heads)
        gguf_name = next(n for m in maps
                         if (n := m.get_name(name, try_suffixes=(".weight", ".bias"))))
        out[gguf_name] = t
    return out


def quantizable(name: str, t: torch.Tensor) -> bool:
    return t.dim() >= 2 and "norm" not in name and t.shape[-1] % 32 == 0


def write_gguf(hf_path: str, out_path, qtype: str = "F32", fields: dict | None = None,
               extra: dict | None = None) -> dict[str, torch.Tensor]:
    """A GGUF of the HF folder's weights; qtype Q8_0 quantizes the matrices whose rows fit its
    blocks. Returns the HF state dict as the file holds it (quantized tensors rounded)."""
    with open(os.path.join(hf_path, "config.json")) as f:
        cfg = json.load(f)
    hf = load_file(os.path.join(hf_path, "model.safetensors"))
    kind = cfg["model_type"]
    arch = ARCH[kind]
    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(hf_rope(cfg)[0])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if kind != "mixtral":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if kind == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    for key, value in (fields or {}).items():
        getattr(w, f"add_{key}")(value)
    return write_tensors(w, hf, gguf_tensors(hf, cfg, arch), qtype, extra)


def write_tensors(w, hf: dict, tensors: dict, qtype: str = "F32",
                  extra: dict | None = None) -> dict[str, torch.Tensor]:
    """Writes `tensors` (GGUF name -> tensor; Q8_0 where quantizable), then `extra` as they
    are, and closes the file. Returns `hf` (the HF state dict the tensors came from) as the
    file holds it: the quantizable tensors rounded."""
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    rounded = dict(hf)
    for name, t in tensors.items():
        if qtype != "F32" and quantizable(name, t):
            q = gguf.quants.quantize(t.numpy(), qt)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
        else:
            w.add_tensor(name, t.contiguous().numpy())
    for name, t in (extra or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if qtype != "F32":
        for name, t in hf.items():
            if quantizable(name, t):
                q = gguf.quants.quantize(t.numpy(), qt)
                rounded[name] = torch.from_numpy(gguf.quants.dequantize(q, qt).copy())
    return rounded


def gguf_and_reference(write, hf_path: str, tmp_path, qtype: str) -> tuple[str, str]:
    """(a GGUF file `write` makes of the HF folder in qtype, the folder it should equal: for a
    quantized file, a copy of the HF folder holding the values the file decodes to)."""
    path = str(tmp_path / "m.gguf")
    rounded = write(hf_path, path, qtype)
    if qtype == "F32":
        return path, hf_path
    reference = tmp_path / "rounded"
    os.makedirs(reference)
    shutil.copy(os.path.join(hf_path, "config.json"), reference)
    save_file(rounded, os.path.join(reference, "model.safetensors"))
    return path, str(reference)


def prompt_logits(path: str, ids: list[int] = PROMPT[:40], **kw) -> torch.Tensor:
    """Every prompt row's logits from the engine's stage code holding all layers (kw: more
    ServerArgs)."""
    ex = single_stage(path, "float32", page_size=PAGE, **kw)
    plan = StepPlan(-1, [SeqWork("p", 0, len(ids), ids, [0, 1, 2], None)])
    meta = build_meta(plan, PAGE, torch.device("cpu"))
    with torch.no_grad():
        h, r = ex.model.forward(ex.model.embed(torch.tensor(ids)), None, meta, ex.cache.k,
                                ex.cache.v)
        return ex.model.logits(h, r, torch.arange(len(ids)))


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("kind", MOE)
def test_gguf_equals_safetensors(kind, qtype, hf_moe, tmp_path):
    path, reference = gguf_and_reference(write_gguf, hf_moe[kind], tmp_path, qtype)
    from_gguf, from_hf = WeightSource(path), WeightSource(reference)
    assert from_gguf.family is from_hf.family
    assert from_gguf.config.moe == from_hf.config.moe
    assert torch.equal(prompt_logits(path), prompt_logits(reference))


def test_gguf_layers_without_a_router_stay_dense(hf_moe, tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(hf_moe["qwen3_moe"], path)
    cfg = WeightSource(path).config
    assert cfg.model_type == "qwen3_moe" and cfg.moe.sparse_layers == (True, False, True, True)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_width) == (5, 2, 32)
    assert cfg.intermediate_size == 96 and cfg.moe.normalize


@pytest.mark.parametrize("fields,extra,match", [
    ({"expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID}, {}, "expert gating function 2 is not supported"),
    ({"expert_weights_scale": 2.5}, {}, "expert weights scaled by 2.5 are not supported"),
    # a router bias (DeepSeek-style selection) and per-expert tensors of older converters
    ({}, {"blk.0.exp_probs_b.bias": np.zeros(7, np.float32)},
     "tensor blk.0.exp_probs_b.bias names a router or expert layout pipefill does not read"),
    ({}, {"blk.0.ffn_gate.0.weight": np.zeros((32, 64), np.float32)},
     "tensor blk.0.ffn_gate.0.weight names a router or expert layout"),
])
def test_an_unknown_gguf_expert_layout_is_refused_with_a_sentence(fields, extra, match, hf_moe,
                                                                  tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(hf_moe["qwen2_moe"], path, fields=fields, extra=extra)
    with pytest.raises(ValueError, match=match):
        WeightSource(path)


def test_a_dense_llama_gguf_stays_with_the_llama_family():
    from pipefill.model.families import family_for_gguf
    assert family_for_gguf("llama", "m.gguf").name == "llama"
    assert family_for_gguf("llama", "m.gguf", experts=True).name == "moe"
    assert family_for_gguf("qwen3moe", "m.gguf", experts=True).name == "moe"
