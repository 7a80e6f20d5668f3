"""The micro-batch loop of stage 0: schedule, run, update, with a queue of plans in flight.

With one stage a plan's results come straight from the local forward; with P stages the plan
travels down the pipe with its activations and its results come back from the last stage, and
up to `max_inflight` plans are in flight, retired oldest first.
"""
from __future__ import annotations

import logging
import time
from collections import deque

from pipefill.runtime.executor import StageExecutor
from pipefill.runtime.ipc import StageChannel
from pipefill.scheduler.plan import RequestOutput, StepPlan, StepResult
from pipefill.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

IDLE_POLL_MS = 50


class FirstStageLoop:
    def __init__(self, executor: StageExecutor, scheduler: Scheduler, channel: StageChannel,
                 pipe=None, max_inflight: int = 1, tracer=None):
        self.executor = executor
        self.scheduler = scheduler
        self.channel = channel
        self.pipe = pipe  # None when this stage is also the last
        self.max_inflight = max_inflight if pipe is not None else 1
        self.tracer = tracer
        self.inflight: deque[StepPlan] = deque()
        self.stopping = False

    def run(self) -> None:
        while not (self.stopping and not self.inflight):
            idle = not self.inflight and not self.scheduler.has_work
            self._ingest(IDLE_POLL_MS if idle else 0)
            self._launch()
            self._retire_oldest()
        if self.pipe is not None:
            self.pipe.send_stop()

    # ---- messages from the front end ---------------------------------------------------------

    def _ingest(self, timeout_ms: int) -> None:
        for kind, payload in self.channel.poll(timeout_ms):
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                out = self.scheduler.abort(payload)
                if out is not None:
                    self.channel.report("outputs", [out])
            elif kind == "stats":
                self.channel.report("stats", self.stats())
            elif kind == "stop":
                self._stop()

    def _add(self, requests) -> None:
        for req in requests:
            try:
                self.scheduler.add(req)
            except ValueError as e:
                self.channel.report("rejected", (req.rid, str(e)))

    def _stop(self) -> None:
        self.stopping = True
        for r in list(self.scheduler.waiting) + list(self.scheduler.running.values()):
            out = self.scheduler.abort(r.rid)
            if out is not None:
                self.channel.report("outputs", [out])

    def stats(self) -> dict:
        pool = self.scheduler.pool
        try:
            pool.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = str(e)
        return {"pages_total": pool.num_pages, "pages_free": pool.num_free,
                "pages_used": pool.num_used, "integrity": integrity,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "page_size": self.scheduler.cfg.page_size}

    # ---- schedule / run / update -------------------------------------------------------------

    def _launch(self) -> None:
        while len(self.inflight) < self.max_inflight and not self.stopping:
            plan = self.scheduler.schedule()
            if plan is None:
                return
            acts, seconds = self.executor.forward(plan, None)
            if self.pipe is None:
                result = self.executor.results(plan, acts)
                result.stage_seconds = [seconds]
                self._update(plan, result)
            else:
                self.pipe.send_forward(plan, acts)
                self.inflight.append(plan)

    def _retire_oldest(self) -> None:
        if not self.inflight:
            return
        result = self.pipe.recv_result()
        plan = self.inflight.popleft()
        assert result.step_id == plan.step_id, "results came back out of order"
        self._update(plan, result)

    def _update(self, plan: StepPlan, result: StepResult) -> None:
        outputs: list[RequestOutput] = self.scheduler.update(plan, result)
        if outputs:
            self.channel.report("outputs", outputs)


def run_guarded(name: str, channel: StageChannel, body) -> int:
    """Runs a stage's main loop; any exception becomes one 'fatal' report naming the stage."""
    try:
        body()
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the front end, then the process exits
        log.exception("%s failed", name)
        channel.report("fatal", f"{name} failed: {type(e).__name__}: {e}")
        time.sleep(0.1)
        return 1
