"""KV transfer between stages of different TP sizes (ARCHITECTURE.md, 'KV heads across TP
sizes'), on threads of this process over real sockets: a prefill stage whose ranks hold
[[0, 1], [2]] of 3 KV heads sends a room, chunk by chunk, to a decode stage of another head
map; every decode rank's pages end up holding exactly its heads, byte for byte, over tcp and
Mooncake (slow: staged, and written straight into each rank's pages). A decode whose head map the
prefill cannot serve is refused at connect, with a sentence."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import wait_until
from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import BootstrapServer, check_compatible, lookup_prefill, \
    register_stage
from pipefill.disagg.transfer import KVTensors, StageTensors, Timing
from pipefill.disagg.transfer_receiver import KVReceiver
from pipefill.disagg.transfer_sender import KVSender
from pipefill.kv.pool import PagePool

from test_disagg_transfer import have_mooncake

LAYERS, PAGES, PAGE, KV_HEADS, DIM = 2, 32, 16, 3, 32
ROOM = 0x1234
FAST = Timing(bootstrap_timeout_s=20, waiting_timeout_s=20, heartbeat_interval_s=0.2,
              heartbeat_max_misses=3)
PREFILL_MAP = [[0, 1], [2]]


def full_pages(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every head: [layers, pages * page, heads, dim] token-major."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, PAGES * PAGE, KV_HEADS, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def stage(head_map, full=None) -> StageTensors:
    """A stage whose rank r holds head_map[r] of `full` (zeros where full is None)."""
    ranks = []
    for heads in head_map:
        k, v = ((t[:, :, heads].contiguous() for t in full) if full is not None else
                (torch.zeros(LAYERS, PAGES * PAGE, len(heads), DIM) for _ in range(2)))
        ranks.append(KVTensors(k, v, PAGE, 0, layout="token-major", heads=tuple(heads)))
    return StageTensors(ranks)


def start_prefill(backend, kv: StageTensors, pool: PagePool):
    service = BootstrapServer(port=0)
    sender = KVSender(kv, 0, release=lambda room, pages: pool.release(pages), backend=backend,
                      timing=FAST)
    register_stage(service.endpoint, sender.registration(
        pp_size=1, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM,
        model_fingerprint="tiny"))
    return service, sender


CASES = [
    (PREFILL_MAP, [[0, 1, 2]]),            # TP 2 -> TP 1
    ([[0, 1, 2]], [[0, 1], [2]]),          # TP 1 -> TP 2
    (PREFILL_MAP, [[0], [0], [1], [2]]),   # TP 2 -> TP 4, head 0 on two decode ranks
    (PREFILL_MAP, PREFILL_MAP),            # same TP: whole pages
]
IDS = ["tp2-tp1", "tp1-tp2", "tp2-tp4", "tp2-tp2"]
# Mooncake's engines take seconds to start and stop: slow.
BACKENDS = ["tcp"] + [pytest.param(b, marks=[pytest.mark.slow, pytest.mark.skipif(
    not have_mooncake(), reason="mooncake-transfer-engine-non-cuda is not installed")])
    for b in ("mooncake-staged", "mooncake-direct")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src_map, dst_map", CASES, ids=IDS)
def test_each_decode_rank_gets_exactly_its_heads(backend, src_map, dst_map):
    full = full_pages(7)
    src_pool, dst_pool = PagePool(PAGES), PagePool(PAGES)
    src_kv, dst_kv = stage(src_map, full), stage(dst_map)
    transport = backend.split("-")[0]
    service, sender = start_prefill(transport, src_kv, src_pool)
    # 0: no staging region, writes straight into the pages
    staging = {"mooncake-direct": 0, "mooncake-staged": 1 << 20}.get(backend)
    receiver = KVReceiver(dst_kv, release=lambda room, pages: dst_pool.release(pages),
                          backend=transport, timing=FAST, staging_bytes=staging)
    try:
        info = lookup_prefill(service.endpoint, 10)
        check_compatible(info, page_size=PAGE, kv_dtype="float32", model_fingerprint="tiny",
                         backend=transport, num_layers=LAYERS, kv_heads=dst_kv.head_map)
        receiver.connect("p", info)
        num_pages = 13
        src, dst = src_pool.allocate(num_pages), dst_pool.allocate(num_pages)
        random.Random(1).shuffle(src)
        random.Random(2).shuffle(dst)
        receiver.expect_room(ROOM, "p", dst, num_prompt_tokens=num_pages * PAGE - 5)
        sender.open_room(ROOM, sends_final=True)
        for first in range(0, num_pages, 5):  # chunk by chunk: 5, 5, 3 pages
            sender.send_pages(ROOM, first, src[first:first + 5],
                              is_last=first + 5 >= num_pages)
        sender.send_final(ROOM, m.FinalMeta(ROOM, 0, num_pages * PAGE - 5, 42))
        res = receiver.wait_room(ROOM, 30)
        assert res.ok, res
        for rank, heads in zip(dst_kv.ranks, dst_map):
            for which, t in (("k", full[0]), ("v", full[1])):
                got = getattr(rank, which).view(LAYERS, PAGES, PAGE, len(heads), DIM)
                want = t.view(LAYERS, PAGES, PAGE, KV_HEADS, DIM)[:, :, :, heads]
                assert torch.equal(got[:, dst], want[:, src])
                untouched = sorted(set(range(PAGES)) - set(dst))
                assert not got[:, untouched].any()
        if backend == "mooncake-staged":
            assert sender.data.num_staged_chunks == 3
        assert wait_until(lambda: src_pool.num_free == PAGES)
    finally:
        receiver.close()
        sender.close()
        service.close()


def test_a_decode_whose_heads_the_prefill_cannot_give_is_refused_at_connect():
    """A prefill stage that says its ranks hold only heads 0-1 of 3 (a stage that lost a
    rank's share, or a hostile answer): the decode refuses it with a sentence."""
    service = BootstrapServer(port=0)
    pool = PagePool(PAGES)
    sender = KVSender(stage(PREFILL_MAP, full_pages(1)), 0,
                      release=lambda room, pages: pool.release(pages), timing=FAST)
    try:
        reg = sender.registration(pp_size=1, num_layers=LAYERS, num_kv_heads=KV_HEADS,
                                  head_dim=DIM, model_fingerprint="tiny")
        register_stage(service.endpoint, m.RegisterStage(
            **{f: getattr(reg, f) for f in reg.__struct_fields__ if f != "kv_heads"},
            kv_heads=[[0, 1], [1]]))
        info = lookup_prefill(service.endpoint, 10)
        with pytest.raises(ValueError, match="cannot give this decode's TP ranks their KV "
                                             "heads: .*hold no copy of KV head 2"):
            check_compatible(info, page_size=PAGE, kv_dtype="float32",
                             model_fingerprint="tiny", backend="tcp", num_layers=LAYERS,
                             kv_heads=[[0, 1, 2]])
    finally:
        sender.close()
        service.close()
