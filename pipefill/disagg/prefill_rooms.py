"""Prefill stage, per room: created by whichever comes first, the local request (`open`) or a
decode's RoomBootstrap; chunks wait (their pages held) until every decode stage that covers
this stage's layers has bootstrapped; the room succeeds when its last chunk (and the final
metadata, if this stage sends it) went to every destination, and fails when no decode claims
(bootstraps) it within --disaggregation-room-claim-timeout of its request starting here, when
its request does not reach this stage within --disaggregation-bootstrap-timeout of a
bootstrap, or when its decode drops it or dies. A room belongs to the decode stages that
bootstrapped it: only they can drop it or hear of it, and rooms bootstrapped before their
request arrived hold a bounded page list each (PendingBudget). A room whose
request the prefill's HTTP server refused (`reject`) is remembered for the bootstrap timeout:
its decodes hear the refusal (its 4xx status and sentence) whether they bootstrap it before or
after, instead of waiting for their --disaggregation-waiting-timeout.

Shared pieces (liveness, expiring maps) are in rooms.py; the decode side in decode_rooms.py.
"""
from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from pipefill.disagg import messages as m
from pipefill.base.wire import DropLog
from pipefill.disagg.rooms import FINISHED_MEMORY, Notice, Release, TTLMap, remember

log = logging.getLogger(__name__)

# Rooms a decode bootstrapped before this stage opened them ("pending": the request has not
# reached the stage yet, or never will) cost their page lists and nothing else: these bound
# what made-up rooms can hold. The page bounds are multiples of the pages one room may name.
PENDING_ROOMS_PER_PEER = 256
PENDING_ROOMS_TOTAL = 2048
PENDING_PAGES_PER_PEER_ROOMS = 2
PENDING_PAGES_TOTAL_ROOMS = 8
MAX_PAGE_ID = (1 << 32) - 1  # page ids are stored as unsigned 32-bit integers


@dataclass
class Dest:
    peer: str
    nonce: int
    dst_pages: Sequence[int]  # array("I"): 4 bytes a page, whatever the sender sent
    staging_addr: int = 0  # mooncake: where this decode stages the room's chunks (0: none)
    layers: tuple[int, int] | None = None  # the decode stage's layers (None: not known)
    dst_window: Sequence[int] = ()  # its window page per page, -1: none (RoomBootstrap)


@dataclass
class Item:
    """One unit of the sender's queue: a chunk of pages, or the final metadata."""
    room: int
    chunk_id: int = 0
    page_offset: int = 0
    src_pages: list[int] = field(default_factory=list)
    is_last: bool = False
    final: m.FinalMeta | None = None
    # The last chunk of a model whose window layers keep pages of their own: the request's
    # window table at the end of its prefill, -1 where freed ('Window pages').
    window_src: list[int] | None = None


@dataclass
class PrefillRoom:
    room: int
    created_at: float
    opened: bool = False  # the local request exists
    opened_at: float = 0.0
    sends_final: bool = False
    expected: int | None = None  # decode stages that will bootstrap this room
    dests: dict[str, Dest] = field(default_factory=dict)
    held: list[int] = field(default_factory=list)
    pending: list[Item] = field(default_factory=list)
    last_sent: set[str] = field(default_factory=set)
    final_sent: set[str] = field(default_factory=set)  # destinations that got it
    sends_in_flight: int = 0  # sends reading `held` pages right now
    acks_due: list[Notice] = field(default_factory=list)  # DropAcks owed once sends finish

    @property
    def bootstrapped(self) -> bool:
        return self.expected is not None and len(self.dests) >= self.expected


class Refused(Exception):
    """A RoomBootstrap this stage will not take: the sentence and the status its decode
    answers with."""

    def __init__(self, reason: str, status: int):
        super().__init__(reason)
        self.reason, self.status = reason, status


class PendingBudget:
    """Page ids held for pending rooms, by peer (oldest first) and in all."""

    def __init__(self, room_pages: int | None):
        self.rooms: dict[str, OrderedDict[int, int]] = {}  # peer -> room -> pages
        self.pages: dict[str, int] = {}
        self.num_rooms = self.num_pages = 0
        self.peer_pages = room_pages and PENDING_PAGES_PER_PEER_ROOMS * room_pages
        self.total_pages = room_pages and PENDING_PAGES_TOTAL_ROOMS * room_pages

    def refusal(self, peer: str, room: int, pages: int) -> str | None:
        """Why this peer's pending room (new, or replacing its entry) does not fit the
        peer's own share, or None."""
        mine = self.rooms.get(peer, {})
        if room not in mine and len(mine) >= PENDING_ROOMS_PER_PEER:
            return (f"this decode already has {PENDING_ROOMS_PER_PEER} rooms waiting for their "
                    "requests on this prefill stage")
        growth = pages - mine.get(room, 0)
        if self.peer_pages and self.pages.get(peer, 0) + growth > self.peer_pages:
            return (f"this decode's rooms waiting for their requests already name "
                    f"{self.pages.get(peer, 0)} pages on this prefill stage (at most "
                    f"{self.peer_pages})")
        return None

    def add(self, peer: str, room: int, pages: int) -> None:
        self.remove(peer, room)
        self.rooms.setdefault(peer, OrderedDict())[room] = pages
        self.pages[peer] = self.pages.get(peer, 0) + pages
        self.num_rooms += 1
        self.num_pages += pages

    def remove(self, peer: str, room: int) -> None:
        rooms = self.rooms.get(peer)
        if rooms is None or room not in rooms:
            return
        pages = rooms.pop(room)
        self.pages[peer] -= pages
        self.num_rooms -= 1
        self.num_pages -= pages
        if not rooms:
            del self.rooms[peer], self.pages[peer]

    def over(self) -> bool:
        return self.num_rooms > PENDING_ROOMS_TOTAL or \
            bool(self.total_pages and self.num_pages > self.total_pages)

    def evictee(self) -> int:
        """The oldest pending room of the peer holding the most pages: a flood from one
        connection evicts its own rooms first."""
        peer = max(self.pages, key=lambda p: (self.pages[p], len(self.rooms[p])))
        return next(iter(self.rooms[peer]))


def compact_pages(pages: list[int], limit: int | None) -> array:
    """The decode's page ids as array("I"), or Refused with a sentence."""
    if not pages:
        raise Refused("a RoomBootstrap needs at least one destination page", 400)
    if limit is not None and len(pages) > limit:
        raise Refused(f"a RoomBootstrap names {len(pages)} pages; a request on this prefill "
                      f"has at most {limit}", 400)
    if min(pages) < 0 or max(pages) > MAX_PAGE_ID:
        raise Refused("a RoomBootstrap names a page id outside [0, 2^32)", 400)
    return array("I", pages)


def compact_window(table: list[int], num_pages: int, windowed: bool) -> array:
    """A RoomBootstrap's window table as array("q"), or Refused with a sentence."""
    if not windowed:
        if table:
            raise Refused("a RoomBootstrap names window pages, but this prefill stage's "
                          "window layers keep every token's KV (no window pages)", 400)
        return array("q")
    if len(table) != num_pages:
        raise Refused(f"a RoomBootstrap's window table has {len(table)} entries for "
                      f"{num_pages} pages: one a page (-1: no window page)", 400)
    if min(table) < -1 or max(table) > MAX_PAGE_ID:
        raise Refused("a RoomBootstrap's window table names a page id outside [-1, 2^32)", 400)
    return array("q", table)


def _overlap(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    return a is not None and b is not None and max(a[0], b[0]) < min(a[1], b[1])


class PrefillRooms:
    """Rooms of one prefill stage. A room belongs to the decode stages that bootstrapped it
    (each one connection here, `peer`, with its own nonce): only they may drop it, only they
    hear of it in heartbeats, and another peer's bootstrap of a room that already has its
    decode stages (or whose layers one of them already takes) is refused."""

    def __init__(self, rank: int, bootstrap_timeout_s: float, release: Release,
                 claim_timeout_s: float | None = None, max_room_pages: int | None = None,
                 windowed: bool = False):
        """windowed: the stage's window layers keep pages of their own: every bootstrap
        carries a window table ('Window pages')."""
        self.rank = rank
        self.windowed = windowed
        self.bootstrap_timeout_s = bootstrap_timeout_s
        # A room opened here must be claimed by its decode within this (the older flag,
        # when smaller, still bounds it).
        self.claim_timeout_s = min(claim_timeout_s or bootstrap_timeout_s, bootstrap_timeout_s)
        self.max_room_pages = max_room_pages
        self.release = release
        self.live: dict[int, PrefillRoom] = {}
        self.draining: dict[int, PrefillRoom] = {}  # ended, a send still reads their pages
        # (ok, why, HTTP status the decode answers with)
        self.finished: OrderedDict[int, tuple[bool, str, int]] = OrderedDict()
        # room -> (status, sentence) of requests the HTTP server refused: as long as a room
        # waits for its decodes' bootstraps, its refusal answers them.
        self.rejected = TTLMap(bootstrap_timeout_s, FINISHED_MEMORY)
        self.pending = PendingBudget(max_room_pages)
        self.refusals = DropLog(f"prefill stage {rank}'s rooms")
        self.num_dropped_late = 0

    def open(self, room: int, now: float, sends_final: bool = False) -> None:
        self.rejected.pop(room)  # this request was accepted: an older refusal is not its own
        r = self._room(room, now)
        self._mark_opened(r, now)
        r.sends_final = r.sends_final or sends_final

    def on_bootstrap(self, peer: str, msg: m.RoomBootstrap, now: float,
                     layers: tuple[int, int] | None = None
                     ) -> tuple[list[tuple[Item, Dest]], list[Notice]]:
        """(work now sendable, notices): a bootstrap for a room that already failed here is
        answered with the failure, so that decode does not wait for its timeout; so is one
        for a room whose request the HTTP server refused, and one this stage refuses (a
        malformed one, another decode's room, over the pending budget). `layers`: the
        peer's decode layers, which no two destinations of a room may share."""
        refused = self.rejected.get(msg.room, now)
        if refused is not None and msg.room not in self.live:
            status, reason = refused
            log.info("bootstrap for refused room %d: answered %d", msg.room, status)
            return [], [self._failed(peer, msg, reason, status)]
        if msg.room in self.finished:
            self.num_dropped_late += 1
            ok, reason, status = self.finished[msg.room]
            log.info("late bootstrap for finished room %d", msg.room)
            return [], [] if ok else [self._failed(peer, msg, reason, status)]
        try:
            pages = compact_pages(msg.dst_pages, self.max_room_pages)
            window = compact_window(msg.dst_window_pages, len(pages), self.windowed)
            self._check_owner(self.live.get(msg.room), peer, msg, layers)
        except Refused as e:
            self.refusals.drop(f"RoomBootstrap of room {msg.room} from {peer}: {e.reason}")
            return [], [self._failed(peer, msg, e.reason, e.status)]
        r = self.live.get(msg.room)
        if r is None or not r.opened:  # pending: only its page list, within the budget
            why = self.pending.refusal(peer, msg.room, len(pages))
            if why is not None:
                self.refusals.drop(f"RoomBootstrap of room {msg.room} from {peer}: {why}")
                return [], [self._failed(peer, msg, why, 503)]
            self.pending.add(peer, msg.room, len(pages))
        r = self._room(msg.room, now)
        r.expected = msg.expected_bootstraps
        r.dests[peer] = Dest(peer, msg.nonce, pages, msg.staging_addr, layers, window)
        notices = self._evict_pending()
        if msg.room not in self.live or not r.bootstrapped:
            return [], notices
        work = [(item, d) for item in r.pending for d in r.dests.values()]
        r.pending.clear()
        return work, notices

    def add(self, item: Item, now: float) -> list[tuple[Item, Dest]]:
        """Queues a chunk or the final metadata; the (item, destination) pairs to send now."""
        if item.room in self.finished:  # the room ended (dropped, timed out): pages go back
            self.num_dropped_late += 1
            if item.src_pages:
                self.release(item.room, list(item.src_pages))
            return []
        r = self._room(item.room, now)
        self._mark_opened(r, now)
        if item.final is not None:
            r.sends_final = True
        r.held.extend(item.src_pages)
        if not r.bootstrapped:
            r.pending.append(item)
            return []
        return [(item, d) for d in r.dests.values()]

    def begin_send(self, room: int) -> bool:
        """True if the room is live; its pages then stay held until end_send."""
        r = self.live.get(room)
        if r is None:
            return False
        r.sends_in_flight += 1
        return True

    def end_send(self, item: Item, peer: str, ok: bool) -> list[Notice]:
        r = self.live.get(item.room) or self.draining.get(item.room)
        if r is None:
            return []
        r.sends_in_flight -= 1
        if r.room in self.draining:
            if r.sends_in_flight == 0:
                del self.draining[r.room]
                self._release(r)
                return r.acks_due
            return []
        if ok:
            if item.is_last:
                r.last_sent.add(peer)
            if item.final is not None:
                r.final_sent.add(peer)
            dests = set(r.dests)
            if r.bootstrapped and r.last_sent >= dests and \
                    (r.final_sent >= dests or not r.sends_final):
                self._end(r, True, "sent", 200)
        return []

    def fail(self, room: int, reason: str, status: int = 500) -> list[Notice]:
        """Ends the room as failed; the RoomFailed notices for its destinations."""
        r = self.live.get(room)
        if r is None:
            return []
        self._end(r, False, reason, status)
        return [(d.peer, m.RoomFailed(room, d.nonce, self.rank, reason, status))
                for d in r.dests.values()]

    def reject(self, room: int, status: int, reason: str, now: float) -> list[Notice]:
        """The HTTP server refused the room's request with status (a 4xx: the client's
        fault; anything else counts as a fault, 500) and a sentence: the decodes that already
        bootstrapped the room hear it now, later ones when they bootstrap it."""
        status = status if 400 <= status < 600 else 500
        self.rejected.put(room, (status, reason), now)
        return self.fail(room, reason, status)

    def on_drop(self, peer: str, msg: m.DropRoom) -> list[Notice]:
        """Only a destination of the room, with its own nonce, ends it. Anyone else's drop is
        acknowledged at once and changes nothing: nothing of theirs is written for it."""
        ack = [(peer, m.DropAck(msg.room, msg.nonce, self.rank))]
        r = self.live.get(msg.room)
        if r is not None:
            d = r.dests.get(peer)
            if d is None:
                self.refusals.drop(f"DropRoom of room {msg.room} from {peer}, which did not "
                                   "bootstrap it")
                return ack
            if d.nonce != msg.nonce:
                return []  # a drop of an earlier attempt with the same room id
            self._end(r, False, f"dropped by the decode: {msg.reason}")
        r = self.draining.get(msg.room)
        if r is not None and peer in r.dests:
            # The ack waits until no write into the decode's pages is running.
            if ack[0] not in r.acks_due:
                r.acks_due += ack
            return []
        # Acknowledged even when unknown: the decode may reuse its pages once every stage acks.
        return ack

    def on_peer_dead(self, peer: str) -> list[Notice]:
        notices = []
        for r in [r for r in self.live.values() if peer in r.dests]:
            notices += self.fail(r.room, f"decode {peer} stopped answering")
        return notices

    def tick(self, now: float) -> list[Notice]:
        notices = []
        for r in list(self.live.values()):
            if r.opened and not r.bootstrapped and now - r.opened_at > self.claim_timeout_s:
                notices += self.fail(r.room, f"room {r.room}: no decode bootstrapped it within "
                                     f"--disaggregation-room-claim-timeout "
                                     f"({self.claim_timeout_s:g} s)")
            elif not r.opened and now - r.created_at > self.bootstrap_timeout_s:
                notices += self.fail(r.room, f"room {r.room}: this prefill server never "
                                     "received its request within "
                                     f"--disaggregation-bootstrap-timeout "
                                     f"({self.bootstrap_timeout_s:g} s)")
        return notices

    def heartbeat_rooms(self, peer: str | None = None) -> list[int]:
        """The opened rooms peer bootstrapped (None: every opened room)."""
        return [r.room for r in self.live.values()
                if r.opened and (peer is None or peer in r.dests)]

    def heartbeats(self) -> dict[str, list[int]]:
        """peer -> the opened rooms it bootstrapped: a peer hears of its own rooms only."""
        out: dict[str, list[int]] = {}
        for r in self.live.values():
            if r.opened:
                for peer in r.dests:
                    out.setdefault(peer, []).append(r.room)
        return out

    def _check_owner(self, r: PrefillRoom | None, peer: str, msg: m.RoomBootstrap,
                     layers: tuple[int, int] | None) -> None:
        """Raises Refused when peer may not become a destination of room r."""
        if msg.expected_bootstraps < 1:
            raise Refused("a RoomBootstrap must expect at least one decode stage", 400)
        if r is None or peer in r.dests or r.expected is None:
            return  # a new room, its own room again, or a room no decode has claimed yet
        if msg.expected_bootstraps != r.expected or len(r.dests) >= r.expected or \
                any(_overlap(layers, d.layers) for d in r.dests.values()):
            raise Refused(f"room {msg.room} is already bootstrapped by another decode "
                          "(a repeated bootstrap_room?)", 409)

    def _failed(self, peer: str, msg: m.RoomBootstrap, reason: str, status: int) -> Notice:
        return (peer, m.RoomFailed(msg.room, msg.nonce, self.rank, reason, status))

    def _evict_pending(self) -> list[Notice]:
        notices = []
        while self.pending.over():
            room = self.pending.evictee()
            notices += self.fail(room, f"room {room}: this prefill stage holds too many rooms "
                                 "whose requests have not arrived; the oldest of the decode "
                                 "with the most were dropped", 503)
        return notices

    def _mark_opened(self, r: PrefillRoom, now: float) -> None:
        if not r.opened:
            r.opened, r.opened_at = True, now
            self._unpend(r)

    def _unpend(self, r: PrefillRoom) -> None:
        for peer in r.dests:
            self.pending.remove(peer, r.room)

    def _room(self, room: int, now: float) -> PrefillRoom:
        r = self.live.get(room)
        if r is None:
            self.finished.pop(room, None)
            r = self.live[room] = PrefillRoom(room, now)
        return r

    def _end(self, r: PrefillRoom, ok: bool, reason: str, status: int = 500) -> None:
        del self.live[r.room]
        self._unpend(r)
        remember(self.finished, r.room, (ok, reason, status))
        if not ok:
            log.info("prefill room %d failed: %s", r.room, reason)
        if r.sends_in_flight:
            self.draining[r.room] = r
        else:
            self._release(r)

    def _release(self, r: PrefillRoom) -> None:
        held, r.held = r.held, []
        if held:
            self.release(r.room, held)
