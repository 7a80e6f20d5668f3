"""The mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) against HF transformers on
the same random weights (float32): prompt logprobs within 1e-4 and 16 greedy tokens identical,
with odd shapes (expert counts that are not powers of two, top-k 1 to 3, a dense layer among
sparse ones, a shared expert), chunked prefill, pipelines of 1 to 3 stages with uneven
partitions, and a prefix-cache hit; an unknown router is refused with a sentence."""
import json
import random

import pytest
import torch

from conftest import assert_matches_hf, assert_prefix_hit_matches, hf_reference, track
from pipefill import Engine
from pipefill.model.families import family_for_hf_config

PAGE = 16
_rng = random.Random(11)
PROMPT = [_rng.randrange(512) for _ in range(90)]

COMMON = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=1024, num_hidden_layers=4)
MOE = {
    # a dense layer (1) among sparse ones, 5 experts, top-2, renormalised
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=5, num_experts_per_tok=2,
                                         norm_topk_prob=True, moe_intermediate_size=32,
                                         intermediate_size=96, mlp_only_layers=[1])),
    # every second layer sparse, a gated shared expert, top-3 of 7, not renormalised
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=7, num_experts_per_tok=3,
                                         norm_topk_prob=False, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48,
                                         intermediate_size=96, decoder_sparse_step=2)),
    # 3 experts, top-1
    "mixtral": ("MixtralConfig", dict(num_local_experts=3, num_experts_per_tok=1,
                                      intermediate_size=48, sliding_window=None)),
}


def save_moe(kind: str, path, configs=MOE, common=COMMON, seed: int = 1, **overrides) -> str:
    import transformers
    from transformers import AutoModelForCausalLM
    cls, kw = configs[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, cls)(**{**common, **kw, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name
                    else 0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    paths = {k: save_moe(k, tmp_path_factory.mktemp(k)) for k in MOE}
    # Greedy tokens from HF full forwards: HF's generate (KV cache) parts from its own full
    # forward on the tiny Qwen3-MoE at token 4; pipefill agrees with the full forward.
    return {k: (p, hf_reference(p, PROMPT, 16, full_forwards=True)) for k, p in paths.items()}


def check(engine, ref, chunk=None, prompt=PROMPT):
    """The engine's 16 greedy tokens and prompt logprobs against HF's (ref); chunk: every
    chunk that size."""
    return assert_matches_hf(engine, prompt, ref, chunk)


@pytest.mark.parametrize("kind", MOE)
@pytest.mark.parametrize("chunk", [PAGE, 37, 256])
def test_one_stage_matches_hf(kind, chunk, moe_models):
    path, ref = moe_models[kind]
    with track(Engine(path, dtype="float32", page_size=PAGE, chunked_prefill_size=chunk,
                      threads_per_stage=1)) as engine:
        check(engine, ref, chunk)
        assert_prefix_hit_matches(engine, PROMPT, ref[1], PAGE)


@pytest.mark.parametrize("kind,pp,partition", [
    pytest.param("qwen3_moe", 2, "1,3", marks=pytest.mark.slow), ("qwen2_moe", 3, "2,1,1"),
    pytest.param("mixtral", 3, None, marks=pytest.mark.slow)])
def test_pipeline_matches_hf(kind, pp, partition, moe_models):
    path, ref = moe_models[kind]
    kw = {"pp_layer_partition": partition} if partition else {}
    with track(Engine(path, dtype="float32", page_size=PAGE, chunked_prefill_size=32,
                      pp_size=pp, threads_per_stage=1, **kw)) as engine:
        check(engine, ref, 32)


def test_an_unknown_router_is_refused_with_a_sentence(moe_models):
    path, _ = moe_models["qwen3_moe"]
    with open(f"{path}/config.json") as f:
        d = json.load(f)
    family = family_for_hf_config(d)
    assert family.name == "moe"
    with pytest.raises(ValueError, match="router scoring 'sigmoid' is not supported"):
        family.config_from_hf({**d, "scoring_func": "sigmoid"})
    cfg = family.config_from_hf(d)
    assert cfg.moe.sparse_layers == (True, False, True, True) and cfg.moe.top_k == 2


def test_experts_fused_in_one_tensor_are_refused_with_a_sentence(tmp_path):
    from safetensors.torch import load_file, save_file
    from pipefill.model.loader import WeightSource, load_stage_weights
    path = save_moe("qwen3_moe", tmp_path)
    weights = load_file(f"{path}/model.safetensors")
    p = "model.layers.0.mlp.experts."
    gate_up = torch.stack([torch.cat([weights.pop(f"{p}{e}.gate_proj.weight"),
                                      weights.pop(f"{p}{e}.up_proj.weight")]) for e in range(5)])
    save_file({**weights, p + "gate_up_proj": gate_up}, f"{path}/model.safetensors")
    source = WeightSource(path)
    with pytest.raises(ValueError, match=f"has no tensor {p}0.gate_proj.weight: its weights are "
                                         "not laid out as published qwen3_moe checkpoints are "
                                         r"\(pipefill reads one tensor per expert"):
        load_stage_weights(source, range(0, 1), True, False, torch.float32)


def test_layer_costs_put_dense_and_sparse_layers_apart(moe_models):
    from pipefill.model.loader import WeightSource
    source = WeightSource(moe_models["qwen3_moe"][0])
    costs = source.family.layer_costs(source.config)
    # Layer 1 is dense (an MLP 96 wide) and costs more than the sparse ones (2 experts of 32).
    assert costs[1] > costs[0] == costs[2] == costs[3]
    from pipefill.base.partition import partition_layers
    # The lightest heaviest stage: layers 0-1 (sparse + dense) against 2-3 (two sparse).
    assert [len(r) for r in partition_layers(4, 2, costs=costs)] == [2, 2]
    assert [len(r) for r in partition_layers(4, 3, costs=costs)] == [1, 1, 2]
