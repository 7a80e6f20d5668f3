"""The stall watchdog: a stage that has work but makes no progress for --stage-stall-timeout
seconds is declared failed, like a stage that died.

Progress is observed, never reported: each stage's loop thread counts what it does in a small
file in the front end's private socket folder, mapped by the stage and by the front end. Only
the loop thread writes (a side thread would keep counting while the loop is wedged), and the
front end only reads, so a stage stopped by SIGSTOP, stuck in a C call or spinning in Python
leaves its counters frozen without having to say anything.

Per stage, four int64 counters:
  beats    stage 0 only: every loop iteration, every forward, every spin while it waits for
           a result
  passed   micro-batches this stage's loop finished and handed to its pipe (stage 0: launched
           down the pipe; the last stage: results for stage 0); control messages not counted
  retired  stage 0 only: results taken back from the last stage
  layers   every stage: layers its forwards finished (the general path; a lean decode step is
           short and counts as its forward). A chunk of a long prompt can take longer than the
           timeout on CPU (about a minute per 2,048 tokens at 128K of context for the default
           model on 2 cores), while each of its layers takes a few seconds: counting layers
           keeps such a chunk from looking stalled, and a stage wedged inside a forward still
           stops every counter.

Two rules, because the stages wait differently. Stage 0's loop never blocks for long (it polls
the front end every 50 ms and spins while results are out), so with requests in flight a
stage 0 whose beats stop for the timeout is stalled. Later stages block while they wait for
input, idle or not, so their silence says nothing; instead, while a micro-batch is out
(passed by stage 0, not yet retired) some counter must move within the timeout, and when none
does, the stage holding the oldest micro-batch is named: the first whose `passed` is behind
it (it never finished it), or the last stage if all passed it on (its result never reached a
stage 0 that is still beating). So a stage blocked on a wedged neighbour is not blamed: the
upstream one keeps beating or has passed its work on, the downstream one simply waits.

What cannot be told apart: a middle stage (not the first, not the last) frozen in the
milliseconds between handing a micro-batch to its sender thread and the send is blamed on the
next stage (the counters look the same as a next stage frozen before it took the micro-batch);
nor a wedged stage from one whose single layer outlasts the timeout, hence the advice in the
flag's help. Stages on other nodes cannot map the file: a micro-batch that stops at one of them
names the first stage there, as "on another node".
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

BOARD_FILE = "heartbeat"
_FIELDS = 4
_BEATS, _PASSED, _RETIRED, _LAYERS = range(_FIELDS)


def board_path(folder: str) -> str:
    return os.path.join(folder, BOARD_FILE)


class Board:
    """The mapped file: _FIELDS int64 counters per stage. One writer per stage slot (that
    stage's loop thread); aligned 8-byte stores, so a reader sees each counter whole."""

    def __init__(self, path: str):
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.values = memoryview(self._map).cast("q")

    @staticmethod
    def create(path: str, num_stages: int) -> "Board":
        with open(path, "wb") as f:
            f.write(bytes(8 * _FIELDS * num_stages))
        return Board(path)

    def read(self, rank: int) -> list[int]:
        """[beats, passed, retired, layers] of one stage."""
        return self.values[rank * _FIELDS:(rank + 1) * _FIELDS].tolist()


class StageHeartbeat:
    """A stage's side; only its loop thread may call these."""

    def __init__(self, board: Board, rank: int):
        self.values = board.values
        self.base = rank * _FIELDS

    def beat(self) -> None:
        self.values[self.base + _BEATS] += 1

    def passed_on(self) -> None:
        self.values[self.base + _PASSED] += 1

    def retired(self) -> None:
        self.values[self.base + _RETIRED] += 1

    def layer_done(self) -> None:
        self.values[self.base + _LAYERS] += 1


class NoHeartbeat:
    """Stages nobody watches: on another node than the front end, or loops driven in memory."""

    def beat(self) -> None:
        pass

    def passed_on(self) -> None:
        pass

    def retired(self) -> None:
        pass

    def layer_done(self) -> None:
        pass


def stage_heartbeat(folder: str | None, rank: int) -> StageHeartbeat | NoHeartbeat:
    """The heartbeat of stage rank, on the board its front end made in folder (if any)."""
    if folder is None or not os.path.exists(board_path(folder)):
        return NoHeartbeat()
    return StageHeartbeat(Board(board_path(folder)), rank)


class _Clock:
    """When a value last moved while it had to (or last had nothing to do)."""

    def __init__(self, value, now: float):
        self.value, self.since = value, now

    def update(self, value, busy: bool, now: float) -> None:
        if value != self.value or not busy:
            self.value, self.since = value, now

    def stalled_for(self, now: float) -> float:
        return now - self.since


@dataclass(frozen=True)
class Stall:
    rank: int
    seconds: float  # with work and no progress
    timeout_s: float
    watched: bool = True  # False: a stage on another node, named by where work stopped

    def sentence(self, pid: int | None) -> str:
        who = f"stage {self.rank}" + (f" (pid {pid})" if pid is not None else "")
        if not self.watched:
            who += " (on another node)"
        return (f"{who} stalled: it had work but made no progress for {self.seconds:.1f} s "
                f"(--stage-stall-timeout {self.timeout_s:g})")


class StallWatch:
    """The front end's side: reads the board and tells when a stage with work stopped."""

    def __init__(self, board: Board, local: range, num_stages: int, timeout_s: float,
                 now: float):
        self.board, self.local, self.num_stages = board, local, num_stages
        self.timeout_s = timeout_s
        slots = self._read()
        self.stage0 = _Clock(self._stage0_moves(slots), now)
        self.pipeline = _Clock(self._progress(slots), now)

    def check(self, requests_in_flight: bool, now: float) -> Stall | None:
        """The stalled stage, if stage 0 had requests and did not beat, or a micro-batch was
        out and no stage progressed, for longer than the timeout."""
        slots = self._read()
        first = slots[0]
        self.stage0.update(self._stage0_moves(slots), requests_in_flight, now)
        self.pipeline.update(self._progress(slots), first[_PASSED] > first[_RETIRED], now)
        if self.stage0.stalled_for(now) > self.timeout_s:
            return Stall(0, self.stage0.stalled_for(now), self.timeout_s)
        if self.pipeline.stalled_for(now) > self.timeout_s:
            rank = self._holder(slots)
            return Stall(rank, self.pipeline.stalled_for(now), self.timeout_s,
                         rank in self.local)
        return None

    def _read(self) -> dict[int, list[int]]:
        return {rank: self.board.read(rank) for rank in self.local}

    @staticmethod
    def _stage0_moves(slots: dict[int, list[int]]) -> tuple:
        return slots[0][_BEATS], slots[0][_LAYERS]

    @staticmethod
    def _progress(slots: dict[int, list[int]]) -> tuple:
        return (tuple(slot[_PASSED] for slot in slots.values())
                + tuple(slot[_LAYERS] for slot in slots.values()) + (slots[0][_RETIRED],))

    def _holder(self, slots: dict[int, list[int]]) -> int:
        """The stage that holds the oldest micro-batch still out."""
        oldest = slots[0][_RETIRED] + 1
        for rank in range(1, self.num_stages):
            if rank not in slots or slots[rank][_PASSED] < oldest:
                return rank
        return self.num_stages - 1  # it passed its result on; stage 0 never got it
