"""The role a server plays in PD disaggregation (ARCHITECTURE.md, 'Prefill/decode
disaggregation'), one object given to stage 0's scheduler and to every stage's loop. NullRole is
the protocol and the default (no disaggregation); PrefillRole and DecodeRole are what the
scheduler asks of a PD server, pure Python and tested without processes; pipefill.disagg.roles
adds the KV transfer plane to them (the loop's hooks).

The scheduler asks the role (stage 0):
  add(r, pd)               a new request: True when it joins the compute queue
  take_waiting(rid)        an aborted request the role still keeps outside the scheduler
  waits_for_kv(r)          r is admitted but its KV is still on its way: schedule nothing of it
  refuses_abort(rid)       the request must run to its end (another server waits for its KV)
  aborted(r)               an admitted request was aborted
  on_chunk(r, work, ps)    a chunk of r was planned: the role may mark it (the room to send to)
  holds_pages(r)           r's pages must stay (a transfer still reads or writes them)
  forget(r)                r's pages went back: drop what the role kept about it
  awaits_kv                stage 0 expects reports from the transfer plane: poll often
The loop calls (every stage; stage 0 only where a scheduler is named):
  after_forward(plan)              a micro-batch's forward ran on this stage
  poll(scheduler) -> outputs       stage 0, between steps: the transfer plane's news
  take_down() -> (ops, page_ops)   stage 0: room operations for the later stages, or None
  after_update(scheduler, outputs) stage 0: a micro-batch's outputs
  on_kv_done(scheduler, event)     stage 0: a later stage's (room, rank) report, via the pipe
  on_control(ops)                  a later stage: room operations from stage 0
  stats() -> dict                  stage 0: the role's counters for the stats report
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipefill.base.plan import PDInfo, RequestOutput, SeqWork, room_in_use

if TYPE_CHECKING:  # the scheduler imports this module for its default role
    from pipefill.scheduler.scheduler import Request, Scheduler


class NullRole:
    """No disaggregation: every request is computed here and its pages go when it is done."""

    awaits_kv = False

    # ---- the scheduler asks -------------------------------------------------------------------

    def add(self, r: Request, pd: PDInfo | None) -> bool:
        return True

    def take_waiting(self, rid: str) -> Request | None:
        return None

    def waits_for_kv(self, r: Request) -> bool:
        return False

    def refuses_abort(self, rid: str) -> bool:
        return False

    def aborted(self, r: Request) -> None:
        pass

    def on_chunk(self, r: Request, work: SeqWork, page_size: int) -> None:
        pass

    def holds_pages(self, r: Request) -> bool:
        return False

    def forget(self, r: Request) -> None:
        pass

    # ---- the loop calls -----------------------------------------------------------------------

    def after_forward(self, plan) -> None:
        pass

    def poll(self, scheduler: Scheduler) -> list[RequestOutput]:
        return []

    def take_down(self):
        return None

    def after_update(self, scheduler: Scheduler, outputs: list[RequestOutput]) -> None:
        pass

    def on_kv_done(self, scheduler: Scheduler, event: tuple[int, int]) -> None:
        pass

    def on_control(self, ops) -> None:
        pass

    def stats(self) -> dict:
        return {}


@dataclass
class HeldRoom:
    """Prefill: a PD request's room, whose pages stay until every stage's sender is done."""
    room: int
    request: Request
    num_holding: int  # stages whose KV sender still reads the request's pages
    num_sent_pages: int = 0  # pages handed to the senders so far


class PrefillRole(NullRole):
    """A PD prefill: computes the prompt as usual, marks each chunk with the room its whole
    pages go to, runs a PD request to its end whatever happens to its client (its decode waits
    for the KV), and keeps its pages until every one of the pipeline's `num_stages` senders
    let them go (stage_done)."""

    def __init__(self, num_stages: int):
        self.num_stages = num_stages
        self.rooms: dict[int, HeldRoom] = {}
        self._by_rid: dict[str, HeldRoom] = {}

    @property
    def awaits_kv(self) -> bool:
        return bool(self.rooms)  # the senders' reports free the pages

    def room_live(self, room: int) -> bool:
        return room in self.rooms

    def add(self, r: Request, pd: PDInfo | None) -> bool:
        if pd is None:
            return True
        if self.room_live(pd.room):
            # Taking it would hand the first request's pages and transfer to this one.
            raise ValueError(room_in_use(pd.room))
        self.rooms[pd.room] = self._by_rid[r.rid] = HeldRoom(pd.room, r, self.num_stages)
        return True

    def refuses_abort(self, rid: str) -> bool:
        return rid in self._by_rid

    def on_chunk(self, r: Request, work: SeqWork, page_size: int) -> None:
        held = self._by_rid.get(r.rid)
        if held is None or work.start >= len(r.prompt_ids):
            return
        # Whole pages only; the partial last page goes with the chunk that ends the prompt.
        work.room, work.kv_send_from = held.room, held.num_sent_pages * page_size
        held.num_sent_pages = kv_send_end(work, page_size)

    def held(self, rid: str) -> HeldRoom | None:
        """The room of a PD request, from its admission until its pages went back."""
        return self._by_rid.get(rid)

    def holds_pages(self, r: Request) -> bool:
        held = self._by_rid.get(r.rid)
        return held is not None and held.num_holding > 0

    def forget(self, r: Request) -> None:
        held = self._by_rid.pop(r.rid, None)
        if held is not None:
            self.rooms.pop(held.room, None)

    def stage_done(self, scheduler: Scheduler, room: int) -> None:
        """One stage's sender let the room's pages go (sent, or the room failed)."""
        held = self.rooms.get(room)
        if held is None or held.num_holding <= 0:
            return
        held.num_holding -= 1
        scheduler.release_if_done(held.request)


@dataclass
class AwaitedRoom:
    """Decode: a PD request whose prompt's KV comes from a prefill server."""
    request: Request
    pd: PDInfo
    arriving: bool = True  # its KV and first token are not here yet
    held: bool = True  # the transfer may still write into its pages (the receiver has them)


class DecodeRole(NullRole):
    """A PD decode: a PD request waits (`waiting`) until pages for its whole prompt are free,
    is admitted into them (admit) while its KV arrives, then decodes from the prefill's first
    token exactly as if it had computed its prompt (kv_arrived). Its pages go back on every
    ending, whatever the order of the room's result and the receiver's release."""

    def __init__(self):
        self.waiting: deque[AwaitedRoom] = deque()  # not admitted yet: no pages
        self.rooms: dict[int, AwaitedRoom] = {}  # admitted, until their pages went back
        self._by_rid: dict[str, AwaitedRoom] = {}
        self.dropped: list[int] = []  # aborted while their KV was arriving: tell the receiver

    @property
    def awaits_kv(self) -> bool:
        return any(a.arriving for a in self.rooms.values())

    def room_live(self, room: int) -> bool:
        """A request of this server holds the room (admitted, or waiting for pages)."""
        return room in self.rooms or any(a.pd.room == room for a in self.waiting)

    def add(self, r: Request, pd: PDInfo | None) -> bool:
        if pd is None:
            return True
        if self.room_live(pd.room):
            raise ValueError(room_in_use(pd.room))
        self.waiting.append(AwaitedRoom(r, pd))
        return False

    def take_waiting(self, rid: str) -> Request | None:
        for a in self.waiting:
            if a.request.rid == rid:
                self.waiting.remove(a)
                return a.request
        return None

    def waits_for_kv(self, r: Request) -> bool:
        a = self._by_rid.get(r.rid)
        return a is not None and a.arriving

    def aborted(self, r: Request) -> None:
        a = self._by_rid.get(r.rid)
        if a is not None and a.arriving:
            self.dropped.append(a.pd.room)

    def holds_pages(self, r: Request) -> bool:
        a = self._by_rid.get(r.rid)
        return a is not None and a.held

    def forget(self, r: Request) -> None:
        a = self._by_rid.pop(r.rid, None)
        if a is not None:
            self.rooms.pop(a.pd.room, None)

    def admit(self, scheduler: Scheduler) -> list[AwaitedRoom]:
        """Admits waiting requests into pages for their whole prompt, in arrival order; the
        caller asks the prefill for their KV."""
        admitted = []
        while self.waiting and scheduler.admit_for_kv(self.waiting[0].request):
            a = self.waiting.popleft()
            self.rooms[a.pd.room] = self._by_rid[a.request.rid] = a
            admitted.append(a)
        return admitted

    def take_dropped(self) -> list[int]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def kv_arrived(self, scheduler: Scheduler, room: int, token: int, logprob: float | None,
                   top, seed: int | None) -> RequestOutput | None:
        """The prompt's KV and first token are here; the request decodes from now on."""
        a = self.rooms.get(room)
        if a is None or not a.arriving:
            return None
        a.arriving = a.held = False  # a success hands the pages over
        return scheduler.continue_after_prompt(a.request, token, logprob, top, seed)

    def kv_failed(self, scheduler: Scheduler, room: int, reason: str) -> RequestOutput | None:
        """The room failed; its pages go back once the receiver released them."""
        a = self.rooms.get(room)
        if a is None or a.request.done:
            return None
        a.arriving = False
        return scheduler.fail(a.request, reason)

    def kv_released(self, scheduler: Scheduler, room: int) -> None:
        """The receiver will not write into the room's pages any more."""
        a = self.rooms.get(room)
        if a is not None:
            a.held = False
            scheduler.release_if_done(a.request)


def kv_send_end(work: SeqWork, page_size: int) -> int:
    """PD prefill: pages of the request complete after this chunk (all of them, the partial
    last one included, once the chunk ends the prompt)."""
    if work.sample is not None:
        return -(-work.end // page_size)
    return work.end // page_size
