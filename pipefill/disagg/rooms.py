"""Room state machines of both sides, pure Python (time comes in as `now`, nothing here does
I/O): the transfer threads feed them received messages and clock ticks, and send what they
return. Every page a room holds goes back through the `release(room, pages)` callback exactly
once, on every ending: success (prefill), failure, abort, timeout, dead peer.

The prefill side is prefill_rooms.py, the decode side decode_rooms.py; this module holds what
both use: peer liveness, a map whose entries expire, and the memory of ended rooms.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from pipefill.disagg import messages as m

Release = Callable[[int, list[int]], None]
Notice = tuple[str, m.Message]  # (peer, message to send it)
FINISHED_MEMORY = 4096  # ended rooms remembered, to tell "late" from "unknown" and keep results


class Liveness:
    """Heartbeat bookkeeping: a peer unseen for interval * max_misses seconds is dead."""

    def __init__(self, interval_s: float, max_misses: int):
        if interval_s <= 0 or max_misses < 1:
            raise ValueError("--disaggregation-heartbeat-interval must be > 0 and "
                             "--disaggregation-heartbeat-max-misses at least 1")
        self.limit_s = interval_s * max_misses
        self._last: dict[str, float] = {}

    def seen(self, peer: str, now: float) -> None:
        self._last[peer] = now

    def forget(self, peer: str) -> None:
        self._last.pop(peer, None)

    def dead(self, now: float) -> list[str]:
        gone = [p for p, t in self._last.items() if now - t > self.limit_s]
        for p in gone:
            del self._last[p]
        return gone


class TTLMap:
    """A bounded map whose entries expire ttl_s after they were put; when full, the oldest
    entry goes first. Time comes in as `now`."""

    def __init__(self, ttl_s: float, max_size: int):
        if ttl_s <= 0 or max_size < 1:
            raise ValueError(f"a TTL map needs ttl_s > 0 and max_size >= 1, got {ttl_s}, "
                             f"{max_size}")
        self.ttl_s, self.max_size = ttl_s, max_size
        self._d: OrderedDict = OrderedDict()  # key -> (expires_at, value), oldest first

    def put(self, key, value, now: float) -> None:
        self._d.pop(key, None)
        self._d[key] = (now + self.ttl_s, value)
        self._expire(now)
        while len(self._d) > self.max_size:
            self._d.popitem(last=False)

    def get(self, key, now: float):
        """The value, or None when absent or expired."""
        self._expire(now)
        entry = self._d.get(key)
        return None if entry is None else entry[1]

    def pop(self, key) -> None:
        self._d.pop(key, None)

    def __len__(self) -> int:
        return len(self._d)

    def _expire(self, now: float) -> None:
        # One TTL for all: insertion order is expiry order, so expired entries lead.
        while self._d and next(iter(self._d.values()))[0] <= now:
            self._d.popitem(last=False)


def remember(finished: OrderedDict, room: int, value) -> None:
    finished[room] = value
    finished.move_to_end(room)
    while len(finished) > FINISHED_MEMORY:
        finished.popitem(last=False)
