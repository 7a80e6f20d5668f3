"""Which prompts in prefill get the next chunks (`--schedule-policy`).

A step's token budget goes first to decode tokens (running requests keep streaming whatever the
policy), then to one chunk of a prompt longer than a chunk (the first in the order a policy
gives that can take one), then to whole short prompts (one chunk each), which every policy lets
start beside it. The policies differ on which long prompt takes the step's chunk:

- `fcfs`: one long prompt at a time, in arrival order: it gets every chunk until its first
  token, and a second long prompt waits for it.
- `fair`: long prompts start as pages allow and share the chunks by the tokens each has been
  given: the one given fewest goes first, equals take turns. A prompt arriving behind a long
  one runs until it has had as many tokens as that one (a medium prompt usually finishes
  first), then they alternate; so a prompt's first token waits for its own chunks plus a
  share of the others', never for the whole of a longer prompt that came before it, and
  every prompt finishes (each newcomer goes ahead only until it has caught up).
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

    def served(self, r: Prefilling, tokens: int) -> None:
        """r took a chunk of `tokens` prompt tokens."""

    def forget(self, rid: str) -> None:
        """rid left the scheduler."""


class FairOrder(PrefillOrder):
    name = "fair"

    def __init__(self):
        self._turn = 0
        self._last: dict[str, int] = {}  # rid -> turn of its last chunk
        self._tokens: dict[str, int] = {}  # rid -> prompt tokens it has been given so far

    def prefill_order(self, partial, waiting):
        # The prompt given the fewest tokens so far first (a new prompt at once, and a
        # medium one until it has had as many as the long one ahead of it), then the least
        # recently served: equals take turns. A stable sort keeps arrival order in a tie.
        return sorted([*partial, *waiting],
                      key=lambda r: (self._tokens.get(r.rid, 0), self._last.get(r.rid, -1)))

    def may_start_long(self, r, partial):
        return True

    def served(self, r, tokens):
        self._turn += 1
        self._last[r.rid] = self._turn
        self._tokens[r.rid] = self._tokens.get(r.rid, 0) + tokens

    def forget(self, rid):
        self._last.pop(rid, None)
        self._tokens.pop(rid, None)


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
