"""Mixture-of-experts layers under tensor parallelism, in one process: each rank's slice of a
sparse layer (split by expert width or by whole experts, uneven: 5 experts and widths that do
not divide) gives a partial output, and the ranks' partials sum to the whole layer's; the
router stays whole on every rank; a shared expert is split by width; the refusals."""
import pytest
import torch

from test_moe_family import MOE, save_moe
from pipefill.model.families.moe import MOE as MOE_FAMILY
from pipefill.model.loader import WeightSource, load_stage_weights
from pipefill.model.tensor_parallel import (ShardedSource, check_tensor_parallel,
                                            resolve_moe_split, tp_shard)

# Qwen3-MoE: 5 experts of width 40 (experts 3 + 2 at TP 2; columns 32 + 8, MLP_GRAIN units);
# Qwen2-MoE: 7 experts of width 33 with a shared expert of width 48; Mixtral: 3 experts.
SHAPES = {"qwen3_moe": dict(moe_intermediate_size=40), "qwen2_moe": dict(moe_intermediate_size=33),
          "mixtral": dict(intermediate_size=40)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {k: save_moe(k, tmp_path_factory.mktemp(k), num_hidden_layers=2, **SHAPES[k])
            for k in MOE}


def sparse_block(source, layer: int):
    weights = load_stage_weights(source, range(layer, layer + 1), False, False, torch.float32)
    return weights.layers[0].moe


@pytest.mark.parametrize("split", ["width", "expert"])
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("kind", list(MOE))
def test_rank_slices_sum_to_the_whole_layer(models, kind, size, split):
    source = WeightSource(models[kind])
    cfg = source.config
    if split == "expert" and cfg.moe.num_experts < size:
        pytest.skip("fewer experts than ranks: refused (test_refusals)")
    layer = 1 if cfg.is_sparse(1) else 0
    whole = sparse_block(source, layer)
    x = torch.randn(23, cfg.hidden_size)
    held, partials = [], []
    for rank in range(size):
        shard = tp_shard(cfg, rank, size, split)
        block = sparse_block(ShardedSource(source, shard), layer)
        assert torch.equal(block.router, whole.router)  # the same routing on every rank
        held.append(range(block.experts.first, block.experts.first + block.experts.num_experts))
        if split == "expert":
            assert block.experts.width == cfg.moe.expert_width
        else:
            assert held[-1] == range(cfg.moe.num_experts)
            assert block.experts.width == len(shard.expert_cols) < cfg.moe.expert_width
        if whole.shared is not None:
            assert block.shared.down.shape[1] == len(shard.shared_cols)
        partials.append(block(x))
    if split == "expert":  # every expert on exactly one rank
        assert [e for r in held for e in r] == list(range(cfg.moe.num_experts))
    torch.testing.assert_close(torch.stack(partials).sum(0), whole(x), rtol=0, atol=1e-5)


def test_auto_split_and_refusals(models):
    cfg = WeightSource(models["mixtral"]).config  # 3 experts
    assert resolve_moe_split("expert", cfg, 4)[0] == "expert"
    assert resolve_moe_split("auto", cfg, 4)[0] == "width"  # 3 experts: never expert at TP 4
    check_tensor_parallel(cfg, MOE_FAMILY, 2, "expert")
    with pytest.raises(ValueError, match="3 experts are fewer than --tp-size 4 ranks"):
        check_tensor_parallel(cfg, MOE_FAMILY, 4, "expert")
    with pytest.raises(ValueError, match="larger than the model's 4 attention heads"):
        check_tensor_parallel(cfg, MOE_FAMILY, 8, "width")
