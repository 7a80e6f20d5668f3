"""A window layer computes a chunk in pieces (model/attention.window_pieces), because a
request's window pages form a ring that a long chunk wraps onto (ARCHITECTURE.md, 'Window
pages'): the cuts, and the attention over a ring equal to the attention over pages of its own."""
import torch

from pipefill.kv.window import ring_pages
from pipefill.model.attention import SeqMeta, attention_in_pieces, paged_attention, \
    window_pieces


def test_pieces_cut_at_the_multiples_of_the_piece():
    seq = SeqMeta(5, 100, 70, slice(1070, 1170), slice(1000, 1170), torch.zeros(43))
    pieces = window_pieces(seq, 32)
    assert [(p.row_start, p.num_new, p.prefix_len) for p in pieces] == \
        [(5, 26, 70), (31, 32, 96), (63, 32, 128), (95, 10, 160)]
    assert [p.write_slots for p in pieces] == [slice(1070, 1096), slice(1096, 1128),
                                               slice(1128, 1160), slice(1160, 1170)]
    assert pieces[1].read_slots == slice(1000, 1128)
    slots = torch.arange(500, 670)  # the same over an expanded table
    pieces = window_pieces(SeqMeta(0, 100, 70, slots[70:], slots, torch.zeros(43)), 32)
    assert torch.equal(torch.cat([p.write_slots for p in pieces]), slots[70:])
    assert torch.equal(pieces[2].read_slots, slots[:160])


def test_a_chunk_within_one_piece_is_not_cut():
    seq = SeqMeta(0, 20, 64, slice(64, 84), slice(0, 84), torch.zeros(3))
    assert window_pieces(seq, 32) == [seq]
    assert window_pieces(seq, 0) == [seq]
    assert len(window_pieces(SeqMeta(0, 2, 63, slice(63, 65), slice(0, 65), None), 32)) == 2


def test_a_ring_of_window_pages_gives_the_attention_of_pages_of_its_own():
    """40 tokens in two chunks, pages of 4, a window of 10: over a ring of ring_pages pages
    (page i on ring page i mod ring), computed piece by piece, the same as over 10 pages of
    its own; the second chunk computed whole over the ring, not (its writes overwrote keys
    its first queries read from the cache)."""
    torch.manual_seed(0)
    page, window, n = 4, 10, 40
    ring = ring_pages(page, window)
    q, k, v = torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)

    def run(pages, piece):
        table = torch.tensor(pages, dtype=torch.int32)
        slots = (table.long()[:, None] * page + torch.arange(page)).view(-1)
        cache = torch.zeros(2, max(pages) * page + page, 2, 16)
        outs = []
        for start, end in ((0, 20), (20, n)):
            rows = slice(start, end)
            seq = SeqMeta(0, end - start, start, slots[rows], slots[:end], table)
            outs.append(attention_in_pieces(paged_attention, q[rows], k[rows], v[rows],
                                            cache[0], cache[1], [seq], 0.25, window, piece))
        return torch.cat(outs)

    own = run(list(range(n // page)), 0)
    ringed = [i % ring for i in range(n // page)]
    # (The sdpa path reads a piece's own keys from k, the earlier ones from the cache: the
    # pieces' sums round apart from whole chunks' by float32 ulps.)
    torch.testing.assert_close(run(ringed, page), own, atol=1e-5, rtol=1e-5)
    assert (run(ringed, 0) - own).abs().max() > 0.1
