"""Hostile peers on a prefill stage's KV port, over real sockets (prefill stages and the decode
on threads of this process, the hostile peer a raw connection that says it is a decode). No
cluster secret here: the unauthenticated case --disaggregation-insecure allows, where the
rooms themselves must hold. A room belongs to the decode that bootstrapped it: another peer's
bootstrap is refused and gets no KV, its drops change nothing, heartbeats name each peer's own
rooms; a room no decode claims frees its pages; made-up bootstraps hold bounded memory;
Mooncake destinations are checked against what the decode declared. Then the servers: a PD
role without a secret does not start, --disaggregation-insecure says so on /health, and
serve-pd makes its secret file."""
from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import threading
import time
import tracemalloc

import httpx
import pytest
import torch

from pipefill.cli.main import build_parser
from pipefill.cli.serve_pd import commands
from pipefill.disagg import channel as ch
from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import lookup_prefill
from pipefill.disagg.launch import deployment_secret
from pipefill.disagg.transfer import KVTensors, Timing
from pipefill.disagg.transfer_mooncake import (TransferFailed, check_bootstrap, check_hello,
                                               check_writes)
from pipefill.disagg.transfer_receiver import KVReceiver
from pipefill.disagg.transfer_sender import KVSender

from test_disagg_transfer import (FAST, LAYERS, PAGE, ROOM, Pool, assert_pages_equal,
                                  random_kv, send_request, start_prefill, wait_until)
from test_pd_router import (chat_model, free_port, metric, spawn_server, stop,  # noqa: F401
                            wait_healthy, wait_pages_free)


class RawDecode:
    """A connection to a prefill stage that says it is a decode stage and records every
    message it hears; it heartbeats, so the stage keeps it."""

    def __init__(self, endpoint: m.Endpoint, page_bytes: int, decode_id: str = "stranger",
                 layers: tuple[int, int] = (0, LAYERS)):
        self.conn = ch.connect(endpoint, 5.0, None, name=decode_id)
        self.conn.send(m.DecodeHello(decode_id, layers[0], layers[1], page_bytes))
        self.heard: list = []
        self.closed = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._beat, daemon=True).start()

    def send(self, msg: m.Message) -> None:
        self.conn.send(msg)

    def of(self, kind) -> list:
        return [msg for msg in list(self.heard) if isinstance(msg, kind)]

    def close(self) -> None:
        self.closed.set()
        self.conn.close()

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                self.heard.append(msg)
                if isinstance(msg, m.KVChunk) and msg.nbytes:
                    return  # page bytes follow: it got another request's KV, that is enough
        except ch.ConnectionClosed:
            pass

    def _beat(self) -> None:
        while not self.closed.wait(FAST.heartbeat_interval_s / 2):
            try:
                self.send(m.Heartbeat("stranger"))
            except ch.ConnectionClosed:
                return


@pytest.fixture
def pd():
    """Two prefill stages (layers [0, 2) and [2, 4)) and a decode connected to both."""
    service, senders, pools = start_prefill("tcp", torch.float32)
    dst_pool, kv = Pool(), random_kv(99, 0, LAYERS)
    receiver = KVReceiver(kv, release=dst_pool.release, backend="tcp", timing=FAST)
    receiver.connect("p", lookup_prefill(service.endpoint, 5))
    yield senders, pools, receiver, kv, dst_pool
    receiver.close()
    for s in senders:
        s.close()
    service.close()


def expect(receiver, dst_pool, senders, num_pages=8):
    """The decode asks for ROOM's KV; (destination pages, nonce) once both stages have it."""
    dst = dst_pool.pool.allocate(num_pages)
    nonce = receiver.expect_room(ROOM, "p", dst, num_prompt_tokens=num_pages * PAGE)
    assert wait_until(lambda: all(ROOM in s.rooms.live and s.rooms.live[ROOM].dests
                                  for s in senders))
    return dst, nonce


def check_delivered(receiver, senders, src, kv, dst) -> None:
    res = receiver.wait_room(ROOM, 15)
    assert res is not None and res.ok, res
    for s, pages in zip(senders, src):
        assert_pages_equal(s.kv, pages, kv, dst)


# ------------------------------------------------------------------ ownership on real sockets

def test_a_strangers_bootstrap_of_a_live_room_is_refused_and_gets_no_kv(pd):
    """On stage 0 the stranger even takes the decode's own id (a hijack); on stage 1 its own."""
    senders, pools, receiver, kv, dst_pool = pd
    dst, _ = expect(receiver, dst_pool, senders)
    strangers = [RawDecode(s.endpoint, s.kv.page_bytes, decode_id=name)
                 for s, name in zip(senders, (receiver.name, "stranger"))]
    try:
        for st in strangers:
            st.send(m.RoomBootstrap(ROOM, 5, list(range(8)), 1))
        wait_until(lambda: all(st.of(m.RoomFailed) for st in strangers), 2)
        src = send_request(senders, pools, 8)
        check_delivered(receiver, senders, src, kv, dst)
        time.sleep(3 * FAST.heartbeat_interval_s)
        for st in strangers:
            assert not st.of(m.KVChunk) and not st.of(m.FinalMeta), st.heard
            (failed,) = st.of(m.RoomFailed)
            assert failed.status == 409 and failed.nonce == 5
        assert all(p.clean() for p in pools)
    finally:
        for st in strangers:
            st.close()


def test_drops_from_a_non_owner_do_not_end_the_room(pd):
    senders, pools, receiver, kv, dst_pool = pd
    dst, nonce = expect(receiver, dst_pool, senders)
    strangers = [RawDecode(s.endpoint, s.kv.page_bytes) for s in senders]
    try:
        for st in strangers:  # a made-up nonce, then even the decode's own
            st.send(m.DropRoom(ROOM, 12345, "mine now"))
            st.send(m.DropRoom(ROOM, nonce, "mine now"))
        wait_until(lambda: all(len(st.of(m.DropAck)) == 2 for st in strangers), 2)
        assert all(ROOM in s.rooms.live for s in senders)
        src = send_request(senders, pools, 8)
        check_delivered(receiver, senders, src, kv, dst)
        assert all(len(st.of(m.DropAck)) == 2 for st in strangers)  # nothing of theirs to wait for
    finally:
        for st in strangers:
            st.close()


def test_heartbeats_name_only_the_peers_own_rooms():
    sender = KVSender(random_kv(1, 0, LAYERS), 0, release=Pool().release, timing=FAST)
    a, b, c = (RawDecode(sender.endpoint, sender.kv.page_bytes, decode_id=n) for n in "abc")
    try:
        for peer, room in ((a, 11), (b, 22)):
            sender.open_room(room)
            peer.send(m.RoomBootstrap(room, 1, [1, 2], 1))
        assert wait_until(lambda: all(len(sender.rooms.live[r].dests) == 1 for r in (11, 22)))
        t0 = len(a.of(m.Heartbeat))
        assert wait_until(lambda: len(a.of(m.Heartbeat)) >= t0 + 3)
        for peer, rooms in ((a, [11]), (b, [22])):
            assert peer.of(m.Heartbeat)[-1].rooms == rooms
        assert c.of(m.Heartbeat) and all(hb.rooms == [] for hb in c.of(m.Heartbeat))
        assert not any(22 in hb.rooms for hb in a.of(m.Heartbeat))
    finally:
        for peer in (a, b, c):
            peer.close()
        sender.close()


def test_a_tcp_stage_refuses_a_staging_address():
    sender = KVSender(random_kv(1, 0, LAYERS), 0, release=Pool().release, timing=FAST)
    peer = RawDecode(sender.endpoint, sender.kv.page_bytes)
    try:
        peer.send(m.RoomBootstrap(ROOM, 1, [1, 2], 1, staging_addr=0x7F0000000000))
        assert wait_until(lambda: peer.of(m.RoomFailed))
        assert peer.of(m.RoomFailed)[0].status == 400 and ROOM not in sender.rooms.live
    finally:
        peer.close()
        sender.close()


# ------------------------------------------------------------------ capacity

def test_a_room_no_decode_claims_frees_its_pages_within_the_claim_timeout():
    pool = Pool()
    timing = Timing(bootstrap_timeout_s=20, waiting_timeout_s=20, heartbeat_interval_s=0.2,
                    heartbeat_max_misses=3, claim_timeout_s=0.5)
    sender = KVSender(random_kv(1, 0, LAYERS), 0, release=pool.release, timing=timing)
    try:
        pages = pool.pool.allocate(6)
        t0 = time.monotonic()
        sender.open_room(ROOM, sends_final=True)
        sender.send_pages(ROOM, 0, pages, is_last=True)
        assert wait_until(pool.clean, 5)
        took = time.monotonic() - t0
        assert 0.5 <= took < 3, took
        late = RawDecode(sender.endpoint, sender.kv.page_bytes)
        late.send(m.RoomBootstrap(ROOM, 1, list(range(6)), 1))
        assert wait_until(lambda: late.of(m.RoomFailed))
        assert "--disaggregation-room-claim-timeout" in late.of(m.RoomFailed)[0].reason
        late.close()
    finally:
        sender.close()


def tiny_kv(num_pages: int) -> KVTensors:
    """One layer, one token a page, 4 bytes a page: a big pool that costs nothing."""
    t = torch.zeros(1, num_pages, 1, 1)
    return KVTensors(t, t.clone(), 1)


def test_made_up_bootstraps_hold_bounded_memory():
    """300 made-up rooms of 8,192 page ids each (about 7 MB on the wire) from one
    connection: as Python lists they would hold about 90 MB until they expire; the stage
    keeps at most two rooms' worth of this peer's page ids, 4 bytes each, refuses the rest
    with a 503, and a real decode's room still goes through."""
    pool_pages = 4096
    # Liveness lenient: tracemalloc slows the stage's reading on a busy machine.
    timing = Timing(heartbeat_interval_s=0.5, heartbeat_max_misses=20)
    sender = KVSender(tiny_kv(pool_pages), 0, release=lambda room, pages: None, timing=timing)
    flood = RawDecode(sender.endpoint, sender.kv.page_bytes, layers=(0, 1))
    ids = list(range(1000, 1000 + 2 * pool_pages))
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for room in range(300):
            flood.send(m.RoomBootstrap(room, 7, ids, 1))
        # Every bootstrap handled: a room held, or refused.
        assert wait_until(lambda: len(flood.of(m.RoomFailed)) + len(sender.rooms.live) == 300,
                          60)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
        flood.close()
    try:
        assert held < 2 << 20, f"{held / 2**20:.1f} MiB held after the flood"
        assert len(flood.of(m.RoomFailed)) == 298
        assert {f.status for f in flood.of(m.RoomFailed)} == {503}
        assert sender.rooms.pending.num_pages <= 2 * len(ids)
        decode = RawDecode(sender.endpoint, sender.kv.page_bytes, decode_id="real",
                           layers=(0, 1))
        sender.open_room(ROOM, sends_final=False)
        decode.send(m.RoomBootstrap(ROOM, 9, [3, 4], 1))
        sender.send_pages(ROOM, 0, [0, 1], is_last=True)
        assert wait_until(lambda: decode.of(m.KVChunk))
        decode.close()
    finally:
        sender.close()


# ------------------------------------------------------------------ mooncake destinations

PB = 4096  # page bytes
K0, V0, STAGING = 0x10000000, 0x20000000, 0x30000000


def mooncake_hello(**changes) -> m.DecodeHello:
    """A decode stage of layers [2, 4) with 100 pages per layer and a 1 MiB staging region."""
    fields = dict(decode_id="d", layer_start=2, layer_end=4, page_bytes=PB,
                  mooncake_session="127.0.0.1:12345", k_ptrs=[K0, K0 + 100 * PB],
                  v_ptrs=[V0, V0 + 100 * PB], kv_pages=100, staging_base=STAGING,
                  staging_bytes=1 << 20)
    fields.update(changes)
    return m.DecodeHello(**fields)


@pytest.mark.parametrize("changes,needle", [
    ({"mooncake_session": ""}, "did not publish a Mooncake session"),
    ({"k_ptrs": [K0]}, "declared 1 K and 2 V buffers for its 2 layers"),
    ({"kv_pages": 0}, "no KV pages"),
    ({"v_ptrs": [K0 + 50 * PB, V0]}, "overlapping buffers"),
    ({"staging_base": K0 + PB}, "overlapping buffers"),
    ({"k_ptrs": [0, K0]}, "outside the address space"),
    ({"v_ptrs": [V0, (1 << 64) - PB]}, "outside the address space")])
def test_mooncake_hello_with_bad_buffers_is_refused(changes, needle):
    assert check_hello(mooncake_hello(), [PB]) is None
    why = check_hello(mooncake_hello(**changes), [PB])
    assert why is not None and needle in why


@pytest.mark.parametrize("pages,staging,needle", [
    ([0, 99], 0, None), ([0, 100], 0, "names page 100; the decode declared 100 pages"),
    ([0, 1], STAGING, None),
    ([0, 1], STAGING + (1 << 20) - 2 * 2 * 2 * PB, None),  # ends exactly at the region's end
    ([0, 1], STAGING + (1 << 20) - 2 * 2 * 2 * PB + 1, "is not inside"),
    ([0, 1], STAGING - PB, "is not inside"),
    ([0, 1], K0, "is not inside")])
def test_mooncake_room_pages_and_staging_must_be_the_decodes_own(pages, staging, needle):
    msg = m.RoomBootstrap(ROOM, 1, pages, 1, staging)
    why = check_bootstrap(mooncake_hello(), msg, (2, 4), [PB])  # two layers of K and V
    assert why == needle if needle is None else needle in why


def test_mooncake_writes_outside_the_declared_buffers_never_leave():
    hello = mooncake_hello()
    check_writes(hello, [PB], [(1, K0, 100 * PB), (1, V0 + 100 * PB + 99 * PB, PB),
                               (1, STAGING + 5, (1 << 20) - 5)])
    for dst, n in ((K0 + 99 * PB, 2 * PB), (K0 - 1, 2), (STAGING + (1 << 20), 1),
                   (0x40000000, 8), (K0, -1)):
        with pytest.raises(TransferFailed, match="outside the buffers"):
            check_writes(hello, [PB], [(1, K0, PB), (1, dst, n)])


W0 = 0x50000000  # a window layer's K; its V 16 pages above


def windowed_hello(**changes) -> m.DecodeHello:
    """Layers [2, 5), layer 3 a window layer with window pages of its own: 10 of them."""
    fields = dict(layer_end=5, window_layers=[3], window_k_ptrs=[W0],
                  window_v_ptrs=[W0 + 16 * PB], window_kv_pages=10)
    fields.update(changes)
    return mooncake_hello(**fields)


@pytest.mark.parametrize("changes,needle", [
    ({"window_k_ptrs": []}, "declared 0 K and 1 V window buffers for its 1 window layers"),
    ({"window_layers": []}, "declared 2 K and 2 V buffers for its 3 layers"),
    ({"window_v_ptrs": [W0 + 5 * PB]}, "overlapping buffers"),
    ({"window_kv_pages": 0}, "no KV pages")])
def test_mooncake_window_buffers_are_declared_apart_and_checked(changes, needle):
    """A decode whose window layers keep pages of their own declares them apart
    (ARCHITECTURE.md, 'Window pages'); a room's window pages and every write stay in them."""
    assert check_hello(windowed_hello(), [PB]) is None
    why = check_hello(windowed_hello(**changes), [PB])
    assert why is not None and needle in why
    msg = m.RoomBootstrap(ROOM, 1, [0, 1], 1, dst_window_pages=[-1, 10])
    assert "names window page 10; the decode declared 10" in \
        check_bootstrap(windowed_hello(), msg, (2, 5), [PB])
    check_writes(windowed_hello(), [PB], [(1, W0 + 9 * PB, PB), (1, W0 + 16 * PB, 10 * PB)])
    with pytest.raises(TransferFailed, match="outside the buffers"):
        check_writes(windowed_hello(), [PB], [(1, W0 + 10 * PB, PB)])


# ------------------------------------------------------------------ servers and secrets

def test_a_pd_server_without_a_secret_does_not_start():
    out = subprocess.run([sys.executable, "-m", "pipefill.cli.main", "serve",
                          "--disaggregation-mode", "prefill", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--disaggregation-mode prefill needs the deployment's shared secret" in out.stderr
    assert "--cluster-secret-file" in out.stderr and "--disaggregation-insecure" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_pd_makes_a_private_secret_file_for_both_servers():
    ns = build_parser().parse_args(["serve-pd"])
    with deployment_secret([]) as flags:
        path = flags[1]
        assert flags[0] == "--cluster-secret-file"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert len(open(path).read()) == 64
        prefill, decode, _, _ = commands(ns, flags)
        for cmd in (prefill, decode):
            assert cmd[cmd.index("--cluster-secret-file") + 1] == path
    assert not os.path.exists(os.path.dirname(path))
    for own in (["--cluster-secret-file", "/x"], ["--cluster-secret=abc"],
                ["--disaggregation-insecure"]):
        with deployment_secret(own) as flags:
            assert flags == []


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_an_insecure_prefill_says_so_and_frees_unclaimed_rooms_at_the_claim_timeout(
        chat_model, tmp_path):
    """--disaggregation-insecure: a WARNING at start and on /health. One running slot
    (--max-running-requests 1) and requests whose rooms no decode ever claims: each frees its
    pages and the slot at the 2 s claim timeout, so three in a row take seconds, not the
    bootstrap timeout (120 s) each."""
    bport = free_port()
    log = tmp_path / "prefill.log"
    with open(log, "w") as f:
        proc, url = spawn_server(chat_model, "--disaggregation-mode", "prefill",
                                 "--disaggregation-bootstrap-port", str(bport),
                                 "--disaggregation-insecure", "--max-running-requests", "1",
                                 "--disaggregation-room-claim-timeout", "2", log=f)
    try:
        wait_healthy(proc, url)
        health = httpx.get(url + "/health", timeout=5).json()
        assert health["status"] == "ok" and "--disaggregation-insecure" in health["warning"]
        assert "WARNING" in log.read_text() and "accept anyone" in log.read_text()
        t0 = time.monotonic()
        for room in (1, 2, 3):
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "m", "prompt": "Hello there", "max_tokens": 4, "temperature": 0,
                "bootstrap_room": room, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": bport})
            assert r.status_code == 200, r.text
        took = time.monotonic() - t0
        wait_pages_free(url, 15)
        assert 4 <= took < 40, f"three unclaimed rooms took {took:.1f} s"
        assert metric(url, "pipefill_requests_running") == 0
    finally:
        stop(proc)
