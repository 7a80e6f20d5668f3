"""A request the PD prefill refuses (a 4xx of its own, e.g. a prompt over its --max-model-len)
must not leave the decode waiting: the prefill remembers the refused room for a while (TTLMap)
and answers its decodes' bootstraps, before or after, with RoomFailed carrying the status; the
decode answers that status and sentence at once and frees the room's pages.

Fast: the room state machines with a fake clock, and senders, receiver and the HTTP server's
notifier on threads over real sockets. Slow: real servers behind the real sglang-router."""
from __future__ import annotations

import time

import httpx
import msgspec
import pytest
import torch

from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import lookup_prefill
from pipefill.disagg.rejects import RejectNotifier
from pipefill.disagg.rooms import TTLMap
from pipefill.disagg.transfer_receiver import KVReceiver
from pipefill.server.responses import RequestFailed, error_of

from test_disagg_rooms import NONCE, ROOM, boot, chunk, decode, prefill
from test_disagg_transfer import FAST, LAYERS, Pool, random_kv, send_request, start_prefill
from test_pd_router import (chat_model, free_port, spawn_router, spawn_server,  # noqa: F401
                            stop, wait_healthy, wait_pages_free)

REFUSAL = "prompt (150 tokens) + max_new_tokens (8) = 158 exceeds --max-model-len (128)"


# ------------------------------------------------------------------ the TTL map

def test_ttl_map_expires_entries_after_their_ttl():
    t = TTLMap(ttl_s=10, max_size=8)
    t.put("a", 1, now=0.0)
    t.put("b", 2, now=5.0)
    assert (t.get("a", 9.9), t.get("b", 9.9)) == (1, 2)
    assert t.get("a", 10.0) is None and t.get("b", 10.0) == 2  # a expired, b has 5 s left
    assert t.get("b", 15.0) is None and len(t) == 0


def test_ttl_map_is_bounded_and_a_put_again_refreshes():
    t = TTLMap(ttl_s=10, max_size=3)
    for i, key in enumerate("abc"):
        t.put(key, i, now=0.0)
    t.put("a", "again", now=1.0)  # now the newest: b is the oldest
    t.put("d", 3, now=2.0)
    assert len(t) == 3 and t.get("b", 2.0) is None
    assert (t.get("a", 2.0), t.get("c", 2.0), t.get("d", 2.0)) == ("again", 2, 3)
    assert t.get("a", 10.5) == "again" and t.get("c", 10.5) is None
    t.pop("a")
    assert t.get("a", 10.5) is None


@pytest.mark.parametrize("ttl,size", [(0, 4), (-1, 4), (1, 0)])
def test_ttl_map_refuses_a_useless_shape(ttl, size):
    with pytest.raises(ValueError):
        TTLMap(ttl, size)


# ------------------------------------------------------------------ the messages

def test_room_failed_without_a_status_still_decodes_as_a_fault():
    """An encoding from before the field (both ends are ours, but a rolling restart mixes
    versions): the missing status reads as 500."""
    old = msgspec.msgpack.encode(["RoomFailed", 1, 2, 0, "boom"])
    assert m.decode(old) == m.RoomFailed(1, 2, 0, "boom", 500)
    assert m.decode(m.encode(m.RoomFailed(1, 2, 0, "too long", 400))).status == 400


# ------------------------------------------------------------------ room state machines

def test_prefill_refusal_answers_a_later_bootstrap_until_it_expires():
    rooms, p = prefill(timeout=10.0)
    assert rooms.reject(ROOM, 400, REFUSAL, now=0.0) == []  # no decode yet
    work, notices = rooms.on_bootstrap("d", boot(), now=1.0)
    assert work == [] and notices == [("d", m.RoomFailed(ROOM, NONCE, 0, REFUSAL, 400))]
    assert ROOM not in rooms.live  # the refused room holds nothing here
    # Every decode stage that bootstraps the room hears it, not only the first.
    _, notices = rooms.on_bootstrap("d2", boot(nonce=7), now=2.0)
    assert notices == [("d2", m.RoomFailed(ROOM, 7, 0, REFUSAL, 400))]
    # After the bootstrap timeout the refusal is forgotten: the room is an ordinary one.
    assert rooms.on_bootstrap("d", boot(), now=10.5) == ([], [])
    assert ROOM in rooms.live and p.clean()


def test_prefill_refusal_reaches_a_decode_that_bootstrapped_first():
    rooms, p = prefill()
    rooms.on_bootstrap("d", boot(), now=0.0)
    notices = rooms.reject(ROOM, 413, "the request body is too large", now=0.5)
    assert notices == [("d", m.RoomFailed(ROOM, NONCE, 0, "the request body is too large", 413))]
    assert not rooms.live and p.clean()
    assert rooms.on_drop("d", m.DropRoom(ROOM, NONCE, "refused")) == \
        [("d", m.DropAck(ROOM, NONCE, 0))]  # the decode's drop is still acknowledged


def test_prefill_refusal_with_a_non_error_status_counts_as_a_fault():
    rooms, _ = prefill()
    rooms.reject(ROOM, 200, "odd", now=0.0)
    _, [(_, failed)] = rooms.on_bootstrap("d", boot(), now=0.1)
    assert failed.status == 500


def test_prefill_accepting_the_room_later_forgets_the_refusal():
    """A refusal is of one request: a later accepted request with the room id is served."""
    rooms, p = prefill()
    rooms.reject(ROOM, 400, REFUSAL, now=0.0)
    rooms.open(ROOM, 0.1)
    assert rooms.add(chunk(p), 0.2) == []
    work, notices = rooms.on_bootstrap("d", boot(), now=0.3)
    assert notices == [] and len(work) == 1


def test_decode_answers_the_prefills_status_and_sentence_and_frees_the_pages():
    rooms, p, pages = decode(timeout=60.0)
    notices = rooms.on_failed("p/0", m.RoomFailed(ROOM, NONCE, 0, REFUSAL, 400), now=0.1)
    assert [(s, type(x)) for s, x in notices] == [("p/0", m.DropRoom), ("p/1", m.DropRoom)]
    res = rooms.take_result(ROOM)
    assert (res.ok, res.status, res.reason) == (False, 400, REFUSAL)
    assert p.clean() and not rooms.live
    # A fault keeps its 500 and says which prefill stage failed.
    rooms, p, _ = decode()
    rooms.on_failed("p/1", m.RoomFailed(ROOM, NONCE, 1, "out of memory"), now=0.1)
    res = rooms.take_result(ROOM)
    assert res.status == 500 and res.reason == "prefill stage 1 failed: out of memory"


def test_http_answer_keeps_a_4xx_and_faults_stay_500():
    refused = error_of(RequestFailed(f"the prefill server refused this request: {REFUSAL}", 400))
    assert refused.status == 400 and refused.kind == "invalid_request_error"
    assert REFUSAL in refused.message
    fault = error_of(RequestFailed("prefill stage 1 failed: out of memory"))
    assert fault.status == 500 and "out of memory" in fault.message


# ------------------------------------------------------------------ real sockets

@pytest.mark.parametrize("order", ["refused-first", "bootstrapped-first"])
def test_notifier_to_stages_to_decode_over_tcp(order):
    """The HTTP server's notifier tells both prefill stages; the decode's room fails with the
    status at once (its waiting timeout is 20 s), its pages come back, and the next room on
    the same connections is served."""
    service, senders, src_pools = start_prefill("tcp", torch.float32)
    dst_pool = Pool()
    receiver = KVReceiver(random_kv(0, 0, LAYERS), release=dst_pool.release, timing=FAST)
    notifier = RejectNotifier(service.endpoints)
    try:
        receiver.connect("p", lookup_prefill(service.endpoint, 10))
        t0 = time.monotonic()
        if order == "refused-first":
            notifier.tell(ROOM, 400, REFUSAL)
            # Both stages have it before the decode asks (else this is the other order).
            assert _wait(lambda: all(s.rooms.rejected.get(ROOM, s._p.clock())
                                     for s in senders))
            receiver.expect_room(ROOM, "p", dst_pool.pool.allocate(8))
        else:
            receiver.expect_room(ROOM, "p", dst_pool.pool.allocate(8))
            assert _wait(lambda: all(ROOM in s.rooms.live for s in senders))
            notifier.tell(ROOM, 400, REFUSAL)
        res = receiver.wait_room(ROOM, 15)
        assert res is not None and time.monotonic() - t0 < 15, "the decode kept waiting"
        assert (res.ok, res.status, res.reason) == (False, 400, REFUSAL)
        assert _wait(dst_pool.clean)
        assert _wait(lambda: all(ROOM not in s.rooms.live for s in senders))
        # The next request of another room goes through as usual.
        other = ROOM + 1
        dst = dst_pool.pool.allocate(4)
        receiver.expect_room(other, "p", dst, num_prompt_tokens=4 * 16)
        send_request(senders, src_pools, 4, room=other, num_tokens=4 * 16)
        ok = receiver.wait_room(other, 15)
        assert ok is not None and ok.ok and ok.pages == dst
        assert _wait(lambda: all(p.clean() for p in src_pools))
    finally:
        notifier.close()
        receiver.close()
        for s in senders:
            s.close()
        service.close()


def test_notifier_survives_a_stage_that_is_gone():
    """A stage that no longer listens costs a log line, not the notifier's thread."""
    service, senders, _ = start_prefill("tcp", torch.float32)
    notifier = RejectNotifier(lambda: [m.Endpoint("127.0.0.1", 1)] + service.endpoints())
    try:
        notifier.tell(ROOM, 400, REFUSAL)
        assert _wait(lambda: all(s.rooms.rejected.get(ROOM, s._p.clock()) for s in senders))
    finally:
        notifier.close()
        for s in senders:
            s.close()
        service.close()


def _wait(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ------------------------------------------------------------------ real servers, real router

@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("decode_pp", [1, 2])
def test_prefill_refusal_through_the_router_is_fast_and_leaves_nothing(chat_model, decode_pp):
    """The prefill's --max-model-len is smaller than the decode's: a prompt that fits only the
    decode gets the prefill's 400 through the router, long before the decode's waiting
    timeout (60 s; the bound below is a hang guard, not a speed threshold). With decode PP 2
    every decode stage hears the refusal from the prefill stage it bootstrapped."""
    bport = free_port()
    timeouts = ("--disaggregation-waiting-timeout", "60")
    procs, urls = {}, {}
    procs["prefill"], urls["prefill"] = spawn_server(
        chat_model, "--pp-size", "2", "--disaggregation-mode", "prefill",
        "--disaggregation-bootstrap-port", str(bport), "--max-model-len", "128", *timeouts)
    procs["decode"], urls["decode"] = spawn_server(
        chat_model, "--pp-size", str(decode_pp), "--disaggregation-mode", "decode",
        "--max-model-len", "1024", *timeouts)
    try:
        for name in ("prefill", "decode"):
            wait_healthy(procs[name], urls[name])
        procs["router"], urls["router"] = spawn_router(urls["prefill"], bport, urls["decode"])
        wait_healthy(procs["router"], urls["router"], "/readiness", 60)
        want = _post(urls["router"], "The capital of France is")
        assert want.status_code == 200, want.text
        t0 = time.monotonic()
        r = _post(urls["router"], "word " * 150)  # ~150 tokens: over 128, under 1024
        took = time.monotonic() - t0
        assert r.status_code == 400, r.text
        assert "exceeds --max-model-len (128)" in r.text, r.text
        assert took < 20, f"the refusal took {took:.1f} s: the decode waited for the KV"
        wait_pages_free(urls["decode"], 10)
        wait_pages_free(urls["prefill"], 10)
        again = _post(urls["router"], "The capital of France is")
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        assert httpx.get(urls["decode"] + "/health", timeout=5).status_code == 200
    finally:
        stop(*procs.values())


def _post(url: str, prompt: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0})
