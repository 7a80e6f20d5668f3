"""Which prompts in prefill get the next chunks (`--schedule-policy`).

A step's token budget goes first to decode tokens (running requests keep streaming whatever the
policy), then to one chunk of a prompt longer than a chunk (the first in the order a policy
gives that can take one), then to whole short prompts (one chunk each), which every policy lets
start beside it. The policies differ on which long prompt takes the step's chunk:

- `fcfs`: one long prompt at a time, in arrival order: it gets every chunk until its first
  token, and a second long prompt waits for it.
- `fair`: long prompts start as pages allow and take chunks in turn (the one served least
  recently first), so a prompt's first token waits for its own chunks plus a share of the
  others', not for the whole of a longer prompt that came before it.
- `priority`: a request's `priority` field (larger goes first; ties in arrival order); a prompt
  of higher priority than every prompt in prefill starts at once and takes the chunks, a chunk
  already launched finishes, and the paused prompt resumes where it stopped.

Each prompt keeps its own sequence of chunk sizes (the chunk policy sizes a chunk by the
tokens already in that prompt's context), so interleaving does not change what any chunk
computes: the tokens are the same under every policy.
"""
from __future__ import annotations

from typing import Protocol, Sequence

POLICIES = ("fcfs", "fair", "priority")


class Prefilling(Protocol):
    """What an order reads of a request (scheduler.Request has these)."""
    rid: str
    admitted_at: int
    priority: int


class PrefillOrder:
    """fcfs: the base of the others."""
    name = "fcfs"

    def prefill_order(self, partial: Sequence[Prefilling], waiting: Sequence[Prefilling]
                      ) -> list[Prefilling]:
        """Who may take a chunk this step, first served first: prompts in prefill (in
        admission order) and waiting prompts (in arrival order). The scheduler gives each at
        most one chunk while the step's budget lasts, admitting a waiting one first (a long
        one only where may_start_long says so)."""
        return [*partial[:1], *waiting]

    def may_start_long(self, r: Prefilling, partial: Sequence[Prefilling]) -> bool:
        """Whether r, a prompt longer than one chunk, may start while `partial` are in
        prefill (pages permitting)."""
        return not partial

    def served(self, r: Prefilling) -> None:
        """r took a chunk."""

    def forget(self, rid: str) -> None:
        """rid left the scheduler."""


class FairOrder(PrefillOrder):
    name = "fair"

    def __init__(self):
        self._turn = 0
        self._last: dict[str, int] = {}  # rid -> turn of its last chunk

    def prefill_order(self, partial, waiting):
        # Never served first (a new prompt takes its first chunk at once), then the least
        # recently served; a stable sort keeps admission and arrival order in a tie.
        return sorted([*partial, *waiting], key=lambda r: self._last.get(r.rid, -1))

    def may_start_long(self, r, partial):
        return True

    def served(self, r):
        self._turn += 1
        self._last[r.rid] = self._turn

    def forget(self, rid):
        self._last.pop(rid, None)


class PriorityOrder(PrefillOrder):
    name = "priority"

    def prefill_order(self, partial, waiting):
        # Larger priority first; in a tie, prompts in prefill before waiting ones, each in
        # admission or arrival order (a stable sort).
        return sorted([*partial, *waiting], key=lambda r: -r.priority)

    def may_start_long(self, r, partial):
        return all(r.priority > p.priority for p in partial)


def make_prefill_order(policy: str) -> PrefillOrder:
    orders = {"fcfs": PrefillOrder, "fair": FairOrder, "priority": PriorityOrder}
    if policy not in orders:
        raise ValueError(f"unknown schedule policy {policy!r}: choose one of {', '.join(POLICIES)}")
    return orders[policy]()
