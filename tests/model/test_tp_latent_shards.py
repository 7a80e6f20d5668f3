"""DeepSeek's latent attention under tensor parallelism, in one process (ranks as threads):
each rank's slices of a latent layer (its heads' q rows, kv_b rows and o_proj columns; q_a,
kv_a and their norms whole), the whole latent in every rank's pool, and a stage of 2 and 3
ranks (3 heads: 2 and 1, or one each) against one rank through a prefill and greedy decode
steps, on the latent decode kernel and on torch; V3 (q LoRA) and V2 (q_proj)."""
import pytest
import torch

from test_deepseek import save_deepseek
from test_tp_shards import assert_lean_decode_on_two_ranks
from pipefill.config import ServerArgs, resolve
from pipefill.model.families.deepseek import DEEPSEEK
from pipefill.model.loader import WeightSource
from pipefill.model.tensor_parallel import (ShardedSource, attention_columns,
                                            check_tensor_parallel, tp_shard)


@pytest.fixture(scope="module")
def deepseek_paths(tmp_path_factory):
    return {kind: save_deepseek(kind, tmp_path_factory.mktemp(kind)) for kind in ("v3", "v2")}


@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_rank_slices_are_their_heads(deepseek_paths, kind):
    """3 heads (v3) or 4 (v2) at TP 2 and 3: every head's rows once, in order; the latent's
    projections whole on every rank."""
    source = WeightSource(deepseek_paths[kind])
    cfg, mla = source.config, source.config.mla
    a = "model.layers.0.self_attn."
    q_name = a + ("q_b_proj.weight" if mla.q_lora_rank else "q_proj.weight")
    whole = {n: source.load(a + n) for n in ("kv_b_proj.weight", "o_proj.weight",
                                             "kv_a_proj_with_mqa.weight")}
    whole_q = source.load(q_name)
    for size in (2, 3):
        q_parts, kv_b_parts, o_parts = [], [], []
        for rank in range(size):
            shard = tp_shard(cfg, rank, size)
            sharded = ShardedSource(source, shard)
            assert sharded.config.num_heads == len(shard.q_heads)
            q_parts.append(sharded.load(q_name))
            kv_b_parts.append(sharded.load(a + "kv_b_proj.weight"))
            o_parts.append(sharded.load(a + "o_proj.weight"))
            assert sharded.shape(a + "o_proj.weight") == o_parts[-1].shape
            assert torch.equal(sharded.load(a + "kv_a_proj_with_mqa.weight"),
                               whole["kv_a_proj_with_mqa.weight"])
            assert q_parts[-1].shape[0] == len(shard.q_heads) * mla.qk_head_dim
            assert kv_b_parts[-1].shape[0] == len(shard.q_heads) * (mla.qk_nope_head_dim
                                                                     + mla.v_head_dim)
            assert DEEPSEEK.kv_specs(sharded.config, range(1), torch.float32) == \
                DEEPSEEK.kv_specs(cfg, range(1), torch.float32)  # the whole latent
        assert torch.equal(torch.cat(q_parts), whole_q)
        assert torch.equal(torch.cat(kv_b_parts), whole["kv_b_proj.weight"])
        assert torch.equal(torch.cat(o_parts, dim=1), whole["o_proj.weight"])


def test_uneven_heads_even_out_the_mlp(deepseek_paths):
    """3 heads at TP 2 (2 and 1): the rank with one head takes more dense MLP columns, by the
    latent layer's per-head weights."""
    cfg = WeightSource(deepseek_paths["v3"]).config
    shards = [tp_shard(cfg, r, 2) for r in range(2)]
    assert [len(s.q_heads) for s in shards] == [2, 1]
    assert len(shards[0].mlp) < len(shards[1].mlp)
    assert sum(len(s.mlp) for s in shards) == cfg.intermediate_size
    weights = [attention_columns(cfg, len(s.q_heads), 0) + len(s.mlp) for s in shards]
    assert abs(weights[0] - weights[1]) <= 1
    check_tensor_parallel(cfg, DEEPSEEK, 3)
    with pytest.raises(ValueError, match="larger than the model's 3 attention heads"):
        check_tensor_parallel(cfg, DEEPSEEK, 4)


@pytest.mark.parametrize("kind,size,backend", [
    ("v3", 2, "auto"), ("v3", 3, "sdpa"), ("v2", 3, "auto"),
    pytest.param("v2", 2, "sdpa", marks=pytest.mark.slow)])
def test_ranks_match_one_rank(deepseek_paths, kind, size, backend):
    """A 40-token prefill (pages of 32: the helper gives two), then greedy decode steps at
    batch 1 (absorbed, on the latent kernel under auto, in torch under sdpa): every rank's
    logits the same bits, within 1e-4 of one rank's."""
    path = deepseek_paths[kind]
    source = WeightSource(path)
    args = resolve(ServerArgs(model_path=path, dtype="float32", page_size=32,
                              max_total_tokens=512, threads_per_stage=1,
                              attention_backend=backend), source.config)
    assert_lean_decode_on_two_ranks(args, source, size=size, lean=False)


@pytest.mark.parametrize("qtype,split", [("Q8_0", True), ("F32", False)])
def test_gguf_ranks_match_one_rank(tmp_path, qtype, split):
    """A deepseek2 GGUF file at TP 3 (its 3 heads one a rank): kv_b_proj from the converter's
    3-D halves (attn_k_b, attn_v_b) cut along their heads, or whole (an older file); Q8_0
    blocks dequantized at load on every rank (TP keeps no blocks)."""
    from test_deepseek_gguf import MODELS, write_deepseek_gguf
    hf = save_deepseek("v3", tmp_path / "hf", models=MODELS)
    path = str(tmp_path / "m.gguf")
    write_deepseek_gguf(hf, path, qtype, split=split)
    source = WeightSource(path)
    assert source.config.mla.kv_b_split == split
    args = resolve(ServerArgs(model_path=path, dtype="float32", page_size=32,
                              max_total_tokens=512, threads_per_stage=1), source.config)
    assert_lean_decode_on_two_ranks(args, source, size=3, lean=False)


def test_fp8_checkpoint_ranks_match_one_rank(tmp_path):
    """An FP8 checkpoint (128 x 128 block scales) at TP 2: each rank reads its slices
    dequantized (--weight-dtype auto keeps no FP8 codes under TP), against one rank keeping
    them where the FP8 GEMM runs."""
    from pipefill.bench.make_model import write_fp8_copy
    from pipefill.model.loader import stage_keeps_blocks
    save_deepseek("v3", tmp_path / "float")
    write_fp8_copy(tmp_path / "float", tmp_path / "fp8")
    path = str(tmp_path / "fp8")
    source = WeightSource(path)
    assert source.fp8
    sharded = ShardedSource(source, tp_shard(source.config, 0, 2))
    keeps, why, _ = stage_keeps_blocks("auto", sharded, range(1), True, True, "cpu", "float32",
                                    torch.float32, tp_size=2)
    assert not keeps and "--tp-size 2 does not keep FP8 codes" in why
    args = resolve(ServerArgs(model_path=path, dtype="float32", page_size=32,
                              max_total_tokens=512, threads_per_stage=1), source.config)
    assert_lean_decode_on_two_ranks(args, source, size=2, lean=False)
