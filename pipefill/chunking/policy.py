"""Stage 0's chunk policy (ARCHITECTURE.md, 'The chunking room'): the one object the scheduler
asks for chunk sizes, next_chunk(L). It is fixed (C0 for every chunk) or dynamic (a fitted
predictor, refitted from real chunk timings with online calibration). A background profile,
run one prefill per idle turn of stage 0's loop, turns a fixed policy into the fitted one in
place, so the scheduler keeps asking the same object and holds no chunk size of its own.

The background profile runs on pages it borrows from a PageLender (the scheduler's KV manager)
and gives back before the next plan: no stage ever hears of them."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Protocol

from pipefill.chunking.calibration import OnlineCalibrator

if TYPE_CHECKING:
    from pipefill.chunking.startup import BackgroundProfile

log = logging.getLogger(__name__)

# Prefix length L > 0 -> size of the chunk that follows it.
Sizer = Callable[[int], int]


class PageLender(Protocol):
    def borrow(self, n: int) -> list[int] | None:
        """n free pages for scratch work outside any plan, or None when there is no room."""

    def give_back(self, pages: list[int]) -> None:
        """Borrowed pages, free again as if never lent."""


class ChunkPolicy:
    def __init__(self, c0: int, sizer: Sizer | None = None,
                 calibrator: OnlineCalibrator | None = None, info: dict | None = None,
                 background: BackgroundProfile | None = None):
        assert isinstance(c0, int) and c0 >= 1, f"C0 must be a positive int, got {c0!r}"
        self.c0 = c0
        self.sizer = sizer  # None: fixed chunks of C0
        self.calibrator = calibrator
        self.info = info if info is not None else {"mode": "fixed", "c0": c0}  # for "ready"
        self.background = background  # a profile still to run while idle

    def next_chunk(self, history_len: int) -> int:
        """Size of the chunk after history_len tokens already in the request's context: C0 from
        scratch, else the size predicted for that prefix (a cached prefix counts)."""
        if history_len == 0 or self.sizer is None:
            return self.c0
        return self.sizer(history_len)

    def observe(self, plan, result) -> None:
        """Online calibration from one micro-batch's timing (single-chunk prefills only)."""
        if self.calibrator is None or len(plan.seqs) != 1 or not result.stage_seconds:
            return
        work = plan.seqs[0]
        if work.num_tokens > 1:  # a prefill chunk, not a decode step
            self.calibrator.observe(work.num_tokens, work.start, max(result.stage_seconds))

    def idle_step(self, lender: PageLender) -> bool:
        """Stage 0's loop calls this when nothing is in flight and nothing waits: one prefill
        of the background profile, and after the last one the fitted policy replaces the
        fixed chunks. Idle means no prompt is half chunked, so the switch is at a request
        boundary. False when there was nothing to do."""
        bg = self.background
        if bg is None:
            return False
        try:
            if not bg.step(lender):
                return False
            if not bg.finished:
                return True
            new = bg.fitted_policy()
        except Exception as e:  # noqa: BLE001 - a failed profile keeps the fixed chunks
            log.warning("dynamic chunking disabled (background profile failed: %s); keeping "
                        "fixed chunks of %d tokens", e, self.c0)
            new = ChunkPolicy(self.c0, info={"mode": "fixed", "c0": self.c0,
                                             "fallback": str(e)})
        self.background = None
        self._become(new)
        return True

    def _become(self, new: ChunkPolicy) -> None:
        was = self.c0
        self.c0, self.sizer, self.calibrator, self.info = (new.c0, new.sizer, new.calibrator,
                                                           new.info)
        error = new.info.get("fit_rel_rms")
        log.info("dynamic chunking: profile ready, switched from fixed chunks of %d to %s "
                 "chunks, C0 %d%s", was, new.info["mode"], new.c0,
                 "" if error is None else f", quadratic fit error {100 * error:.1f}% RMS")
