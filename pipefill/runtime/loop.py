"""The micro-batch loops. Stage 0: schedule, run, update, with a queue of plans in flight.
Later stages: receive, run, pass on. The loops talk to the outside through three small
interfaces (executor, pipe, channel), so a process-free test can drive them in memory.

With one stage a plan's results come straight from the local forward; with P stages the plan
travels down the pipe with its activations, its results come back from the last stage, and up
to `max_inflight` plans are in flight, retired oldest first. Consecutive chunks of one request
go into consecutive micro-batches: every stage runs micro-batches in arrival order, so chunk k's
KV is in place when chunk k+1 reaches any stage.

Every loop is given the stage's PD role (pipefill.scheduler.role; NullRole without
disaggregation) and calls its hooks around the micro-batches. A later stage's KV transfer
reports reach stage 0 inside the pipeline: the stage's threads post them into its own inbound
queue (report_to_first), its loop passes them down, and the last stage sends them back on the
results' way (a StepResult of REPORT_STEP).
"""
from __future__ import annotations

import logging
import time
from collections import deque

from pipefill.chunking.progress import ProgressClock
from pipefill.runtime.heartbeat import NoHeartbeat
from pipefill.runtime.trace import StageTracer, plan_label
from pipefill.base.plan import REPORT_STEP, PipeMessage, RequestOutput, StepPlan, StepResult
from pipefill.scheduler.role import NullRole
from pipefill.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

IDLE_POLL_MS = 50
# A PD role that awaits its transfer plane's reports (a decode's rooms waiting for their KV, a
# prefill's pages still read by its senders): their threads cannot wake the front-end poll, so
# a room that became ready waited up to a whole idle poll (measured: a mean 27 ms of the 45 ms
# from the prefill's last forward to the first token).
KV_WAIT_POLL_MS = 1
LOAD_REPORT_S = 0.2  # the server's /metrics reads these pushed snapshots


class FirstStageLoop:
    def __init__(self, executor, scheduler: Scheduler, channel, pipe=None,
                 max_inflight: int = 1, tracer: StageTracer | None = None, on_result=None,
                 chunk_policy=None, heartbeat=None):
        self.executor = executor
        self.scheduler = scheduler
        self.channel = channel  # front end: poll() requests, report() events
        self.pipe = pipe  # None when this stage is also the last
        self.max_inflight = max_inflight if pipe is not None else 1
        self.tracer = tracer or StageTracer(0, False)
        self.on_result = on_result  # (plan, result) -> None: online chunk-cost calibration
        # PD disaggregation (pipefill.scheduler.role): the scheduler's role, with its hooks
        self.role = scheduler.role
        # chunking.ChunkPolicy: its idle_step runs a background profile's prefills
        self.chunk_policy = chunk_policy
        # runtime.heartbeat: the front end's stall watchdog reads these counters
        self.heartbeat = heartbeat or NoHeartbeat()
        self.inflight: deque[StepPlan] = deque()
        self.progress = ProgressClock()  # long prefills' ages and ETAs, for the load reports
        self.stopping = False
        self._load_changed = False
        self._load_reported_at = 0.0

    def run(self) -> None:
        while not (self.stopping and not self.inflight):
            self.heartbeat.beat()
            idle = not self.inflight and not self.scheduler.has_work
            wait = KV_WAIT_POLL_MS if self.role.awaits_kv else IDLE_POLL_MS
            arrived = self._ingest(wait if idle else 0)
            self._poll_role()
            if idle and not arrived and self.chunk_policy is not None and \
                    not self.stopping and not self.scheduler.has_work:
                # Nothing came during an idle poll: one prefill of a background profile, on
                # pages the KV manager lends it.
                self.chunk_policy.idle_step(self.scheduler.kv)
            nothing_to_launch = not self._launch()
            self._retire_ready(must_wait=nothing_to_launch or self.stopping
                               or len(self.inflight) >= self.max_inflight)
            self._report_load()
        # The last page decisions go with the stop, and with them (write_back) the saves of
        # the pages still in the pool: each stage writes them before it closes its store.
        self.scheduler.kv.on_stop()
        ops = self.scheduler.kv.drain_ops()
        self.executor.apply_page_ops(ops)
        if self.pipe is not None:
            self.pipe.send_forward(PipeMessage(None, control=("stop",), page_ops=ops), None)
            self.pipe.flush()
        self.executor.close()

    # ---- messages from the front end ---------------------------------------------------------

    def _report_load(self) -> None:
        """Pushes a stats snapshot when something changed, at most every LOAD_REPORT_S."""
        now = time.monotonic()
        if self._load_changed and now - self._load_reported_at >= LOAD_REPORT_S:
            self.channel.report("load", self.stats())
            self._load_changed, self._load_reported_at = False, now

    def _ingest(self, timeout_ms: int) -> int:
        messages = self.channel.poll(timeout_ms)
        self._load_changed |= bool(messages)
        for kind, payload in messages:
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                out = self.scheduler.abort(payload)
                if out is not None:
                    self.channel.report("outputs", [out])
            elif kind in ("stats", "trace"):
                self._control(kind)
            elif kind == "stop":
                self._stop()
        return len(messages)

    def _poll_role(self) -> None:
        free = self.scheduler.pool.num_free
        if self.pipe is not None and not self.inflight:
            stray = self._recv_result()  # later stages' reports: no plan is in flight
            assert stray is None, "a result came back for no micro-batch in flight"
        outputs = self.role.poll(self.scheduler)
        # Pages a transfer let go change the load without an output (PD decode frees a failed
        # room's pages once every stage's receiver let go, maybe a poll after its error).
        self._load_changed |= self.scheduler.pool.num_free != free
        down = self.role.take_down() if self.pipe is not None else None
        if down is not None:  # PD decode: room ops for the later stages, ahead of any plan
            ops, page_ops = down
            self.pipe.send_forward(PipeMessage(None, control=("pd", ops), page_ops=page_ops),
                                   None)
        if outputs:
            self._load_changed = True
            self.channel.report("outputs", outputs)

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

    def _control(self, kind: str) -> None:
        """Every stage reports (its spans, its stats); the control message follows the
        micro-batches in flight down the pipe, so each stage answers after them. It carries
        the page frees since the last plan, so every stage's page map is current."""
        ops = self.scheduler.kv.drain_ops()
        self.executor.apply_page_ops(ops)
        report_control(kind, 0, self.channel, self.tracer, self.executor, self.stats)
        if self.pipe is not None:
            self.pipe.send_forward(PipeMessage(None, control=(kind,), page_ops=ops), None)

    def stats(self) -> dict:
        pool, window = self.scheduler.pool, self.scheduler.kv.window
        try:
            pool.check_integrity()
            if window is not None:
                window.pool.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = str(e)
        info = self.chunk_policy.info if self.chunk_policy is not None else None
        prefill = self.progress.report(self.scheduler.long_prefills(),
                                       (info or {}).get("coefficients"))
        return {"rank": 0, "pages_total": pool.num_pages, "pages_free": pool.num_free,
                "pages_used": pool.num_used, "pages_peak": pool.peak_used,
                "integrity": integrity,
                "owned_pages": self.executor.kv.owners.num_used,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "inflight_micro_batches": len(self.inflight),
                "page_size": self.scheduler.cfg.page_size, **self.scheduler.kv.stats(),
                **window_owner_stats(self.executor), **self.role.stats(),
                "chunking": info, "prefill": [p.as_list() for p in prefill],
                "memory": self.executor.memory}

    # ---- schedule / run / update -------------------------------------------------------------

    def _launch(self) -> bool:
        """Launches micro-batches into free slots; False when the scheduler had nothing."""
        while len(self.inflight) < self.max_inflight and not self.stopping:
            plan = self.scheduler.schedule()
            if plan is None:
                return False
            with self.tracer.span("forward", "forward", step=plan.step_id,
                                  label=plan_label(plan)):
                acts, seconds = self.executor.forward(plan, None)
            self.heartbeat.beat()  # one per step: up to max_inflight steps run back to back
            self.role.after_forward(plan)
            failed = self.executor.kv.take_failed_fetches()
            if self.pipe is None:
                result = self.executor.results(plan, acts)
                result.stage_seconds, result.failed_fetches = [seconds], failed
                self._update(plan, result)
                return True  # one step, then read the front end again: new requests join
            else:
                with self.tracer.span("send", "send", step=plan.step_id):
                    self.pipe.send_forward(PipeMessage(plan, [seconds], failed_fetches=failed),
                                           acts)
                self.heartbeat.passed_on()
                self.inflight.append(plan)
                # The front end's news before the next launch: a request aborted during this
                # forward gets no further chunk (only those already in flight finish).
                self._ingest(0)
        return True

    def _retire_ready(self, must_wait: bool) -> None:
        """Retires finished micro-batches; waits for the oldest only when nothing else can
        be launched, and keeps reading the front end while it waits."""
        if not self.inflight:
            return
        result = self._recv_result()
        if must_wait and result is None:
            with self.tracer.span("wait", "wait"):
                while (result := self._recv_result()) is None:
                    # Alive while a later stage works: the watchdog must not blame stage 0.
                    self.heartbeat.beat()
                    if self._ingest(1) and len(self.inflight) < self.max_inflight:
                        return  # a new request may use a free slot now
        while result is not None:
            plan = self.inflight.popleft()
            assert result.step_id == plan.step_id, "results came back out of order"
            self.heartbeat.retired()
            self._update(plan, result)
            result = self._recv_result()

    def _recv_result(self) -> StepResult | None:
        """The next plan's result if it is back; the later stages' KV transfer reports that
        came back before it (alone or with results) go to the role on the way."""
        while self.pipe.result_ready():
            result = self.pipe.recv_result()
            for room, rank in result.kv_done:
                self.role.on_kv_done(self.scheduler, (room, rank))
            if result.step_id != REPORT_STEP:
                return result
        return None

    def _update(self, plan: StepPlan, result: StepResult) -> None:
        self._load_changed = True
        if self.on_result is not None:
            self.on_result(plan, result)
        outputs: list[RequestOutput] = self.scheduler.update(plan, result)
        self.role.after_update(self.scheduler, outputs)
        if outputs:
            self.channel.report("outputs", outputs)


def report_control(kind: str, rank: int, channel, tracer, executor, stats=None) -> None:
    if kind == "trace":
        channel.report("trace", (rank, tracer.drain()))
    elif kind == "stats":
        channel.report("stage_stats",
                       (rank, stats() if stats else later_stage_stats(rank, executor)))


def later_stage_stats(rank: int, executor) -> dict:
    """A later stage owns no allocator: it replays stage 0's page decisions from the plans
    (executor.kv.owners) and checks every micro-batch against them; a violation raises (and
    stops the stage with a sentence naming the request and the page), so a stage that answers
    is consistent. Its pages in use must equal stage 0's."""
    stats = {"rank": rank, "pages_total": executor.cache.num_pages,
             "pages_used": executor.kv.owners.num_used,
             "owned_pages": executor.kv.owners.num_used,
             "micro_batches": executor.num_forwards, "integrity": "ok",
             "memory": executor.memory}
    stats.update(executor.kv.stats())
    stats.update(window_owner_stats(executor))
    return stats


def window_owner_stats(executor) -> dict:
    """The window pages this stage's replay says are in use (ARCHITECTURE.md, 'Window
    pages'): equal to stage 0's window pool's on every stage."""
    owners = executor.kv.window_owners
    return {} if owners is None else {"window_owned_pages": owners.num_used}


def report_to_first(pipe):
    """A later stage's PD role reports (room, rank) to stage 0 with this, from any thread:
    the report wakes this stage's loop, which passes it on down the pipe (run_later_stage)."""
    def report(event: tuple[int, int]) -> None:
        pipe.post_local(PipeMessage(None, control=("kv_done", [list(event)])))
    return report


def run_later_stage(executor, pipe, channel, tracer: StageTracer | None = None,
                    role=None, heartbeat=None) -> None:
    """Stages 1..P-1: execute each micro-batch as it comes, pass it on (or return results).
    role: the stage's PD role (pipefill.scheduler.role). heartbeat (runtime.heartbeat) counts
    the micro-batches finished, for the front end's stall watchdog."""
    tracer = tracer or StageTracer(pipe.rank, False)
    role = role or NullRole()
    heartbeat = heartbeat or NoHeartbeat()
    last = pipe.rank == pipe.size - 1
    while True:
        with tracer.span("recv", "recv"):
            msg, acts = pipe.recv_forward()
        if msg.control is not None:
            if msg.page_ops is not None:
                executor.apply_page_ops(msg.page_ops)
            if msg.control[0] == "pd":  # PD decode: room ops from stage 0
                role.on_control(msg.control[1])
            report_control(msg.control[0], pipe.rank, channel, tracer, executor)
            if msg.control[0] == "kv_done" and last:
                pipe.send_result(StepResult(REPORT_STEP, kv_done=[
                    (room, rank) for room, rank in msg.control[1]]))
            elif not last:
                pipe.send_forward(msg, None)
            if msg.control[0] == "stop":
                executor.close()
                break
            continue
        plan = msg.plan
        with tracer.span("forward", "forward", step=plan.step_id, label=plan_label(plan)):
            acts, seconds = executor.forward(plan, acts)
            role.after_forward(plan)  # PD prefill: queue this stage's pages of the plan
            result = executor.results(plan, acts) if last else None
        stage_seconds = msg.stage_seconds + [seconds]
        failed = msg.failed_fetches + executor.kv.take_failed_fetches()
        with tracer.span("send", "send", step=plan.step_id):
            if last:
                result.stage_seconds, result.failed_fetches = stage_seconds, failed
                pipe.send_result(result)
            else:
                pipe.send_forward(PipeMessage(plan, stage_seconds, failed_fetches=failed), acts)
        heartbeat.passed_on()
    pipe.flush()


def run_guarded(name: str, channel, body) -> int:
    """Runs a stage's main loop; any exception becomes one 'fatal' report naming the stage."""
    try:
        body()
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the front end, then the process exits
        log.exception("%s failed", name)
        channel.report("fatal", f"{name} failed: {type(e).__name__}: {e}")
        time.sleep(0.1)
        return 1
