"""KV heads across TP sizes (ARCHITECTURE.md, 'KV heads across TP sizes'), without processes:
the head maps of TP stages, how a decode rank's heads are cut out of the prefill ranks', the
refusals of maps that cannot be matched, and the bytes StageTensors.gather and scatter move
(each decode rank's pages hold exactly its heads, token-major and AMX-packed)."""
from __future__ import annotations

import pytest
import torch

from pipefill.disagg.heads import (Piece, check_head_map, check_pairing, describe,
                                   latent_head_map, pieces, tp_head_map, whole_source)
from pipefill.disagg.transfer import KVTensors, StageTensors


@pytest.mark.parametrize("heads, kv_heads, tp, want", [
    (6, 3, 1, [[0, 1, 2]]),
    (6, 3, 2, [[0, 1], [2]]),                 # uneven: ceil/floor
    (6, 3, 4, [[0], [0], [1], [2]]),          # fewer KV heads than ranks: head 0 replicated
    (4, 1, 2, [[0], [0]]),                    # one KV head, replicated on both ranks
    (8, 8, 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
])
def test_tp_head_maps(heads, kv_heads, tp, want):
    assert tp_head_map(heads, kv_heads, tp) == want


def test_query_split_maps_keep_a_straddled_head_on_both_ranks():
    """Split by query heads (9 over 3 KV heads at TP 2: heads 0-4 and 5-8) KV head 1 is on
    both prefill ranks: a valid map; a TP 1 decode takes heads 0-1 from rank 0 and head 2 from
    rank 1, a whole-groups TP 2 decode rank 0 takes rank 0's pages whole."""
    prefill = tp_head_map(9, 3, 2, "queries")
    assert prefill == [[0, 1], [1, 2]]
    check_pairing(prefill, [[0, 1, 2]], 3)
    assert pieces(prefill, [0, 1, 2]) == [Piece(0, 0, 0, 2), Piece(1, 1, 2, 1)]
    assert whole_source(prefill, [0, 1]) == 0
    assert pieces(prefill, [2]) == [Piece(1, 1, 0, 1)]
    assert whole_source(prefill, [1, 2]) == 1


def test_three_heads_over_two_prefill_ranks_into_one_decode_rank():
    prefill = [[0, 1], [2]]
    assert pieces(prefill, [0, 1, 2]) == [Piece(0, 0, 0, 2), Piece(1, 0, 2, 1)]
    assert whole_source(prefill, [0, 1, 2]) is None


def test_one_prefill_rank_into_two_decode_ranks():
    prefill = [[0, 1, 2]]
    assert pieces(prefill, [0, 1]) == [Piece(0, 0, 0, 2)]
    assert pieces(prefill, [2]) == [Piece(0, 2, 0, 1)]
    assert whole_source(prefill, [0, 1]) is None  # a part of rank 0's heads: cut


def test_same_maps_move_whole_pages():
    prefill = [[0, 1], [2]]
    assert [whole_source(prefill, hs) for hs in prefill] == [0, 1]
    assert whole_source([[0, 1, 2]], [0, 1, 2]) == 0


def test_a_replicated_head_comes_from_its_first_holder():
    # 1 KV head at TP 2 on the prefill, TP 1 on the decode: head 0 once, from rank 0.
    assert pieces([[0], [0]], [0]) == [Piece(0, 0, 0, 1)]
    assert whole_source([[0], [0]], [0]) == 0
    # 1 KV head at TP 1 into TP 2: both decode ranks take the same head.
    assert [pieces([[0]], hs) for hs in tp_head_map(4, 1, 2)] == [[Piece(0, 0, 0, 1)]] * 2
    # TP 4 over 3 heads into TP 2: rank 1 of the decode takes head 2 from prefill rank 3.
    assert pieces(tp_head_map(6, 3, 4), [2]) == [Piece(3, 0, 0, 1)]
    assert pieces(tp_head_map(6, 3, 4), [0, 1]) == [Piece(0, 0, 0, 1), Piece(2, 0, 1, 1)]


def test_a_latent_is_one_head_every_rank_holds_whole():
    """DeepSeek's latent at TP 3 into TP 1 and TP 2: one copy, rank 0's, to each decode rank,
    whole pages."""
    prefill = latent_head_map(3)
    assert prefill == [[0], [0], [0]]
    for decode in (latent_head_map(1), latent_head_map(2)):
        check_pairing(prefill, decode, 1)
        assert [whole_source(prefill, hs) for hs in decode] == [0] * len(decode)


@pytest.mark.parametrize("head_map, needle", [
    ([[0, 1]], "hold no copy of KV head 2 of the model's 3"),
    ([[0, 1], []], "TP rank 1 holds no KV head"),
    ([[1, 0], [2]], "not distinct ascending heads"),
    ([[0, 0], [1, 2]], "not distinct ascending heads"),
    ([[0, 1], [3]], "not distinct ascending heads of the model's 3"),
    ([], "names 0 TP ranks"),
])
def test_maps_that_cannot_be_matched_are_refused_with_a_sentence(head_map, needle):
    with pytest.raises(ValueError, match=needle):
        check_head_map(head_map, 3, "the prefill stage")
    with pytest.raises(ValueError, match=needle):
        check_pairing([[0, 1, 2]], head_map, 3)


def test_a_pair_of_models_with_other_head_counts_is_refused():
    with pytest.raises(ValueError, match="prefill's model has 3 KV heads, the decode's 4"):
        check_pairing([[0, 1, 2]], [[0, 1], [2, 3]], 3, 4)
    check_pairing([[0, 1], [2]], [[0], [0], [1], [2]], 3, 3)  # any valid maps pair


def test_describe_names_each_ranks_heads():
    assert describe([[0, 1], [2]]) == "rank 0: heads 0-1, rank 1: head 2"


# ---- the bytes: gather on the prefill, scatter on the decode ---------------------------------

PAGES, PAGE, DIM, LAYERS = 6, 4, 8, 2


def full_kv(num_heads: int, layout: str) -> torch.Tensor:
    """K of every head, [layers, pages, heads, page, dim] (values name layer, page, head)."""
    g = torch.Generator().manual_seed(num_heads)
    return torch.randn(LAYERS, PAGES, num_heads, PAGE, DIM, generator=g)


def rank_tensors(full: torch.Tensor, heads: list[int], layout: str) -> KVTensors:
    """A rank's KVTensors holding `heads` of `full`, in the engine's layout."""
    part = full[:, :, heads]  # [L, P, h, page, D]
    if layout == "token-major":
        k = part.permute(0, 1, 3, 2, 4).reshape(LAYERS, PAGES * PAGE, len(heads), DIM)
    else:
        k = part.contiguous()
    k = k.contiguous()
    return KVTensors(k, (k + 1000).contiguous(), PAGE, 0, PAGES, layout, tuple(heads))


def empty_like_rank(heads: list[int], layout: str) -> KVTensors:
    shape = ((LAYERS, PAGES * PAGE, len(heads), DIM) if layout == "token-major"
             else (LAYERS, PAGES, len(heads), PAGE, DIM))
    return KVTensors(torch.zeros(shape), torch.zeros(shape), PAGE, 0, PAGES, layout,
                     tuple(heads))


@pytest.mark.parametrize("layout", ["token-major", "amx-packed"])
@pytest.mark.parametrize("src_map, dst_map", [
    ([[0, 1], [2]], [[0, 1, 2]]),             # TP 2 -> TP 1
    ([[0, 1, 2]], [[0, 1], [2]]),             # TP 1 -> TP 2
    ([[0], [0], [1], [2]], [[0, 1], [2]]),    # TP 4 (head 0 replicated) -> TP 2
    ([[0, 1], [2]], [[0], [0], [1], [2]]),    # TP 2 -> TP 4
    ([[0, 1], [2]], [[0, 1], [2]]),           # same maps: whole pages
], ids=["tp2-tp1", "tp1-tp2", "tp4-tp2", "tp2-tp4", "tp2-tp2"])
def test_gather_then_scatter_puts_every_head_where_its_rank_wants_it(layout, src_map, dst_map):
    full = full_kv(3, layout)
    src = StageTensors([rank_tensors(full, hs, layout) for hs in src_map])
    dst = StageTensors([empty_like_rank(hs, layout) for hs in dst_map])
    assert src.page_bytes == dst.page_bytes  # what the handshake compares, at any TP sizes
    src_pages, dst_pages = [4, 1, 3], [0, 5, 2]
    nbytes = len(src_pages) * sum(src.rank_page_bytes(dst_map))
    for layer in range(LAYERS):
        for which in ("k", "v"):
            out = torch.empty(nbytes, dtype=torch.uint8)
            src.gather(dst_map, which, layer, torch.tensor(src_pages), out)
            dst.scatter(which, layer, torch.tensor(dst_pages), out)
    for rank, hs in zip(dst.ranks, dst_map):
        want = rank_tensors(full, hs, layout)
        for which in ("k", "v"):
            for layer in range(LAYERS):
                got_pages = rank.pages(getattr(rank, which), layer)[dst_pages]
                want_pages = want.pages(getattr(want, which), layer)[src_pages]
                assert torch.equal(got_pages, want_pages)
            untouched = [p for p in range(PAGES) if p not in dst_pages]
            assert not rank.pages(getattr(rank, which), 0)[untouched].any()
