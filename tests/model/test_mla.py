"""Latent attention's two prefill paths (model/mla.py) and the cost that chooses between them
(model/mla_cost.py): where the choice falls for DeepSeek-V2-Lite's and V3's shapes, and that
both paths, forced or chosen, give the same outputs (float32) over a paged latent cache, with
and without a cached prefix, in one block of queries or several."""
import logging

import pytest
import torch

from pipefill.model import mla
from pipefill.model.attention import SeqMeta
from pipefill.model.mla import LatentAttention, LatentUp, latent_attention, write_latent
from pipefill.model.mla_cost import (LatentShape, Rates, cheaper_path, largest_absorbed_chunk)

# DeepSeek-V2-Lite (16 heads) and V3 (128): kv_lora_rank 512, nope 128, rope 64, v 128, bf16.
V2_LITE = LatentShape(heads=16, nope=128, rope=64, v=128, rank=512, elem=2)
V3 = LatentShape(heads=128, nope=128, rope=64, v=128, rank=512, elem=2)


@pytest.mark.parametrize("shape", [V2_LITE, V3], ids=["v2-lite", "v3"])
def test_where_the_choice_falls_for_deepseek_shapes(shape):
    """A decode row absorbs after any prefix; without a prefix only chunks of a few tokens
    do; after a long prefix chunks up to ~150 tokens do (each key's decompression costs
    2 · 512 · 256 FLOPs a head, each query-key pair absorbed ~2 · 1088 more than
    decompressed), and the choice flips once, at the crossover; a 4K chunk decompresses."""
    for prefix in (1, 512, 8192, 131072):
        assert cheaper_path(shape, 1, prefix + 1) == "absorbed"
    assert 4 <= largest_absorbed_chunk(shape, 0) <= 32
    for prefix in (8192, 32768, 131072):
        c = largest_absorbed_chunk(shape, prefix)
        assert 120 <= c <= 200, (prefix, c)
        assert cheaper_path(shape, c, prefix + c) == "absorbed"
        assert cheaper_path(shape, c + 1, prefix + c + 1) == "decompressed"
        assert cheaper_path(shape, 4096, prefix + 4096) == "decompressed"
    assert largest_absorbed_chunk(shape, 64) < largest_absorbed_chunk(shape, 2048)


def test_the_heads_cancel_and_the_rates_move_the_crossover():
    """Both paths cost per head, so V2-Lite and V3 cross at about the same chunk; a machine
    whose bytes are dearer (a calibration's rates) absorbs shorter chunks: the absorbed
    path's float32 scores pass through memory ten times per query and key."""
    for prefix in (2048, 32768):
        lite, v3 = (largest_absorbed_chunk(s, prefix) for s in (V2_LITE, V3))
        assert abs(lite - v3) <= 0.1 * v3
    memory_bound = Rates(flops=1e12, bytes=1e10)
    assert largest_absorbed_chunk(V3, 32768, memory_bound) < largest_absorbed_chunk(V3, 32768)


def _layer(heads=3, nope=10, rope=6, v=14, rank=22, seed=0):
    gen = torch.Generator().manual_seed(seed)
    up = LatentUp(torch.randn(heads * (nope + v), rank, generator=gen) * 0.3, heads, nope, v)
    return up, gen


def _cached(latent: torch.Tensor, gen, slots_total: int = 256):
    """The latents written over a paged K/V pair at scattered slots -> (k, v, slots)."""
    half = (latent.shape[1] + 1) // 2
    k_cache, v_cache = torch.zeros(slots_total, 1, half), torch.zeros(slots_total, 1, half)
    slots = torch.randperm(slots_total, generator=gen)[:latent.shape[0]]
    write_latent(k_cache, v_cache, latent, [SeqMeta(0, latent.shape[0], 0, slots, slots,
                                                    torch.zeros(1, dtype=torch.int32))])
    return k_cache, v_cache, slots


@pytest.mark.parametrize("prefix,new", [(0, 40), (44, 13), (150, 3), (0, 1), (70, 1)])
def test_both_paths_give_equal_outputs_through_the_cache(prefix, new):
    up, gen = _layer()
    latent = torch.randn(prefix + new, 28, generator=gen)
    k_cache, v_cache, slots = _cached(latent, gen)
    seq = SeqMeta(0, new, prefix, slots[prefix:], slots, torch.zeros(1, dtype=torch.int32))
    q_nope = torch.randn(new, 3, 10, generator=gen)
    q_pe = torch.randn(new, 3, 6, generator=gen)
    outs = {path: latent_attention(q_nope, q_pe, k_cache, v_cache, [seq], up, 28, 0.3,
                                   LatentAttention(path))
            for path in ("decompressed", "absorbed", "auto")}
    torch.testing.assert_close(outs["absorbed"], outs["decompressed"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["auto"], outs["decompressed"], rtol=1e-5, atol=1e-5)


def test_absorbed_queries_in_blocks_equal_one_block(monkeypatch):
    """A chunk whose scores would pass SCORE_BLOCK_BYTES goes in blocks of queries, each over
    the keys up to its last query (here 4 queries a block)."""
    up, gen = _layer()
    latent = torch.randn(61, 28, generator=gen)
    q_nope, q_pe = torch.randn(23, 3, 10, generator=gen), torch.randn(23, 3, 6, generator=gen)
    whole = mla.absorbed(q_nope, q_pe, latent, up, 0.3)
    monkeypatch.setattr(mla, "score_block_rows", lambda heads, keys: 4)
    blocks = mla.absorbed(q_nope, q_pe, latent, up, 0.3)
    torch.testing.assert_close(blocks, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(blocks, mla.decompressed(q_nope, q_pe, latent, up, 0.3),
                               rtol=1e-5, atol=1e-5)


def test_the_rule_is_logged_once_per_model(caplog):
    up, gen = _layer(heads=5)
    latent = torch.randn(50, 28, generator=gen)
    k_cache, v_cache, slots = _cached(latent, gen)
    mla.log_prefill_rule.cache_clear()
    with caplog.at_level(logging.INFO, logger="pipefill.model.mla"):
        for prefix, new in ((0, 20), (20, 20), (40, 10)):  # three chunks
            seq = SeqMeta(0, new, prefix, slots[prefix:prefix + new], slots,
                          torch.zeros(1, dtype=torch.int32))
            latent_attention(torch.randn(new, 5, 10), torch.randn(new, 5, 6), k_cache, v_cache,
                             [seq], up, 28, 0.3)
    lines = [r.message for r in caplog.records if "latent attention (5 heads" in r.message]
    assert len(lines) == 1 and "absorbed where that is cheaper" in lines[0]
