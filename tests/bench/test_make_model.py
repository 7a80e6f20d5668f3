"""`pipefill bench make-model`: the checkpoint it writes has the tensor names and shapes that
transformers' save_pretrained writes for the same config (the published layout, one tensor per
expert), loads into HF transformers with no missing or unexpected weight, and is the same bytes
for the same seed."""
import json
import subprocess
import sys

import pytest
import torch

from pipefill.bench.make_model import (LIKE, checkpoint_shapes, layers_that_fit, make_config,
                                       nbytes, write_checkpoint)

# Tiny configs of every family make-model knows, with the structure that matters: a dense layer
# among sparse ones, shared experts, expert counts that are not powers of two, latent attention
# with and without a query low-rank projection.
TINY = {
    "Qwen3MoeConfig": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_experts=5, num_experts_per_tok=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, vocab_size=64,
                           num_hidden_layers=3, mlp_only_layers=[1]),
    "Qwen2MoeConfig": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_experts=3, num_experts_per_tok=2,
                           shared_expert_intermediate_size=24, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=64, num_hidden_layers=3,
                           decoder_sparse_step=2),
    "MixtralConfig": dict(hidden_size=32, intermediate_size=24, num_local_experts=3,
                          num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=64, num_hidden_layers=2),
    "DeepseekV2Config": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                             n_routed_experts=5, num_experts_per_tok=2, n_shared_experts=2,
                             first_k_dense_replace=1, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                             vocab_size=64, num_hidden_layers=3),
    "DeepseekV3Config": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                             n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
                             first_k_dense_replace=1, n_group=2, topk_group=1,
                             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                             v_head_dim=8, vocab_size=64, num_hidden_layers=3),
    "LlamaConfig": dict(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64, num_hidden_layers=2),
}


def tiny(cls_name: str):
    import transformers
    return getattr(transformers, cls_name)(**TINY[cls_name], tie_word_embeddings=False)


def saved_shapes(folder) -> dict:
    from safetensors import safe_open
    index = folder / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() \
        else {"model.safetensors"}
    out = {}
    for file in files:
        with safe_open(str(folder / file), "pt") as f:
            out.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return out


def test_every_like_has_a_tiny_twin():
    assert {cls for cls, _ in LIKE.values()} <= set(TINY)


@pytest.mark.parametrize("cls_name", sorted(TINY))
def test_names_and_shapes_are_what_transformers_saves(cls_name, tmp_path):
    from transformers import AutoModelForCausalLM
    config = tiny(cls_name)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "hf"))
    assert checkpoint_shapes(config) == saved_shapes(tmp_path / "hf")


@pytest.mark.parametrize("cls_name", sorted(TINY))
def test_transformers_loads_it_whole(cls_name, tmp_path):
    from transformers import AutoModelForCausalLM
    config = tiny(cls_name)
    write_checkpoint(config, tmp_path / "ours", torch.float32, seed=3)
    model, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ours"), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["architectures"] == [cls_name.replace("Config", "ForCausalLM")]
    # The weights arrived as written (std 0.02, norms 1), not re-initialised by HF.
    state = model.state_dict()
    assert 0.01 < state["model.layers.0.self_attn.o_proj.weight"].std().item() < 0.03
    assert torch.equal(state["model.norm.weight"], torch.ones(config.hidden_size))
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


def test_same_seed_same_bytes_and_shards_with_an_index(tmp_path, monkeypatch):
    import pipefill.bench.make_model as mm
    monkeypatch.setattr(mm, "SHARD_BYTES", 20_000)  # several shards from a tiny model
    config = tiny("Qwen3MoeConfig")
    for out in ("a", "b"):
        write_checkpoint(config, tmp_path / out, torch.bfloat16, seed=7)
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and set(index["weight_map"]) == set(checkpoint_shapes(config))
    assert index["metadata"]["total_size"] == nbytes(checkpoint_shapes(config), torch.bfloat16)
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


def test_real_shapes_and_the_layers_that_fit():
    c = make_config("qwen3-30b-a3b", layers=2)
    shapes = checkpoint_shapes(c)
    assert shapes["model.layers.1.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32 * 128, 2048)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (4 * 128, 2048)
    per_layer = (nbytes(checkpoint_shapes(make_config("qwen3-30b-a3b", 3)), torch.bfloat16)
                 - nbytes(shapes, torch.bfloat16))
    fixed = nbytes(checkpoint_shapes(make_config("qwen3-30b-a3b", 0)), torch.bfloat16)
    assert layers_that_fit("qwen3-30b-a3b", torch.bfloat16, fixed + 5 * per_layer + 1) == 5
    assert layers_that_fit("qwen3-30b-a3b", torch.bfloat16, 10**15) == 48


def test_cli_refuses_a_bad_layer_count_with_a_sentence(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pipefill.cli.main", "bench", "make-model",
                          "--like", "mixtral-8x7b", "--layers", "33", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "between 1 and 32" in out.stderr
    assert "Traceback" not in out.stderr


def test_fp8_variant_has_the_releases_layout(tmp_path):
    """--fp8: every decoder projection (attention, dense MLP, experts, shared experts) as e4m3
    codes with its 128 x 128 block scales, routers, norms, embedding and head in --dtype,
    config.json's quantization_config as DeepSeek-V3's; pipefill reads it back as the draws
    within e4m3's half ulp of each block's largest weight."""
    from safetensors import safe_open
    from pipefill.kernels.fp8_blocks import QUANT_CONFIG, grid_shape
    from pipefill.model.loader import WeightSource
    config = tiny("DeepseekV3Config")
    write_checkpoint(config, tmp_path / "fp8", torch.bfloat16, seed=3, fp8=True)
    write_checkpoint(config, tmp_path / "f32", torch.float32, seed=3)
    shapes = checkpoint_shapes(config)
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())[
        "quantization_config"] == QUANT_CONFIG
    with safe_open(str(tmp_path / "fp8" / "model-00001-of-00001.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    quantized = {k for k in shapes if k.endswith(("_proj.weight", "_proj_with_mqa.weight"))
                 and k.startswith("model.layers")}
    assert set(stored) == set(shapes) | {k + "_scale_inv" for k in quantized}
    assert "model.layers.1.mlp.experts.5.down_proj.weight" in quantized
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in quantized
    assert "model.layers.2.self_attn.kv_a_proj_with_mqa.weight" in quantized
    for k in quantized:
        assert stored[k].dtype == torch.float8_e4m3fn
        assert stored[k + "_scale_inv"].shape == grid_shape(*shapes[k])
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    name = "model.layers.0.self_attn.q_b_proj.weight"
    source, draws = WeightSource(str(tmp_path / "fp8")), WeightSource(str(tmp_path / "f32"))
    assert source.fp8 and not draws.fp8
    got, want = source.load(name), draws.load(name)
    assert (got - want).abs().max() <= 2.0 ** -4 * want.abs().max()
