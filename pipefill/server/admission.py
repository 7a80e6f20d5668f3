"""How many requests the server holds at once: those being tokenized, waiting at stage 0 for a
slot, and running. Beyond --max-running-requests + --max-queued-requests a request gets a 429
at once instead of joining a queue that has no end (each held request keeps its prompt, its
token ids and an asyncio task in memory)."""
from __future__ import annotations

from collections.abc import Callable

from pipefill.server.responses import ApiError

QUEUE_RETRY_AFTER_S = 1


class Admission:
    """Counts held requests on the event loop's thread (no lock: only that thread counts)."""

    def __init__(self, max_running: int, max_queued: int, metrics=None):
        self.max_running, self.max_queued = max_running, max_queued
        self.held = 0
        self.metrics = metrics  # a ServerMetrics, or None

    @property
    def limit(self) -> int:
        return self.max_running + self.max_queued

    def hold(self) -> Callable[[], None]:
        """Takes a place for one request and returns the call that gives it back (a second
        call does nothing); a 429 with Retry-After when every place is taken."""
        if self.held >= self.limit:
            self._count_refusal()
            raise ApiError(
                429, f"the server is full: {self.held} requests are running or queued "
                     f"(--max-running-requests {self.max_running} + --max-queued-requests "
                     f"{self.max_queued}); retry after {QUEUE_RETRY_AFTER_S} s",
                kind="rate_limit_error", headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)})
        self._set_held(self.held + 1)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._set_held(self.held - 1)
        return release

    def _set_held(self, n: int) -> None:
        self.held = n
        if self.metrics is not None:
            self.metrics.held.set(n)

    def _count_refusal(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_full.inc()
