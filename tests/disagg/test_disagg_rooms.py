"""Room state machines of both sides with a fake clock: every ending releases every held page
exactly once (checked against a real PagePool), late and stale messages are dropped."""
from __future__ import annotations

import pytest

from pipefill.disagg import messages as m
from pipefill.disagg import prefill_rooms as rooms_mod
from pipefill.disagg.decode_rooms import DecodeRooms
from pipefill.disagg.prefill_rooms import Item, PrefillRooms
from pipefill.disagg.rooms import Liveness
from pipefill.kv.pool import PagePool

ROOM, NONCE = 1234, 99


class Pool:
    """A real page pool; the release callback returns pages to it."""

    def __init__(self, n=64):
        self.pool = PagePool(n)
        self.released: list[tuple[int, list[int]]] = []

    def release(self, room, pages):
        self.released.append((room, list(pages)))
        self.pool.release(pages)

    def clean(self) -> bool:
        self.pool.check_integrity()
        return self.pool.num_free == self.pool.num_pages


# ------------------------------------------------------------------ prefill

def prefill(timeout=10.0):
    p = Pool()
    return PrefillRooms(rank=0, bootstrap_timeout_s=timeout, release=p.release), p


def chunk(pool, room=ROOM, offset=0, n=2, last=False):
    return Item(room, offset, offset, pool.pool.allocate(n), last)


def boot(room=ROOM, nonce=NONCE, pages=(10, 11, 12, 13), expected=1):
    return m.RoomBootstrap(room, nonce, list(pages), expected)


def test_prefill_chunks_wait_for_bootstrap_then_success_releases():
    rooms, p = prefill()
    rooms.open(ROOM, 0.0)
    assert rooms.add(chunk(p), 0.1) == []  # not bootstrapped: held, queued
    work, _ = rooms.on_bootstrap("d", boot(), 0.2)
    assert [(i.page_offset, d.peer) for i, d in work] == [(0, "d")]
    last = chunk(p, offset=2, last=True)
    work += rooms.add(last, 0.3)
    for item, dest in work:
        assert rooms.begin_send(item.room)
        rooms.end_send(item, dest.peer, ok=True)
    assert not rooms.live and rooms.finished[ROOM] == (True, "sent", 200)
    assert p.clean() and len(p.released) == 1


def test_prefill_waits_for_every_decode_stage_and_the_final():
    rooms, p = prefill()
    rooms.open(ROOM, 0.0, sends_final=True)
    assert rooms.on_bootstrap("d0", boot(expected=2), 0.0) == ([], [])
    rooms.add(chunk(p, last=True), 0.1)
    work, _ = rooms.on_bootstrap("d1", boot(nonce=7, expected=2), 0.2)
    assert sorted(d.peer for _, d in work) == ["d0", "d1"]
    for item, dest in work:
        rooms.begin_send(ROOM)
        rooms.end_send(item, dest.peer, ok=True)
    assert ROOM in rooms.live  # the final metadata is still due
    final = Item(ROOM, final=m.FinalMeta(ROOM, 0, 10, 5))
    (item, first), (_, second) = rooms.add(final, 0.3)
    rooms.begin_send(ROOM)
    rooms.end_send(item, first.peer, ok=True)
    assert ROOM in rooms.live  # the other decode stage has not got the final yet
    rooms.begin_send(ROOM)
    rooms.end_send(item, second.peer, ok=True)
    assert not rooms.live and p.clean()


@pytest.mark.parametrize("opened,bootstrapped", [(True, False), (False, True)])
def test_prefill_bootstrap_timeout(opened, bootstrapped):
    rooms, p = prefill(timeout=5.0)
    if opened:
        rooms.open(ROOM, 0.0)
        rooms.add(chunk(p), 0.0)
    if bootstrapped:
        rooms.on_bootstrap("d", boot(), 0.0)
    assert rooms.tick(4.9) == []
    notices = rooms.tick(5.1)
    assert not rooms.live and p.clean()
    if bootstrapped:  # the decode hears why, instead of waiting for its own timeout
        (peer, msg), = notices
        assert peer == "d" and isinstance(msg, m.RoomFailed) and msg.nonce == NONCE
        assert "--disaggregation-bootstrap-timeout" in msg.reason


def test_prefill_drop_from_decode_releases_and_acks_and_late_messages_are_dropped():
    rooms, p = prefill()
    rooms.open(ROOM, 0.0)
    rooms.on_bootstrap("d", boot(), 0.0)
    rooms.add(chunk(p), 0.0)
    assert rooms.on_drop("d", m.DropRoom(ROOM, NONCE + 1, "old attempt")) == []  # not ours
    (peer, ack), = rooms.on_drop("d", m.DropRoom(ROOM, NONCE, "timeout"))
    assert isinstance(ack, m.DropAck) and p.clean()
    late = chunk(p, offset=2, last=True)
    assert rooms.add(late, 1.0) == [] and p.clean()  # pages of a dead room go straight back
    work, (failed,) = rooms.on_bootstrap("d", boot(), 1.0)  # a late bootstrap hears why
    assert work == [] and ROOM not in rooms.live
    assert isinstance(failed[1], m.RoomFailed) and "timeout" in failed[1].reason
    assert rooms.num_dropped_late == 2


def test_prefill_release_waits_for_the_send_in_flight():
    rooms, p = prefill()
    rooms.open(ROOM, 0.0)
    rooms.on_bootstrap("d", boot(), 0.0)
    (item, dest), = rooms.add(chunk(p), 0.0)
    assert rooms.begin_send(ROOM)
    assert rooms.on_drop("d", m.DropRoom(ROOM, NONCE, "abort")) == []  # ack owed, not yet
    assert not p.released  # a send still reads these pages
    (peer, ack), = rooms.end_send(item, dest.peer, ok=True)
    assert isinstance(ack, m.DropAck) and p.clean()


def test_prefill_dead_decode_fails_its_rooms_only():
    rooms, p = prefill()
    for room, peer in ((1, "a"), (2, "b")):
        rooms.open(room, 0.0)
        rooms.on_bootstrap(peer, boot(room=room), 0.0)
        rooms.add(chunk(p, room=room), 0.0)
    notices = rooms.on_peer_dead("a")
    assert [(peer, msg.room) for peer, msg in notices] == [("a", 1)]
    assert list(rooms.live) == [2] and rooms.heartbeat_rooms() == [2]
    rooms.fail(2, "aborted by the client")
    assert p.clean()


# ------------------------------------------------------------ prefill: ownership and budgets

def owned_room(rooms, p, peer="d", layers=(0, 4), expected=1):
    """An opened room with a chunk held, bootstrapped by peer."""
    rooms.open(ROOM, 0.0)
    rooms.add(chunk(p), 0.0)
    work, notices = rooms.on_bootstrap(peer, boot(expected=expected), 0.1, layers)
    assert notices == [] and len(work) == (1 if expected == 1 else 0)
    return work


def test_prefill_refuses_another_peers_bootstrap_of_a_claimed_room():
    rooms, p = prefill()
    owned_room(rooms, p)
    work, [(peer, failed)] = rooms.on_bootstrap("x", boot(nonce=5), 0.2, (0, 4))
    assert work == [] and peer == "x" and failed.status == 409 and failed.nonce == 5
    assert "already bootstrapped by another decode" in failed.reason
    assert list(rooms.live[ROOM].dests) == ["d"]  # the stranger is no destination
    later = rooms.add(chunk(p, offset=2, last=True), 0.3)
    assert [d.peer for _, d in later] == ["d"]


def test_prefill_takes_the_other_decode_stages_of_a_pipeline_only():
    """Two decode stages with their own layers share a room; a third peer, or one whose
    layers a destination already takes, or one expecting another count, is refused."""
    rooms, p = prefill()
    owned_room(rooms, p, "d0", (0, 2), expected=2)
    for peer, layers, expected in (("x", (1, 3), 2), ("x", (2, 4), 3)):
        _, [(_, failed)] = rooms.on_bootstrap(peer, boot(nonce=5, expected=expected), 0.2,
                                              layers)
        assert failed.status == 409
    work, notices = rooms.on_bootstrap("d1", boot(nonce=7, expected=2), 0.3, (2, 4))
    assert notices == [] and sorted(d.peer for _, d in work) == ["d0", "d1"]
    _, [(_, failed)] = rooms.on_bootstrap("x", boot(nonce=5, expected=2), 0.4, (4, 6))
    assert failed.status == 409  # every decode stage it expects is there


def test_prefill_drop_from_a_non_owner_is_acked_and_changes_nothing():
    rooms, p = prefill()
    owned_room(rooms, p)
    for nonce in (NONCE, NONCE + 1):  # even with the owner's nonce
        assert rooms.on_drop("x", m.DropRoom(ROOM, nonce, "mine")) == \
            [("x", m.DropAck(ROOM, nonce, 0))]
    assert ROOM in rooms.live and not p.released
    assert rooms.on_drop("d", m.DropRoom(ROOM, NONCE + 1, "old")) == []  # the owner's old try
    assert ROOM in rooms.live
    rooms.on_drop("d", m.DropRoom(ROOM, NONCE, "abort"))
    assert ROOM not in rooms.live and p.clean()


def test_prefill_heartbeats_name_each_peers_own_rooms():
    rooms, p = prefill()
    for room, peer in ((1, "a"), (2, "b")):
        rooms.open(room, 0.0)
        rooms.on_bootstrap(peer, boot(room=room), 0.0, (0, 4))
    rooms.on_bootstrap("b", boot(room=3), 0.0, (0, 4))  # not opened here: in no heartbeat
    assert rooms.heartbeats() == {"a": [1], "b": [2]}
    assert rooms.heartbeat_rooms("a") == [1] and rooms.heartbeat_rooms("x") == []


def test_prefill_room_no_decode_claims_frees_its_pages_at_the_claim_timeout():
    p = Pool()
    rooms = PrefillRooms(0, bootstrap_timeout_s=120.0, release=p.release, claim_timeout_s=2.0)
    rooms.open(ROOM, 0.0)
    rooms.add(chunk(p, last=True), 0.5)
    assert rooms.tick(1.9) == [] and not p.released
    rooms.tick(2.1)
    assert ROOM not in rooms.live and p.clean()
    _, [(_, failed)] = rooms.on_bootstrap("d", boot(), 2.5)  # a decode that comes too late
    assert "--disaggregation-room-claim-timeout (2 s)" in failed.reason


def test_prefill_claim_timeout_is_at_most_the_bootstrap_timeout():
    rooms = PrefillRooms(0, bootstrap_timeout_s=4.0, release=Pool().release,
                         claim_timeout_s=30.0)
    assert rooms.claim_timeout_s == 4.0


@pytest.mark.parametrize("pages,expected,needle", [
    ([], 1, "at least one destination page"), (list(range(300)), 1, "at most 256"),
    ([5, -1], 1, "outside [0, 2^32)"), ([5, 1 << 32], 1, "outside [0, 2^32)"),
    ([5], 0, "at least one decode stage")])
def test_prefill_refuses_malformed_bootstraps_with_a_400(pages, expected, needle):
    rooms = PrefillRooms(0, 10.0, Pool().release, max_room_pages=256)
    _, [(_, failed)] = rooms.on_bootstrap("x", boot(pages=pages, expected=expected), 0.0)
    assert failed.status == 400 and needle in failed.reason and not rooms.live


def test_prefill_pending_rooms_are_bounded_per_peer_and_stored_compactly():
    rooms = PrefillRooms(0, 10.0, Pool().release, max_room_pages=100)
    # Pages: at most 2 rooms' worth per peer (200 page ids).
    for room, ok in ((1, True), (2, True), (3, False)):
        _, notices = rooms.on_bootstrap("x", boot(room=room, pages=range(1000, 1100)), 0.0)
        assert (notices == []) == ok
    assert notices[0][1].status == 503 and "at most 200" in notices[0][1].reason
    assert rooms.live[1].dests["x"].dst_pages.itemsize == 4  # 4 bytes a page id
    # Its own room again replaces its entry: no growth, still counted once.
    assert rooms.on_bootstrap("x", boot(room=1, nonce=3, pages=range(1000, 1100)), 0.0) == \
        ([], [])
    assert rooms.pending.pages["x"] == 200 and rooms.pending.num_rooms == 2
    # Rooms: at most PENDING_ROOMS_PER_PEER per peer, however small.
    counted = PrefillRooms(0, 10.0, Pool().release)
    per_peer = rooms_mod.PENDING_ROOMS_PER_PEER
    for room in range(10, 10 + per_peer + 5):
        counted.on_bootstrap("y", boot(room=room, pages=[1]), 0.0)
    assert len(counted.pending.rooms["y"]) == len(counted.live) == per_peer
    # Opening a room takes it out of the budget; ending one does too.
    rooms.open(1, 0.1)
    assert rooms.pending.pages["x"] == 100
    rooms.fail(2, "gone")
    assert "x" not in rooms.pending.pages
    rooms.tick(10.5)  # never opened: gone after the bootstrap timeout
    assert rooms.pending.num_rooms == 0 and list(rooms.live) == [1]


def test_prefill_full_pending_budget_evicts_the_biggest_holder_first():
    rooms = PrefillRooms(0, 10.0, Pool().release, max_room_pages=10)
    total = rooms_mod.PENDING_PAGES_TOTAL_ROOMS * 10  # 80 page ids in all
    per_peer = rooms_mod.PENDING_PAGES_PER_PEER_ROOMS * 10  # 20 per peer
    for i in range(total // per_peer):  # four peers fill it
        for j in range(2):
            rooms.on_bootstrap(f"flood{i}", boot(room=100 * i + j, pages=range(10)), 0.0)
    assert rooms.pending.num_pages == total
    _, notices = rooms.on_bootstrap("d", boot(room=7, pages=range(5)), 0.1)
    (peer, evicted), = notices  # the oldest room of a peer holding the most
    assert peer == "flood0" and evicted.room == 0 and evicted.status == 503
    assert 7 in rooms.live and rooms.pending.num_pages == total - 5


# ------------------------------------------------------------------- decode

STAGES = {"p/0": (0, 2), "p/1": (2, 4)}


def decode(timeout=10.0, one_sided=False):
    p = Pool()
    rooms = DecodeRooms(timeout, p.release, one_sided=one_sided, drain_grace_s=3.0)
    pages = p.pool.allocate(4)
    rooms.expect(ROOM, NONCE, pages, STAGES, 0.0, want_final=True, num_prompt_tokens=200)
    return rooms, p, pages


def kv(stage, offset, n, last=False, room=ROOM, nonce=NONCE):
    ls, le = STAGES[stage]
    return m.KVChunk(room, nonce, int(stage[-1]), offset, offset, n, ls, le, 0, last)


def deliver(rooms, stage, msg, now=1.0):
    dst = rooms.begin_chunk(stage, msg)
    if dst is not None:
        rooms.end_chunk(stage, msg, now)
    return dst


def test_decode_ready_only_when_every_stage_and_the_final_arrived():
    rooms, p, pages = decode()
    assert deliver(rooms, "p/0", kv("p/0", 0, 2)) == pages[:2]
    deliver(rooms, "p/0", kv("p/0", 2, 2, last=True))
    deliver(rooms, "p/1", kv("p/1", 0, 4, last=True))
    assert rooms.result(ROOM) is None  # the final metadata is missing
    rooms.on_final("p/1", m.FinalMeta(ROOM, NONCE, 200, 17, -0.1), 2.0)
    res = rooms.take_result(ROOM)
    assert res.ok and res.pages == pages and res.final.first_token == 17
    assert not p.released  # on success the pages belong to the caller


def test_decode_drops_chunks_it_cannot_trust():
    rooms, p, pages = decode()
    assert deliver(rooms, "p/0", kv("p/0", 0, 2, nonce=NONCE + 1)) is None  # another attempt
    assert deliver(rooms, "p/0", kv("p/0", 0, 2, room=ROOM + 1)) is None  # unknown room
    assert deliver(rooms, "p/0", kv("p/0", 3, 2)) is None  # past the allocated pages
    assert deliver(rooms, "p/9", kv("p/0", 0, 2)) is None  # a stage this room does not use
    wrong_layers = m.KVChunk(ROOM, NONCE, 0, 0, 0, 2, 0, 4, 0, False)
    assert deliver(rooms, "p/0", wrong_layers) is None
    assert rooms.num_dropped == 5 and ROOM in rooms.live


def test_decode_stale_final_metadata_is_never_trusted():
    rooms, p, pages = decode()
    for st in STAGES:
        deliver(rooms, st, kv(st, 0, 4, last=True))
    rooms.on_final("p/1", m.FinalMeta(ROOM, NONCE + 1, 200, 5), 1.0)  # earlier attempt
    rooms.on_final("p/1", m.FinalMeta(ROOM + 1, NONCE, 200, 5), 1.0)  # another room
    assert rooms.result(ROOM) is None
    rooms.on_final("p/1", m.FinalMeta(ROOM, NONCE, 200, 6), 1.0)
    assert rooms.take_result(ROOM).final.first_token == 6


def test_decode_prompt_length_mismatch_fails_the_room():
    rooms, p, pages = decode()
    notices = rooms.on_final("p/1", m.FinalMeta(ROOM, NONCE, 199, 5), 1.0)
    res = rooms.take_result(ROOM)
    assert not res.ok and "199 prompt tokens" in res.reason
    assert {peer for peer, _ in notices} == set(STAGES) and p.clean()


def test_decode_waiting_timeout_drops_the_room_at_the_prefill_and_releases():
    rooms, p, pages = decode(timeout=10.0)
    rooms.on_heartbeat("p/1", [ROOM], 8.0)  # no KV yet: a heartbeat naming the room renews it
    assert rooms.tick(17.9) == []
    deliver(rooms, "p/0", kv("p/0", 0, 2), now=18.0)  # progress resets the clock
    rooms.on_heartbeat("p/1", [ROOM], 24.0)  # started: only chunks renew it now (the lease)
    assert rooms.tick(27.9) == []
    notices = rooms.tick(28.1)
    assert sorted(peer for peer, _ in notices) == sorted(STAGES)
    assert all(isinstance(msg, m.DropRoom) and msg.nonce == NONCE for _, msg in notices)
    res = rooms.take_result(ROOM)
    assert not res.ok and "--disaggregation-waiting-timeout" in res.reason
    assert p.clean()
    deliver(rooms, "p/1", kv("p/1", 0, 4, last=True))  # too late: dropped, nothing written
    assert rooms.result(ROOM) is None and p.clean()


def test_decode_release_waits_for_a_receive_in_flight():
    rooms, p, pages = decode()
    msg = kv("p/0", 0, 4)
    assert rooms.begin_chunk("p/0", msg) == pages
    rooms.abort(ROOM, "client went away", 1.0)
    assert not p.released  # bytes are still landing in those pages
    rooms.end_chunk("p/0", msg, 1.5, ok=True)
    assert p.clean() and not rooms.take_result(ROOM).ok


def test_decode_dead_stage_fails_the_room_and_tells_the_live_one():
    rooms, p, pages = decode()
    notices = rooms.on_stage_dead("p/0", 1.0)
    assert [peer for peer, _ in notices] == ["p/1"]
    assert "stopped answering" in rooms.take_result(ROOM).reason and p.clean()


def test_decode_one_sided_release_waits_for_acks_or_the_grace_time():
    rooms, p, pages = decode(one_sided=True)
    rooms.abort(ROOM, "abort", 1.0)
    assert not p.released  # a remote writer may still be writing into the pages
    rooms.on_drop_ack("p/0", m.DropAck(ROOM, NONCE, 0), 1.1)
    assert not p.released
    rooms.on_drop_ack("p/1", m.DropAck(ROOM, NONCE, 1), 1.2)
    assert p.clean()
    pages = p.pool.allocate(4)
    rooms.expect(ROOM + 1, NONCE, pages, STAGES, 2.0)
    rooms.abort(ROOM + 1, "abort", 2.0)
    rooms.on_drop_ack("p/0", m.DropAck(ROOM + 1, NONCE, 0), 2.1)
    rooms.tick(4.9)
    assert not p.clean()
    rooms.tick(5.1)  # p/1 never acked: after the grace time the pages are reused anyway
    assert p.clean()


def test_decode_repeated_room_is_refused():
    rooms, p, pages = decode()
    with pytest.raises(ValueError, match="repeated bootstrap_room"):
        rooms.expect(ROOM, 1, [], STAGES, 0.0)


def test_liveness():
    live = Liveness(interval_s=2.0, max_misses=3)
    live.seen("a", 0.0)
    live.seen("b", 0.0)
    live.seen("b", 5.0)
    assert live.dead(5.9) == []
    assert live.dead(6.1) == ["a"]
    assert live.dead(11.1) == ["b"]
    with pytest.raises(ValueError, match="heartbeat"):
        Liveness(0, 3)
