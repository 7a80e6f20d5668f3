"""KV page transfer: random pages into shuffled pre-allocated pages, byte-exact, over tcp (and
Mooncake where installed); failures release every page on both sides.

The fast tests run senders and receiver on threads of this process over real sockets; the slow
ones run the sender as its own process and kill or stop it mid-transfer."""
from __future__ import annotations

import json
import os
import re
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import wait_until
from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import BootstrapServer, lookup_prefill, register_stage
from pipefill.disagg.transfer import KVTensors, StageTensors, Timing
from pipefill.disagg.transfer_receiver import KVReceiver
from pipefill.disagg.transfer_sender import KVSender
from pipefill.kv.pool import PagePool

LAYERS, PAGES, PAGE, HEADS, DIM = 4, 48, 16, 2, 32
ROOM = 0x7EADBEEF12345678
FAST = Timing(bootstrap_timeout_s=20, waiting_timeout_s=20, heartbeat_interval_s=0.2,
              heartbeat_max_misses=3)


def have_mooncake() -> bool:
    try:
        import mooncake.engine  # noqa: F401
        return True
    except ImportError:
        return False


BACKENDS = ["tcp", pytest.param("mooncake", marks=pytest.mark.skipif(
    not have_mooncake(), reason="mooncake-transfer-engine-non-cuda is not installed"))]


def random_kv(seed: int, layer_start: int, num_layers: int, dtype=torch.float32) -> KVTensors:
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, PAGES * PAGE, HEADS, DIM)
    return KVTensors(torch.randn(shape, generator=g).to(dtype),
                     torch.randn(shape, generator=g).to(dtype), PAGE, layer_start)


class Pool:
    def __init__(self):
        self.pool, self.lock = PagePool(PAGES), threading.Lock()

    def release(self, room, pages):
        with self.lock:
            self.pool.release(pages)

    def clean(self) -> bool:
        with self.lock:
            self.pool.check_integrity()
            return self.pool.num_free == PAGES


def assert_pages_equal(src: KVTensors, src_pages, dst: KVTensors, dst_pages):
    # A sender's or receiver's kv is a StageTensors: here of one rank.
    src, dst = (StageTensors.of(t).ranks[0] for t in (src, dst))
    for layer in range(src.layer_start, src.layer_end):
        for a, b in ((src.k, dst.k), (src.v, dst.v)):
            assert torch.equal(src.pages(a, layer)[src_pages], dst.pages(b, layer)[dst_pages])


def start_prefill(backend, dtype, secret=None, timing=FAST):
    """A bootstrap service and two prefill stages (layers [0, 2) and [2, 4)) in this process."""
    service = BootstrapServer(port=0, secret=secret)
    pools = [Pool(), Pool()]
    senders = [KVSender(random_kv(10 + r, 2 * r, 2, dtype), r, release=pools[r].release,
                        backend=backend, timing=timing, secret=secret) for r in range(2)]
    for s in senders:
        register_stage(service.endpoint, s.registration(
            pp_size=2, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
            model_fingerprint="tiny"), secret=secret)
    return service, senders, pools


def send_request(senders, pools, num_pages, room=ROOM, last_chunk=True, num_tokens=None):
    """Each stage sends the request's pages in two chunks; the last stage sends the final."""
    src = []
    for s, pool in zip(senders, pools):
        pages = pool.pool.allocate(num_pages)
        random.Random(s.rank).shuffle(pages)
        src.append(pages)
        s.open_room(room, sends_final=s.rank == 1)
        half = num_pages // 2
        s.send_pages(room, 0, pages[:half])
        if last_chunk:
            s.send_pages(room, half, pages[half:], is_last=True)
        else:  # never handed to the sender: the test gives them back itself
            pool.release(room, pages[half:])
    if last_chunk:
        senders[1].send_final(room, m.FinalMeta(room, 0, num_tokens or num_pages * PAGE, 42,
                                                -0.5, [(42, -0.5), (7, -1.5)]))
    return src


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_stages_into_shuffled_pages(backend, dtype):
    service, senders, src_pools = start_prefill(backend, dtype)
    dst_pool = Pool()
    kv = KVTensors(torch.zeros(LAYERS, PAGES * PAGE, HEADS, DIM, dtype=dtype),
                   torch.zeros(LAYERS, PAGES * PAGE, HEADS, DIM, dtype=dtype), PAGE)
    receiver = KVReceiver(kv, release=dst_pool.release, backend=backend, timing=FAST)
    try:
        receiver.connect("p", lookup_prefill(service.endpoint, 10))
        assert receiver.progress(ROOM) is None and receiver.take_finished() == []
        num_pages = 21
        dst = dst_pool.pool.allocate(PAGES)[::-1][:num_pages]  # reversed: no two consecutive
        random.Random(5).shuffle(dst)
        receiver.expect_room(ROOM, "p", dst, num_prompt_tokens=num_pages * PAGE - 3)
        src = send_request(senders, src_pools, num_pages, num_tokens=num_pages * PAGE - 3)
        assert wait_until(lambda: receiver.progress(ROOM) is None, 30)  # ended
        res, = receiver.take_finished()  # what a polling decode loop would do
        assert res.ok, res
        assert res.pages == dst and (res.final.first_token, res.final.logprob) == (42, -0.5)
        assert res.final.top_logprobs == [(42, -0.5), (7, -1.5)]
        for s, pages in zip(senders, src):
            assert_pages_equal(s.kv, pages, kv, dst)
        # The prefill pages came back once the room succeeded; the decode's are the caller's.
        assert wait_until(lambda: all(p.clean() for p in src_pools))
        assert dst_pool.pool.num_free == PAGES - PAGES  # nothing released on success
    finally:
        receiver.close()
        for s in senders:
            s.close()
        service.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("decode_split", [2, 3], ids=["same-partition", "other-partition"])
def test_decode_pipeline_of_two_stages(decode_split, backend):
    """Decode PP 2: each decode stage takes only its layers, from whichever prefill stages hold
    them (with another partition, prefill stage 1 serves both decode stages); with mooncake,
    each (decode stage, prefill stage) pair through its own staging region."""
    service, senders, src_pools = start_prefill(backend, torch.float32)
    ranges = [(0, decode_split), (decode_split, LAYERS)]
    pools = [Pool(), Pool()]
    kvs = [random_kv(50 + i, ls, le - ls) for i, (ls, le) in enumerate(ranges)]
    receivers = [KVReceiver(kv, release=pool.release, timing=FAST, backend=backend)
                 for kv, pool in zip(kvs, pools)]
    try:
        info = lookup_prefill(service.endpoint, 10)
        dsts = []
        for i, r in enumerate(receivers):
            r.connect("p", info, decode_layer_ranges=ranges)
            dsts.append(pools[i].pool.allocate(PAGES)[::-1][:5])
            # The final metadata comes from prefill stage 1: to the decode stages it serves.
            r.expect_room(ROOM, "p", dsts[i], want_final=i == 1 or decode_split == 3)
        src = send_request(senders, src_pools, 5)
        for r in receivers:
            assert r.wait_room(ROOM, 30).ok
        for sender, pages in zip(senders, src):
            for kv, dst in zip(kvs, dsts):
                for layer in range(max(kv.layer_start, sender.kv.layer_start),
                                   min(kv.layer_end, sender.kv.layer_end)):
                    for a, b in ((sender.kv.k, kv.k), (sender.kv.v, kv.v)):
                        assert torch.equal(sender.kv.ranks[0].pages(a, layer)[pages],
                                           kv.pages(b, layer)[dst])
        assert wait_until(lambda: all(p.clean() for p in src_pools))
        if backend == "mooncake":  # 2 chunks per (prefill stage, decode stage) pair, staged
            assert sum(s.data.num_staged_chunks for s in senders) == 2 * (2 + decode_split - 2)
            assert all(r.data.staging_in_use() == 0 for r in receivers)
    finally:
        for r in receivers:
            r.close()
        for sender in senders:
            sender.close()
        service.close()


def test_hmac_sealed_transfer_and_a_room_that_never_comes():
    secret = b"cluster-secret"
    timing = Timing(bootstrap_timeout_s=20, waiting_timeout_s=1.0, heartbeat_interval_s=0.2,
                    heartbeat_max_misses=3)
    service, senders, src_pools = start_prefill("tcp", torch.float32, secret, timing)
    dst_pool = Pool()
    kv = random_kv(0, 0, LAYERS)
    receiver = KVReceiver(kv, release=dst_pool.release, timing=timing, secret=secret)
    try:
        receiver.connect("p", lookup_prefill(service.endpoint, 10, secret=secret))
        dst = dst_pool.pool.allocate(4)
        receiver.expect_room(ROOM, "p", dst)
        src = send_request(senders, src_pools, 4)
        assert receiver.wait_room(ROOM, 30).ok
        assert_pages_equal(senders[0].kv, src[0], kv, dst)
        dst_pool.release(ROOM, dst)
        # No prefill ever opens room 7: the decode gives up after the waiting timeout, tells
        # the prefill stages to drop it, and frees its pages.
        receiver.expect_room(7, "p", dst_pool.pool.allocate(3))
        res = receiver.wait_room(7, 30)
        assert not res.ok and "--disaggregation-waiting-timeout" in res.reason
        assert dst_pool.clean()
        assert wait_until(lambda: all(p.clean() for p in src_pools))
    finally:
        receiver.close()
        for s in senders:
            s.close()
        service.close()


def test_a_prefill_that_heartbeats_but_stalls_loses_the_room():
    """The lease: both stages start the room (first chunk sent), then stall while their
    heartbeats, every 0.2 s, keep naming it; the decode fails it after the waiting timeout and
    both sides free its pages."""
    timing = Timing(bootstrap_timeout_s=20, waiting_timeout_s=1.0, heartbeat_interval_s=0.2,
                    heartbeat_max_misses=3)
    service, senders, src_pools = start_prefill("tcp", torch.float32, timing=timing)
    dst_pool = Pool()
    receiver = KVReceiver(random_kv(0, 0, LAYERS), release=dst_pool.release, timing=timing)
    try:
        receiver.connect("p", lookup_prefill(service.endpoint, 10))
        receiver.expect_room(ROOM, "p", dst_pool.pool.allocate(8))
        send_request(senders, src_pools, 8, last_chunk=False)
        assert wait_until(lambda: receiver.progress(ROOM) == {"p/0": 4, "p/1": 4})
        assert all(s.rooms.heartbeat_rooms() == [ROOM] for s in senders)
        start = time.monotonic()
        res = receiver.wait_room(ROOM, 30)
        assert not res.ok and "--disaggregation-waiting-timeout" in res.reason
        assert time.monotonic() - start < 10  # not renewed by the heartbeats
        assert wait_until(dst_pool.clean)
        assert wait_until(lambda: all(p.clean() for p in src_pools))  # the drop reached them
    finally:
        receiver.close()
        for s in senders:
            s.close()
        service.close()


def test_prefill_abort_reaches_the_decode_and_frees_both_sides():
    service, senders, src_pools = start_prefill("tcp", torch.float32)
    dst_pool = Pool()
    receiver = KVReceiver(random_kv(0, 0, LAYERS), release=dst_pool.release, timing=FAST)
    try:
        receiver.connect("p", lookup_prefill(service.endpoint, 10))
        receiver.expect_room(ROOM, "p", dst_pool.pool.allocate(8))
        send_request(senders, src_pools, 8, last_chunk=False)
        senders[0].fail_room(ROOM, "the prompt is longer than --max-model-len")
        res = receiver.wait_room(ROOM, 30)
        assert not res.ok and "--max-model-len" in res.reason
        assert wait_until(dst_pool.clean)
        # Stage 1 hears the decode's drop and frees its pages too.
        assert wait_until(lambda: all(p.clean() for p in src_pools))
    finally:
        receiver.close()
        for s in senders:
            s.close()
        service.close()


@pytest.mark.parametrize("layout", ["token-major", "amx-packed"])
def test_the_engines_kv_caches_by_layout(layout):
    """KVTensors.from_cache over the engine's own cache classes: KVCache and AmxKVCache."""
    from pipefill.kernels.amx_attention import AmxKVCache
    from pipefill.kv.cache import KVCache

    def cache():
        if layout == "amx-packed":
            return AmxKVCache(LAYERS, PAGES, 32, HEADS, 64)
        return KVCache(LAYERS, PAGES, 32, HEADS, 64, torch.bfloat16)
    src_cache, dst_cache = cache(), cache()
    for t in (src_cache.k, src_cache.v, dst_cache.k, dst_cache.v):
        t.copy_(torch.randn(t.shape))
    src_kv, dst_kv = KVTensors.from_cache(src_cache, 0), KVTensors.from_cache(dst_cache, 0)
    assert src_kv.layout == layout and src_kv.num_pages == PAGES
    service, src_pool, dst_pool = BootstrapServer(port=0), Pool(), Pool()
    sender = KVSender(src_kv, 0, release=src_pool.release, timing=FAST)
    receiver = KVReceiver(dst_kv, release=dst_pool.release, timing=FAST)
    try:
        register_stage(service.endpoint, sender.registration(
            pp_size=1, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=64,
            model_fingerprint="tiny"))
        info = lookup_prefill(service.endpoint, 10)
        assert info.stages[0].kv_layout == layout
        receiver.connect("p", info)
        src, dst = src_pool.pool.allocate(5), dst_pool.pool.allocate(PAGES)[-5:][::-1]
        receiver.expect_room(ROOM, "p", dst, want_final=False)
        sender.open_room(ROOM)
        sender.send_pages(ROOM, 0, src, is_last=True)
        assert receiver.wait_room(ROOM, 30).ok
        if layout == "amx-packed":  # [layers, pages, heads, page_size, head_dim]
            assert torch.equal(src_cache.k[:, src], dst_cache.k[:, dst])
            assert torch.equal(src_cache.v[:, src], dst_cache.v[:, dst])
        else:
            assert_pages_equal(src_kv, src, dst_kv, dst)
        assert wait_until(src_pool.clean)
    finally:
        receiver.close()
        sender.close()
        service.close()


def test_prefill_stage_restart_fails_old_rooms_then_reconnects():
    service, senders, src_pools = start_prefill("tcp", torch.float32)
    dst_pool = Pool()
    kv = random_kv(0, 0, LAYERS)
    receiver = KVReceiver(kv, release=dst_pool.release, timing=FAST)
    try:
        receiver.connect("p", lookup_prefill(service.endpoint, 10))
        receiver.expect_room(ROOM, "p", dst_pool.pool.allocate(4))
        senders[1].close()  # stage 1 goes away and comes back on another port
        res = receiver.wait_room(ROOM, 30)
        # Its reason if the room had reached it, else the closed connection's.
        assert not res.ok and ("the prefill stage is shutting down" in res.reason
                               or "p/1 stopped answering" in res.reason)
        assert wait_until(dst_pool.clean) and wait_until(lambda: not receiver.connected("p"))
        with pytest.raises(RuntimeError, match="connect"):  # not silently waiting for nobody
            receiver.expect_room(ROOM + 5, "p", [])
        senders[1] = KVSender(random_kv(11, 2, 2), 1, release=src_pools[1].release,
                              timing=FAST)
        register_stage(service.endpoint, senders[1].registration(
            pp_size=2, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
            model_fingerprint="tiny"))
        receiver.connect("p", lookup_prefill(service.endpoint, 10))
        assert receiver.connected("p")
        dst = dst_pool.pool.allocate(6)
        receiver.expect_room(ROOM + 1, "p", dst)
        src = send_request(senders, src_pools, 6, room=ROOM + 1)
        assert receiver.wait_room(ROOM + 1, 30).ok
        for sender, pages in zip(senders, src):
            assert_pages_equal(sender.kv, pages, kv, dst)
    finally:
        receiver.close()
        for sender in senders:
            sender.close()
        service.close()


# ------------------------------------------------------------ separate processes

SENDER = r"""
import json, random, sys, time, torch
from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import BootstrapServer, register_stage
from pipefill.disagg.transfer import KVTensors, Timing
from pipefill.disagg.transfer_sender import KVSender
backend, mode, room, num_pages = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
L, P, PAGE, H, D = 4, 48, 16, 2, 32
g = torch.Generator().manual_seed(10)
kv = KVTensors(torch.randn(L, P * PAGE, H, D, generator=g), torch.randn(L, P * PAGE, H, D,
               generator=g), PAGE, 0)
released = []
sender = KVSender(kv, 0, release=lambda r, p: released.append(p), backend=backend,
                  timing=Timing(20, 20, 0.2, 3))
service = BootstrapServer(port=0)
register_stage(service.endpoint, sender.registration(pp_size=1, num_layers=L, num_kv_heads=H,
               head_dim=D, model_fingerprint="tiny"))
src = list(range(num_pages)); random.Random(3).shuffle(src)
print(json.dumps({"port": service.endpoint.port, "src": src}), flush=True)
sender.open_room(room, sends_final=True)
sender.send_pages(room, 0, src[:num_pages // 2])
if mode == "full":
    sender.send_pages(room, num_pages // 2, src[num_pages // 2:], is_last=True)
    sender.send_final(room, m.FinalMeta(room, 0, num_pages * PAGE, 1))
sys.stdin.read()  # until the test closes our stdin (or kills us)
print(json.dumps({"released": released}), flush=True)
"""


def spawn_sender(backend, mode, num_pages):
    proc = subprocess.Popen([sys.executable, "-c", SENDER, backend, mode, str(ROOM),
                             str(num_pages)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "GLOG_minloglevel": "2"})
    info = json.loads(proc.stdout.readline())
    return proc, info


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", [None, "kill", "stop"])
def test_sender_process(backend, fault):
    num_pages = 24
    proc, info = spawn_sender(backend, "full" if fault is None else "stall", num_pages)
    dst_pool = Pool()
    kv = KVTensors(torch.zeros(LAYERS, PAGES * PAGE, HEADS, DIM),
                   torch.zeros(LAYERS, PAGES * PAGE, HEADS, DIM), PAGE)
    receiver = KVReceiver(kv, release=dst_pool.release, backend=backend,
                          timing=Timing(20, 20, 0.5, 4))
    try:
        receiver.connect("p", lookup_prefill(m.Endpoint("127.0.0.1", info["port"]), 60))
        dst = dst_pool.pool.allocate(num_pages)
        random.Random(8).shuffle(dst)
        receiver.expect_room(ROOM, "p", dst)
        if fault is None:
            res = receiver.wait_room(ROOM, 60)
            assert res.ok, res
            assert_pages_equal(random_kv(10, 0, LAYERS), info["src"], kv, dst)
            proc.stdin.close()
            assert json.loads(proc.stdout.readline())["released"] == [
                info["src"][:num_pages // 2] + info["src"][num_pages // 2:]]
            return
        # The first chunk lands, then the sender dies (a socket error) or hangs (heartbeats).
        assert wait_until(lambda: len(receiver.rooms.live[ROOM].delivered) == 1, 30)
        os.kill(proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        start = time.monotonic()
        res = receiver.wait_room(ROOM, 30)
        assert res is not None and not res.ok and "stopped answering" in res.reason
        assert time.monotonic() - start < 2 + 0.5 * 4  # within the heartbeat window
        assert wait_until(dst_pool.clean, 10)  # the drain grace bounds one-sided transports
    finally:
        receiver.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_bench_kv_transfer_runs_and_checks_pages():
    out = subprocess.run([sys.executable, "-m", "pipefill.cli.main", "bench", "kv-transfer",
                          "--input-len", "300", "--chunk-size", "128", "--layers", "2",
                          "--backends", "tcp", "--dtypes", "bfloat16", "--reps", "2",
                          "--auth", "off,on"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "GB/s" in out.stdout and "local copy" in out.stdout
    # Repetitions alternate the cases; the secret's cost is a paired median with its spread.
    assert out.stdout.count("repetition 2:") == out.stdout.count("repetition 1:") >= 2
    assert re.search(r"tcp \+auth .* = [\d.]+ \[[\d.]+-[\d.]+\] x without the secret",
                     out.stdout), out.stdout


DECODER = r"""
import sys, torch
from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import lookup_prefill
from pipefill.disagg.transfer import KVTensors, Timing
from pipefill.disagg.transfer_receiver import KVReceiver
backend, port, room = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kv = KVTensors(torch.zeros(4, 48 * 16, 2, 32), torch.zeros(4, 48 * 16, 2, 32), 16, 0)
receiver = KVReceiver(kv, release=lambda r, p: None, backend=backend,
                      timing=Timing(20, 20, 0.2, 3))
receiver.connect("p", lookup_prefill(m.Endpoint("127.0.0.1", port), 60))
receiver.expect_room(room, "p", list(range(47, 23, -1)))
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_decode_process_dies_mid_transfer_prefill_frees_its_pages(backend, fault):
    service, senders, pools = start_prefill(backend, torch.float32)
    proc = subprocess.Popen([sys.executable, "-c", DECODER, backend, str(service.endpoint.port),
                             str(ROOM)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "GLOG_minloglevel": "2"})
    try:
        assert proc.stdout.readline().strip() == "ready"
        send_request(senders, pools, 24, last_chunk=False)  # half the pages, then silence
        assert wait_until(lambda: all(s.bytes_sent > 0 for s in senders), 30)
        assert not any(p.clean() for p in pools)  # the room holds its pages
        os.kill(proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        # A socket error frees them at once, missing heartbeats within 0.2 s * 3 (+ ticks).
        assert wait_until(lambda: all(p.clean() for p in pools), 10)
        assert all(not s.rooms.live for s in senders)
    finally:
        for s in senders:
            s.close()
        service.close()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


# ------------------------------------------------------------ mooncake staging

def test_staging_arena_first_fit_merges_and_refuses_a_double_free():
    from pipefill.disagg.transfer_mooncake import ALIGN, Arena, fragmented
    a = Arena(10 * ALIGN)
    x, y, z = a.alloc(1), a.alloc(3 * ALIGN), a.alloc(ALIGN + 1)
    assert (x, y, z) == (0, ALIGN, 4 * ALIGN)
    assert a.alloc(5 * ALIGN) is None  # 4 left
    a.release(y)
    assert a.alloc(2 * ALIGN) == ALIGN  # first fit, into the hole
    for off in (x, ALIGN, z):
        a.release(off)
    assert a.free == [(0, 10 * ALIGN)] and not a.used
    with pytest.raises(KeyError):
        a.release(0)
    assert not fragmented([]) and not fragmented([5]) and not fragmented(list(range(8)))
    assert fragmented(list(range(8))[::-1]) and fragmented([0, 1, 2, 10, 11, 12])
    assert not fragmented([0, 1, 2, 3, 10, 11, 12, 13])


@pytest.mark.skipif(not have_mooncake(), reason="mooncake-transfer-engine-non-cuda is not "
                    "installed")
@pytest.mark.parametrize("case,dtype", [
    ("staged", torch.float32), ("staged", torch.bfloat16),
    ("arena-for-one-stage", torch.bfloat16), ("staging-off", torch.float32),
    ("consecutive-pages", torch.bfloat16)], ids=str)
def test_mooncake_into_shuffled_pages(case, dtype):
    """Shuffled source and destination pages, byte-exact: staged (one block per chunk), the
    arena too small for the second stage (that stage writes page runs straight), staging off,
    and consecutive destination pages (never staged: runs are already long)."""
    service, senders, src_pools = start_prefill("mooncake", dtype)
    num_pages, dst_pool = 21, Pool()
    kv = KVTensors(torch.zeros(LAYERS, PAGES * PAGE, HEADS, DIM, dtype=dtype),
                   torch.zeros(LAYERS, PAGES * PAGE, HEADS, DIM, dtype=dtype), PAGE)
    region = num_pages * 2 * 2 * kv.page_bytes  # one prefill stage's two layers
    staging = {"staged": 2 * region, "arena-for-one-stage": region + region // 2,
               "staging-off": 0, "consecutive-pages": 2 * region}[case]
    receiver = KVReceiver(kv, release=dst_pool.release, backend="mooncake", timing=FAST,
                          staging_bytes=staging)
    try:
        receiver.connect("p", lookup_prefill(service.endpoint, 10))
        dst = dst_pool.pool.allocate(num_pages)
        if case != "consecutive-pages":
            random.Random(5).shuffle(dst)
        receiver.expect_room(ROOM, "p", dst, num_prompt_tokens=num_pages * PAGE)
        src = send_request(senders, src_pools, num_pages)
        res = receiver.wait_room(ROOM, 30)
        assert res.ok, res
        for s, pages in zip(senders, src):
            assert_pages_equal(s.kv, pages, kv, dst)
        staged = sorted(s.data.num_staged_chunks for s in senders)
        assert staged == {"staged": [2, 2], "arena-for-one-stage": [0, 2],
                          "staging-off": [0, 0], "consecutive-pages": [0, 0]}[case]
        assert receiver.data.staging_in_use() == 0  # handed over with the pages
        assert not receiver.data._arena.used
        assert wait_until(lambda: all(p.clean() for p in src_pools))
    finally:
        receiver.close()
        for s in senders:
            s.close()
        service.close()


@pytest.mark.skipif(not have_mooncake(), reason="mooncake-transfer-engine-non-cuda is not "
                    "installed")
def test_mooncake_sender_killed_mid_transfer_leaves_nothing_stale():
    """A prefill process killed after its first staged chunk: the decode fails the room, frees
    its pages and its staging region once; the next room into the same pages (and the same
    staging bytes) from another prefill is byte-exact."""
    num_pages, dst_pool = 24, Pool()
    kv = KVTensors(torch.zeros(LAYERS, PAGES * PAGE, HEADS, DIM),
                   torch.zeros(LAYERS, PAGES * PAGE, HEADS, DIM), PAGE)
    released = []

    def release(room, pages):
        released.append((room, receiver.data.staging_in_use()))
        dst_pool.release(room, pages)
    receiver = KVReceiver(kv, release=release, backend="mooncake",
                          timing=Timing(20, 20, 0.2, 3), staging_bytes=2 << 20)
    proc, info = spawn_sender("mooncake", "stall", num_pages)
    service = senders = None
    try:
        receiver.connect("dead", lookup_prefill(m.Endpoint("127.0.0.1", info["port"]), 60))
        dst = dst_pool.pool.allocate(num_pages)
        random.Random(8).shuffle(dst)
        receiver.expect_room(ROOM, "dead", dst)
        assert receiver.data.staging_in_use() == 1
        assert wait_until(lambda: len(receiver.rooms.live[ROOM].delivered) == 1, 30)
        os.kill(proc.pid, signal.SIGKILL)
        res = receiver.wait_room(ROOM, 30)
        assert not res.ok and "stopped answering" in res.reason
        assert wait_until(dst_pool.clean, 10)
        assert released == [(ROOM, 0)]  # once, its staging region freed with the pages
        assert not receiver.data._arena.used
        kv.k.zero_()
        kv.v.zero_()
        # Another prefill (two stages, other data), the same pages, the same staging bytes.
        service, senders, src_pools = start_prefill("mooncake", torch.float32)
        receiver.connect("p", lookup_prefill(service.endpoint, 10))
        dst = dst_pool.pool.allocate(num_pages)
        random.Random(8).shuffle(dst)
        receiver.expect_room(ROOM + 1, "p", dst)
        src = send_request(senders, src_pools, num_pages, room=ROOM + 1)
        assert receiver.wait_room(ROOM + 1, 30).ok
        for s, pages in zip(senders, src):
            assert s.data.num_staged_chunks == 2
            assert_pages_equal(s.kv, pages, kv, dst)
    finally:
        receiver.close()
        for s in senders or []:
            s.close()
        if service is not None:
            service.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
