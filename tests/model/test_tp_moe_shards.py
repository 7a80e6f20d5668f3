"""Mixture-of-experts layers under tensor parallelism, in one process: each rank's slice of a
sparse layer (split by expert width or by whole experts, uneven: 5 experts and widths that do
not divide) gives a partial output, and the ranks' partials sum to the whole layer's; the
router stays whole on every rank; a shared expert is split by width; the refusals."""
import pytest
import torch

from test_moe_family import MOE, save_moe
from pipefill.model.families.moe import MOE as MOE_FAMILY
from pipefill.kernels.prefill_gemm import onednn_status
from pipefill.model.loader import WeightSource, load_stage_weights, reorder_prefill_weights
from pipefill.model.tensor_parallel import (ShardedSource, check_tensor_parallel,
                                            resolve_moe_split, tp_shard)

# Qwen3-MoE: 5 experts of width 40 (experts 3 + 2 at TP 2; columns 14 + 13 + 13 at TP 3);
# Qwen2-MoE: 7 experts of width 33 (17 + 16 columns at TP 2) with a shared expert of width 48
# (32 + 16: MLP_GRAIN units); Mixtral: 3 experts of width 40.
SHAPES = {"qwen3_moe": dict(moe_intermediate_size=40), "qwen2_moe": dict(moe_intermediate_size=33),
          "mixtral": dict(intermediate_size=40)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {k: save_moe(k, tmp_path_factory.mktemp(k), num_hidden_layers=2, **SHAPES[k])
            for k in MOE}


def sparse_block(source, layer: int, onednn: bool = False):
    """Layer `layer`'s sparse block; onednn: its experts moved into oneDNN's layout, as a
    stage's prefill keeps them (kernels.prefill_gemm.experts_in_onednn_layout)."""
    weights = load_stage_weights(source, range(layer, layer + 1), False, False, torch.float32)
    if onednn:
        reorder_prefill_weights(weights, source.family, 64, experts_only=True)
        assert weights.layers[0].moe.experts.linears[0].plain is None
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
        # The shards' experts in oneDNN's layout (where it runs here), the whole layer plain.
        block = sparse_block(ShardedSource(source, shard), layer, onednn_status()[0])
        assert torch.equal(block.router, whole.router)  # the same routing on every rank
        held.append(range(block.experts.first, block.experts.first + block.experts.num_experts))
        if split == "expert":
            assert block.experts.width == cfg.moe.expert_width
        else:
            assert held[-1] == range(cfg.moe.num_experts)
            assert block.experts.width == len(shard.expert_cols) < cfg.moe.expert_width
        if split == "expert" and rank == size - 1:  # one less than the first ranks
            assert block.experts.num_experts == cfg.moe.num_experts // size
        if whole.shared is not None:
            down = block.shared.prefill.get("down")
            width = down.in_features if down is not None else block.shared.down.shape[1]
            assert width == len(shard.shared_cols) < cfg.moe.shared_width
        partials.append(block(x))
    if split == "expert":  # every expert on exactly one rank
        assert [e for r in held for e in r] == list(range(cfg.moe.num_experts))
    torch.testing.assert_close(torch.stack(partials).sum(0), whole(x), rtol=0, atol=1e-5)


def test_auto_split_and_refusals(models):
    cfg = WeightSource(models["mixtral"]).config  # 3 experts
    assert resolve_moe_split("expert", cfg, 4)[0] == "expert"
    assert resolve_moe_split("width", cfg, 2)[0] == "width"
    assert resolve_moe_split("auto", cfg, 2)[0] == "expert"  # the default, measured (README)
    assert resolve_moe_split("auto", cfg, 4)[0] == "width"  # 3 experts: never expert at TP 4
    check_tensor_parallel(cfg, MOE_FAMILY, 2, "expert")
    with pytest.raises(ValueError, match="3 experts are fewer than --tp-size 4 ranks"):
        check_tensor_parallel(cfg, MOE_FAMILY, 4, "expert")
    with pytest.raises(ValueError, match="larger than the model's 4 attention heads"):
        check_tensor_parallel(cfg, MOE_FAMILY, 8, "width")


@pytest.fixture(scope="module")
def lean_qwen3_moe(tmp_path_factory):
    """Heads of 64: the vector attention kernels, so decode steps take the lean path."""
    return save_moe("qwen3_moe", tmp_path_factory.mktemp("lean"), num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, hidden_size=128, num_hidden_layers=3)


@pytest.mark.parametrize("split", ["width", "expert"])
def test_lean_decode_path_on_moe_shards_matches_one_rank(lean_qwen3_moe, split):
    """Two ranks (threads) against one: a prefill, then greedy decode steps whose sparse
    layers run on the lean path with the ranks' sum after the experts."""
    from test_tp_shards import assert_lean_decode_on_two_ranks
    from pipefill.config import ServerArgs, resolve
    source = WeightSource(lean_qwen3_moe)
    args = resolve(ServerArgs(model_path=lean_qwen3_moe, dtype="float32", page_size=32,
                              max_total_tokens=512, threads_per_stage=1), source.config)
    assert_lean_decode_on_two_ranks(args, source, tp_moe_split=split)


@pytest.mark.parametrize("split", ["width", "expert"])
@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_deepseek_moe_slices_sum_to_the_whole_block(tmp_path, kind, split):
    """DeepSeekMoE (V3's sigmoid router with a correction bias and routed scale, V2's two
    shared experts) cut as the MoE families' are (the latent attention's cuts:
    test_tp_latent_shards.py)."""
    from types import SimpleNamespace
    from test_deepseek import save_deepseek
    from pipefill.model.families.deepseek import DEEPSEEK
    from pipefill.model.loader import _StageReader
    source = WeightSource(save_deepseek(kind, tmp_path / kind))
    cfg = source.config

    def block(src):
        reader = _StageReader(src, torch.float32, None, SimpleNamespace(update=lambda n=1: None))
        return DEEPSEEK.load_sparse_mlp(src.config, 1, reader)["moe"]

    x = torch.randn(19, cfg.hidden_size)
    partials = [block(ShardedSource(source, tp_shard(cfg, r, 2, split)))(x) for r in range(2)]
    torch.testing.assert_close(partials[0] + partials[1], block(source)(x), rtol=0, atol=1e-5)
    check_tensor_parallel(cfg, DEEPSEEK, 2, split)
