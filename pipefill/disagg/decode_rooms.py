"""Decode stage, per room: waits until every prefill stage it expects has delivered every page (and
said it was the last) and the final metadata arrived for this very room and attempt (nonce);
fails when no prefill stage made progress on it for --disaggregation-waiting-timeout (a chunk;
until the first chunk arrives, also a heartbeat naming it: a lease that a prefill stuck after
it started the room cannot renew forever), when a prefill stage reports a failure or dies, or
on abort.
A failed room releases its pages only when no write into them can still happen: no local
receive in progress, and with one-sided transports, every live prefill stage acknowledged the
drop (or the grace time passed).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from pipefill.disagg import messages as m
from pipefill.disagg.rooms import Notice, Release, remember

log = logging.getLogger(__name__)

@dataclass
class RoomResult:
    room: int
    ok: bool
    reason: str = ""
    pages: list[int] = field(default_factory=list)  # handed to the caller on success
    final: m.FinalMeta | None = None
    status: int = 500  # of a failure: the HTTP status to answer (4xx: the prefill refused it)


@dataclass
class DecodeRoom:
    room: int
    nonce: int
    dst_pages: list[int]
    stages: dict[str, tuple[int, int]]  # prefill stage -> the layers it must deliver here
    want_final: bool
    num_prompt_tokens: int | None
    progress_at: float
    delivered: dict[str, set[int]] = field(default_factory=dict)  # stage -> page offsets
    last_from: set[str] = field(default_factory=set)
    final: m.FinalMeta | None = None
    failed: str | None = None  # reason, once failed (the room may still be draining)
    writes_in_flight: int = 0
    acks_pending: set[str] = field(default_factory=set)
    drain_deadline: float = 0.0
    dst_window: list[int] = field(default_factory=list)  # window page per page, -1: none

    def complete(self) -> bool:
        n = len(self.dst_pages)
        return (self.last_from >= set(self.stages)
                and all(len(self.delivered.get(s, ())) == n for s in self.stages)
                and (self.final is not None or not self.want_final))


class DecodeRooms:
    def __init__(self, waiting_timeout_s: float, release: Release, one_sided: bool = False,
                 drain_grace_s: float = 10.0):
        self.waiting_timeout_s = waiting_timeout_s
        self.release = release
        self.one_sided = one_sided  # remote writers: wait for DropAcks before reuse
        self.drain_grace_s = drain_grace_s
        self.live: dict[int, DecodeRoom] = {}
        self.results: OrderedDict[int, RoomResult] = OrderedDict()
        self.dead_stages: set[str] = set()
        self.num_dropped = 0

    def expect(self, room: int, nonce: int, dst_pages: list[int],
               stages: dict[str, tuple[int, int]], now: float, want_final: bool = True,
               num_prompt_tokens: int | None = None, dst_window: list[int] = ()) -> None:
        """dst_window: with window layers that keep pages of their own, the window page of
        each of dst_pages (-1: none), which the prefill stages' last chunks fill."""
        if room in self.live:
            raise ValueError(f"room {room} is already waiting for its KV (a repeated "
                             "bootstrap_room)")
        if not stages:
            raise ValueError("a room needs at least one prefill stage")
        self.results.pop(room, None)
        self.live[room] = DecodeRoom(room, nonce, list(dst_pages), dict(stages), want_final,
                                     num_prompt_tokens, now, dst_window=list(dst_window))

    def begin_chunk(self, stage: str, msg: m.KVChunk) -> list[int] | None:
        """The destination pages of a valid chunk (a write into them is now in flight), or
        None: the chunk is dropped (an unknown, finished or failed room, an earlier attempt,
        pages or layers this stage does not own here)."""
        r = self._valid(stage, msg.room, msg.nonce)
        if r is None:
            return None
        layers = r.stages[stage]
        end = msg.page_offset + msg.num_pages
        if (msg.layer_start, msg.layer_end) != layers or msg.page_offset < 0 or \
                msg.num_pages < 0 or end > len(r.dst_pages):
            self.num_dropped += 1
            log.warning("dropped a KV chunk of room %d from %s: pages [%d, %d) of %d, layers "
                        "[%d, %d) (expected %s)", msg.room, stage, msg.page_offset, end,
                        len(r.dst_pages), msg.layer_start, msg.layer_end, layers)
            return None
        r.writes_in_flight += 1
        return r.dst_pages[msg.page_offset:end]

    def window_dst(self, msg: m.KVChunk) -> tuple[list[int], str | None]:
        """(the window pages a chunk begun here fills, None), or ([], why) when its window
        pages are not the room's: the last chunk of each stage carries exactly the pages
        whose window page is not -1, the others none (ARCHITECTURE.md, 'Window pages')."""
        r = self.live[msg.room]
        wanted = [i for i, p in enumerate(r.dst_window) if p != -1] if msg.is_last else []
        if list(msg.window_pages) != wanted:
            return [], (f"the prefill sent the window layers' KV of pages "
                        f"{list(msg.window_pages)[:8]} where this decode holds window pages "
                        f"for {wanted[:8]} (the two sides' window tables differ)")
        return [r.dst_window[i] for i in wanted], None

    def end_chunk(self, stage: str, msg: m.KVChunk, now: float, ok: bool = True) -> None:
        r = self.live.get(msg.room)
        if r is None or r.nonce != msg.nonce:
            return
        r.writes_in_flight -= 1
        if r.failed is None and ok:
            r.delivered.setdefault(stage, set()).update(
                range(msg.page_offset, msg.page_offset + msg.num_pages))
            if msg.is_last:
                r.last_from.add(stage)
            r.progress_at = now
            self._maybe_ready(r)
        self._maybe_release(r, now)

    def on_final(self, stage: str, msg: m.FinalMeta, now: float) -> list[Notice]:
        r = self._valid(stage, msg.room, msg.nonce)
        if r is None:
            return []
        if r.num_prompt_tokens is not None and msg.num_prompt_tokens != r.num_prompt_tokens:
            return self._fail(r, f"the prefill ran {msg.num_prompt_tokens} prompt tokens, this "
                              f"decode expected {r.num_prompt_tokens} (tokenizers or chat "
                              "templates differ)", now)
        r.final = msg
        r.progress_at = now
        self._maybe_ready(r)
        return []

    def on_failed(self, stage: str, msg: m.RoomFailed, now: float) -> list[Notice]:
        r = self._valid(stage, msg.room, msg.nonce)
        if r is None:
            return []
        if 400 <= msg.status < 500:  # the prefill refused the request: its sentence as is
            return self._fail(r, msg.reason, now, msg.status)
        return self._fail(r, f"prefill stage {msg.rank} failed: {msg.reason}", now, msg.status)

    def on_drop_ack(self, stage: str, msg: m.DropAck, now: float) -> None:
        r = self.live.get(msg.room)
        if r is not None and r.nonce == msg.nonce:
            r.acks_pending.discard(stage)
            self._maybe_release(r, now)

    def on_heartbeat(self, stage: str, rooms: list[int], now: float) -> None:
        """A prefill stage that works on a room keeps it from timing out until its KV starts
        arriving; from then on only chunks (and the final metadata) count as progress, so a
        prefill whose heartbeat thread lives on while its room is stuck cannot hold the room's
        pages forever."""
        for room in rooms:
            r = self.live.get(room)
            if r is not None and stage in r.stages and r.failed is None and not r.delivered:
                r.progress_at = now

    def on_stage_dead(self, stage: str, now: float) -> list[Notice]:
        self.dead_stages.add(stage)
        notices = []
        for r in list(self.live.values()):
            if stage not in r.stages:
                continue
            r.acks_pending.discard(stage)
            if r.failed is None:
                notices += self._fail(r, f"prefill stage {stage} stopped answering", now)
            else:
                self._maybe_release(r, now)
        return notices

    def on_stage_alive(self, stage: str) -> None:
        self.dead_stages.discard(stage)

    def abort(self, room: int, reason: str, now: float) -> list[Notice]:
        r = self.live.get(room)
        if r is None or r.failed is not None:
            return []
        return self._fail(r, reason, now)

    def tick(self, now: float) -> list[Notice]:
        notices = []
        for r in list(self.live.values()):
            if r.failed is None and now - r.progress_at > self.waiting_timeout_s:
                notices += self._fail(
                    r, f"no KV from the prefill for room {r.room} within "
                    f"--disaggregation-waiting-timeout ({self.waiting_timeout_s:g} s)", now)
            elif r.failed is not None and r.acks_pending and now >= r.drain_deadline:
                log.warning("room %d: no drop acknowledgement from %s; reusing its pages",
                            r.room, sorted(r.acks_pending))
                r.acks_pending.clear()
                self._maybe_release(r, now)
        return notices

    def result(self, room: int) -> RoomResult | None:
        return self.results.get(room)

    def take_result(self, room: int) -> RoomResult | None:
        return self.results.pop(room, None)

    def _valid(self, stage: str, room: int, nonce: int) -> DecodeRoom | None:
        r = self.live.get(room)
        if r is None or r.nonce != nonce or r.failed is not None or stage not in r.stages:
            self.num_dropped += 1
            log.debug("dropped a message for room %d from %s (unknown, ended, or another "
                      "attempt)", room, stage)
            return None
        return r

    def _maybe_ready(self, r: DecodeRoom) -> None:
        if r.failed is None and r.writes_in_flight == 0 and r.complete():
            # The stale-room check: the final metadata must be for this room and attempt.
            assert r.final is None or (r.final.room, r.final.nonce) == (r.room, r.nonce)
            del self.live[r.room]
            remember(self.results, r.room, RoomResult(r.room, True, "", r.dst_pages, r.final))

    def _fail(self, r: DecodeRoom, reason: str, now: float, status: int = 500) -> list[Notice]:
        log.info("decode room %d failed: %s", r.room, reason)
        r.failed = reason
        remember(self.results, r.room, RoomResult(r.room, False, reason, status=status))
        alive = [s for s in r.stages if s not in self.dead_stages]
        if self.one_sided:
            r.acks_pending = set(alive)
            r.drain_deadline = now + self.drain_grace_s
        self._maybe_release(r, now)
        return [(s, m.DropRoom(r.room, r.nonce, reason)) for s in alive]

    def _maybe_release(self, r: DecodeRoom, now: float) -> None:
        if r.failed is None or r.writes_in_flight > 0 or r.acks_pending:
            return
        if self.live.get(r.room) is r:
            del self.live[r.room]
            self.release(r.room, r.dst_pages)


# ---------------------------------------------------------------- a decode pipeline

@dataclass
class PipelineRoom:
    waiting: set[int]  # decode stages whose layers have not all arrived
    holding: set[int]  # decode stages whose receiver may still write into the room's pages
    failed: bool = False


class DecodePipelineRooms:
    """Decode stage 0's view of one room across the decode pipeline (every stage receives
    its own layers from the prefill stages that hold them): the room is ready only when every
    stage has all of its layers, it fails on the first stage that fails, and its pages may be
    reused only once no stage's receiver can still write into them. Pure bookkeeping: each
    call returns what the caller must now do, a subset of {"ready", "fail", "release"}."""

    def __init__(self, pp_size: int):
        self.pp_size = pp_size
        self.live: dict[int, PipelineRoom] = {}

    def open(self, room: int) -> None:
        stages = set(range(self.pp_size))
        self.live[room] = PipelineRoom(set(stages), set(stages))

    def ready(self, room: int, stage: int) -> set[str]:
        """The stage has every page of its layers (its receiver let go of the room)."""
        r = self.live.get(room)
        if r is None:
            return set()
        r.waiting.discard(stage)
        r.holding.discard(stage)
        if r.failed:
            return self._maybe_released(room, r)
        if not r.waiting:
            del self.live[room]
            return {"ready"}
        return set()

    def fail(self, room: int) -> set[str]:
        """A stage failed (or the request was aborted): "fail" the first time only."""
        r = self.live.get(room)
        if r is None or r.failed:
            return set()
        r.failed = True
        return {"fail"} | self._maybe_released(room, r)

    def released(self, room: int, stage: int) -> set[str]:
        """The stage's receiver will not write into the room's pages any more."""
        r = self.live.get(room)
        if r is None:
            return set()
        r.holding.discard(stage)
        return self._maybe_released(room, r)

    def _maybe_released(self, room: int, r: PipelineRoom) -> set[str]:
        if r.failed and not r.holding:
            del self.live[room]
            return {"release"}
        return set()
