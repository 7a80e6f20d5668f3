"""PD with sliding-window layers that keep pages of their own (ARCHITECTURE.md, 'Window
pages'): a sender and receiver in this process over WindowedKVCaches (tcp, and mooncake where
its transfer engine is installed: straight into the pages and through the staging region) move
the global layers of every page chunk by chunk and the window layers, with the last chunk, of
exactly the pages the decode's window table names; a decode asking for a window page the
prefill freed, or a pair whose window layers differ, is refused with a sentence."""
from __future__ import annotations

import pytest
import torch

from conftest import wait_until
from test_disagg_transfer import BACKENDS
from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import BootstrapServer, check_window_layers, lookup_prefill, \
    register_stage
from pipefill.disagg.prefill_rooms import Refused, compact_window
from pipefill.disagg.transfer import StageTensors, Timing
from pipefill.disagg.transfer_receiver import KVReceiver
from pipefill.disagg.transfer_sender import KVSender
from pipefill.kv.cache import WindowedKVCache

PAGES, PAGE, HEADS, DIM = 24, 4, 2, 8
WINDOWED = [False, True, True, False, True]  # layers 1, 2 and 4 slide
ROOM = 4242
FAST = Timing(bootstrap_timeout_s=20, waiting_timeout_s=20, heartbeat_interval_s=0.2,
              heartbeat_max_misses=3)


def cache(seed: int | None) -> WindowedKVCache:
    c = WindowedKVCache(WINDOWED, PAGES, PAGE, HEADS, DIM, torch.float32)
    g = torch.Generator().manual_seed(seed or 0)
    for t in (c.k, c.v, c.window.k, c.window.v):
        t.copy_(torch.randn(t.shape, generator=g) if seed is not None else torch.zeros(t.shape))
    return c


def stage_of(full: WindowedKVCache, head_map) -> StageTensors:
    """`full` as one rank's stage (head_map None), or as TP ranks holding head_map[r] of its
    heads, each a WindowedKVCache of its own ('KV heads across TP sizes')."""
    if head_map is None:
        return StageTensors.of_cache(full, 0)
    ranks = []
    for heads in head_map:
        c = WindowedKVCache(WINDOWED, PAGES, PAGE, len(heads), DIM, torch.float32)
        for t, f in zip((c.k, c.v, c.window.k, c.window.v),
                        (full.k, full.v, full.window.k, full.window.v)):
            t.copy_(f[:, :, heads])
        ranks.append((c.k, c.v, c.window.k, c.window.v))
    leader = WindowedKVCache(WINDOWED, 1, PAGE, len(head_map[0]), DIM, torch.float32)
    leader.k, leader.v, leader.window.k, leader.window.v = ranks[0]
    leader.num_pages = leader.window.num_pages = PAGES
    return StageTensors.of_ranks(leader, 0, ranks, head_map)


class Pair:
    """A bootstrap service, a prefill stage's sender and a decode stage's receiver."""

    def __init__(self, backend: str = "tcp", src_map=None, dst_map=None):
        """src_map, dst_map: the two stages' TP ranks' KV heads (None: one rank)."""
        self.src, self.dst = cache(1), cache(None)
        self.released = []
        self.service = BootstrapServer(port=0)
        self.sender = KVSender(stage_of(self.src, src_map), 0, timing=FAST,
                               backend=backend,
                               release=lambda room, pages: self.released.append(room))
        self.dst_ranks = stage_of(self.dst, dst_map)
        self.receiver = KVReceiver(self.dst_ranks, timing=FAST,
                                   backend=backend, release=lambda room, pages: None,
                                   staging_bytes=1 << 20)  # room for a scattered room
        register_stage(self.service.endpoint, self.sender.registration(
            pp_size=1, num_layers=len(WINDOWED), num_kv_heads=HEADS, head_dim=DIM,
            model_fingerprint="tiny"))
        self.receiver.connect("p", lookup_prefill(self.service.endpoint, 10))

    def close(self):
        self.receiver.close()
        self.sender.close()
        self.service.close()

    def send(self, src_pages, src_window, dst_pages, dst_window):
        """The request's pages in two chunks, its window table with the last."""
        self.receiver.expect_room(ROOM, "p", dst_pages, want_final=False, dst_window=dst_window)
        self.sender.open_room(ROOM)
        self.sender.send_pages(ROOM, 0, src_pages[:3])
        self.sender.send_pages(ROOM, 3, src_pages[3:], is_last=True, window_table=src_window)
        return self.receiver.wait_room(ROOM, 30)


@pytest.fixture(params=BACKENDS)
def pair(request):
    p = Pair(request.param)
    yield p
    p.close()


@pytest.mark.parametrize("dst", [[20, 3, 8, 1, 17, 6], [10, 11, 12, 13, 14, 15]],
                         ids=["scattered", "consecutive"])  # mooncake: staged, or written in
def test_the_window_layers_cross_only_for_the_pages_the_decode_keeps(pair, dst):
    src = [5, 9, 2, 14, 7, 11]
    src_window = [-1, -1, 4, 12, 0, 19]  # pages 0 and 1 were freed on the prefill
    dst_window = [-1, -1, -1, 10, 2, 21]  # the decode reads pages 3.. (page 2: not asked)
    res = pair.send(src, src_window, dst, dst_window)
    assert res.ok, res
    k, dk = pair.src.per_layer()[0], pair.dst.per_layer()[0]
    for layer, windowed in enumerate(WINDOWED):
        a = k[layer].view(-1, PAGE, HEADS, DIM)
        b = dk[layer].view(-1, PAGE, HEADS, DIM)
        if not windowed:  # the global layers: every page
            assert torch.equal(a[src], b[dst])
            continue
        assert torch.equal(a[[4, 12, 0, 19]][1:], b[[10, 2, 21]])
        assert not b[[p for p in range(PAGES) if p not in (10, 2, 21)]].any()
    if pair.sender.data.name == "mooncake":  # scattered pages: both chunks went staged
        assert pair.sender.data.num_staged_chunks == (2 if dst[0] == 20 else 0)
    # The sender counts a chunk once it is sent, which may be after the decode has it.
    assert wait_until(lambda: (pair.sender.pages_sent, pair.sender.window_pages_sent) == (6, 3))
    page_bytes = PAGE * HEADS * DIM * 4
    assert pair.sender.bytes_sent == 2 * page_bytes * (6 * 2 + 3 * 3)  # K and V
    assert wait_until(lambda: pair.released == [ROOM])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src_map,dst_map", [([[0], [1]], None), (None, [[0], [1]]),
                                             ([[0], [1]], [[1], [0, 1]])],
                         ids=["tp2-tp1", "tp1-tp2", "tp2-tp2-replicated"])
def test_each_decode_rank_gets_its_heads_of_the_window_pages(backend, src_map, dst_map):
    """TP ranks on either side: the window pages cross as the other pages do, each decode rank
    with exactly its heads (ARCHITECTURE.md, 'KV heads across TP sizes')."""
    p = Pair(backend, src_map, dst_map)
    try:
        src, dst = [5, 9, 2, 14, 7, 11], [20, 3, 8, 1, 17, 6]
        res = p.send(src, [-1, -1, 4, 12, 0, 19], dst, [-1, -1, -1, 10, 2, 21])
        assert res.ok, res
        for rank, window, heads in zip(p.dst_ranks.ranks, p.dst_ranks.window.ranks,
                                       dst_map or [[0, 1]]):
            for kv, full, src_pages, dst_pages in ((rank, p.src.k, src, dst),
                                                   (window, p.src.window.k, [12, 0, 19],
                                                    [10, 2, 21])):
                for row in range(kv.k.shape[0]):
                    got = kv.k[row].view(-1, PAGE, len(heads), DIM)[dst_pages]
                    want = full[row].view(-1, PAGE, HEADS, DIM)[src_pages][:, :, heads]
                    assert torch.equal(got, want)
    finally:
        p.close()


def test_a_decode_asking_for_a_freed_window_page_is_refused_with_a_sentence(pair):
    res = pair.send([1, 2, 3, 4], [-1, 6, 7, 8], [9, 10, 11, 12], [5, 6, 7, 8])
    assert not res.ok and "no longer holds" in res.reason, res
    assert wait_until(lambda: pair.released == [ROOM])


def test_window_tables_and_layers_that_do_not_match_are_refused():
    with pytest.raises(Refused, match="one a page"):
        compact_window([1, 2], 3, windowed=True)
    with pytest.raises(Refused, match="keep every token"):
        compact_window([1, -1, 2], 3, windowed=False)
    assert list(compact_window([-1, 4, 5], 3, windowed=True)) == [-1, 4, 5]
    stage = m.RegisterStage(0, 1, 0, 5, 5, m.Endpoint("h", 1), PAGE, "float32", HEADS, DIM,
                            "tiny", "tcp", window_layers=[1, 2, 4])
    check_window_layers([stage], [1, 2, 4])
    with pytest.raises(ValueError, match="keeps the sliding-window layers' KV in window "
                                         "pages.*this decode for every token"):
        check_window_layers([stage], [])


def test_a_prefill_stage_drops_a_decode_whose_window_layers_differ(caplog):
    """A decode whose window layers keep every token (a plain KVCache: its hello names no
    window layers) is refused by a prefill stage that keeps window pages, with a log line."""
    from pipefill.kv.cache import KVCache
    src = cache(1)
    service = BootstrapServer(port=0)
    sender = KVSender(StageTensors.of_cache(src, 0), 0, timing=FAST,
                      release=lambda room, pages: None)
    plain = KVCache(len(WINDOWED), PAGES, PAGE, HEADS, DIM, torch.float32)
    receiver = KVReceiver(StageTensors.of_cache(plain, 0), timing=FAST,
                          release=lambda room, pages: None)
    try:
        register_stage(service.endpoint, sender.registration(
            pp_size=1, num_layers=len(WINDOWED), num_kv_heads=HEADS, head_dim=DIM,
            model_fingerprint="tiny"))
        info = lookup_prefill(service.endpoint, 10)
        assert info.stages[0].window_layers == [1, 2, 4]
        receiver.connect("p", info)
        assert wait_until(lambda: not receiver.connected("p"), 10)
        assert "keep window pages" in caplog.text
    finally:
        receiver.close()
        sender.close()
        service.close()
