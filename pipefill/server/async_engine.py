"""The server's side of the stages: start them, stream each request's outputs to its asyncio
task, watch the stages, fail every request fast when one dies or stalls, then restart them.
Starting, sending and routing are the front-end core's (frontend.FrontEnd, shared with the
Python Engine); this module adds the asyncio side and the healing.

A reader thread owns the receiving socket, the stage watch and the restarts (the supervisor);
the event loop only sends. A stage that has work but makes no progress for
--stage-stall-timeout seconds (runtime/heartbeat.py) is stopped and counts as dead. After a
stage dies, requests in flight get an error at once, the whole stage group is started again
with the same arguments (fresh addresses and ports; the failed group has killed its
leftovers), and requests that arrive meanwhile wait up to
--stage-restart-timeout. More than --max-stage-restarts within --stage-restart-window seconds
is a crash loop: the server stays down and says why on /health (it keeps running so that an
operator or orchestrator can read the reason; restarting again would only repeat the loop).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

from pipefill.base.plan import NewRequest, PDInfo, RequestOutput, SamplingParams
from pipefill.config import ServerArgs
from pipefill.frontend import FrontEnd
from pipefill.model.loader import WeightSource
from pipefill.runtime.launch import RestartBudget, StageFailure, StageGroup

log = logging.getLogger("pipefill.server")


class EngineDown(RuntimeError):
    """The stages are not (or no longer) serving."""


class AsyncEngine:
    def __init__(self, args: ServerArgs, source: WeightSource, on_restart=None):
        self.core = FrontEnd(args, source)
        self.ready = False
        self.failure: str | None = None
        self.restarting = False  # a stage died and the supervisor is starting a fresh group
        self.num_restarts = 0
        self._on_restart = on_restart or (lambda: None)  # e.g. a metrics counter
        self._budget = RestartBudget(args.max_stage_restarts, args.stage_restart_window)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stopping = threading.Event()
        self._pd: dict[str, PDInfo] = {}  # rid -> its PD room, until generate() sends it

    @property
    def args(self) -> ServerArgs:
        return self.core.args

    @property
    def source(self) -> WeightSource:
        return self.core.source

    @property
    def kv_capacity_tokens(self) -> int:
        return self.core.kv_capacity_tokens

    @property
    def load(self) -> dict:
        """Stage 0's latest load report ({} while the stages are down)."""
        return self.core.load

    # ---- lifecycle (start() runs in a thread: loading takes a while) ---------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts the stages and waits until they serve. After stop_loading() (the server
        stops while they load) it stops them and returns without a failure."""
        self._loop = loop
        try:
            self.core.launch()
            self.core.wait_ready(cancelled=self._stopping.is_set)
        except StageFailure as e:
            if self._stopping.is_set():
                log.info("stopped while the stages were loading")
                return
            self.failure = str(e)
            raise
        self._reader = threading.Thread(target=self._supervise, name="pipefill-reader",
                                        daemon=True)
        self._reader.start()
        self.ready = True
        log.info("stages ready: %d stage(s), KV cache of %d tokens", self.args.pp_size,
                 self.kv_capacity_tokens)

    def stop_loading(self) -> None:
        """The server is stopping: a start() still waiting for the stages stops them itself
        within wait_ready's poll, rather than have shutdown() close them under it."""
        self._stopping.set()

    def shutdown(self) -> None:
        self._stopping.set()
        if self._reader is not None:
            self._reader.join(5)
        if self.core.stages is not None and self.args.trace_dir and self.failure is None:
            self._write_trace()
        self.core.close()
        self.ready = False

    def _write_trace(self) -> None:
        events = self.core.collect_trace(timeout_s=10)
        if events:
            stats = self.core.write_trace("serve", events)
            log.info("trace written to %s", stats["json"])

    @property
    def healthy(self) -> bool:
        return self.ready and self.failure is None

    # ---- requests ----------------------------------------------------------------------------

    def new_rid(self, prefix: str) -> str:
        return self.core.new_rid(prefix)

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """The front door's check (make_job answers its ValueError with a 400)."""
        self.core.check_prompt(ids, params)

    def attach_pd(self, rid: str, pd: PDInfo) -> None:
        """The PD room of request rid (the router's bootstrap fields), sent with it."""
        self._pd[rid] = pd

    async def generate(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                       pd: PDInfo | None = None, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes; aborts it if the caller goes away
        (a client disconnect cancels the task that iterates here)."""
        pd = self._pd.pop(rid, pd)
        if self.restarting:
            await self.wait_until_up()
        if not self.healthy:
            raise EngineDown(self.failure or "the model is still loading")
        queue: asyncio.Queue = asyncio.Queue()
        finished = False
        try:
            try:
                self.core.submit([NewRequest(rid, prompt_ids, params, pd, priority)],
                                 [queue.put_nowait])
            except StageFailure as e:  # the reader thread handles the failure itself
                raise EngineDown(str(e)) from None
            while not finished:
                out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finished
                yield out
        finally:
            if finished or self.failure is not None:
                self.core.release(rid)
            else:
                self.core.abort(rid)

    async def wait_until_up(self) -> None:
        """Waits while the stages restart; EngineDown after --stage-restart-timeout."""
        deadline = time.monotonic() + self.args.stage_restart_timeout
        while self.restarting:
            if time.monotonic() > deadline:
                raise EngineDown(
                    "the stages are restarting after a failure and were not back within "
                    f"--stage-restart-timeout {self.args.stage_restart_timeout} s; retry later")
            await asyncio.sleep(0.05)

    # ---- the reader thread: read, watch, restart ------------------------------------------------

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            cause = self._read_until_failure()
            if cause is None or not self._restart(cause):
                return

    def _read_until_failure(self) -> str | None:
        """Forwards messages to the event loop until a stage fails (returns why) or the server
        stops (returns None)."""
        while not self._stopping.is_set():
            try:
                msg = self.core.recv(100)
                # A stage that hangs instead of dying: --stage-stall-timeout.
                self.core.check_progress()
            except StageFailure as e:
                log.error("a stage failed: %s", e)
                # Set before the requests are failed: a request that comes in after this
                # waits for the restart instead of being sent to the dead group.
                self.restarting = self._restartable
                self.failure = str(e)
                self.core.load = {}
                self._loop.call_soon_threadsafe(self.fail_all, str(e))
                return str(e)
            if msg is not None:
                self._loop.call_soon_threadsafe(self.core.route, msg)
        return None

    def _restart(self, cause: str) -> bool:
        """Starts a fresh stage group with the same arguments until one is ready (True), the
        restart budget is spent, or the server stops (False)."""
        while not self._stopping.is_set():
            if not self._restartable or not self._budget.take(time.monotonic()):
                self._give_up(cause)
                return False
            self.failure = f"a stage failed ({cause}); restarting the stages"
            log.warning("restarting the stages after: %s", cause)
            try:
                self._launch_on_loop()
                self.core.wait_ready(cancelled=self._stopping.is_set)
            except StageFailure as e:
                log.error("the restarted stages failed: %s", e)
                cause = str(e)
                continue
            self.num_restarts += 1
            self._on_restart()
            self.failure = None
            self.restarting = False
            log.info("stages restarted (%d restart(s) so far); serving again",
                     self.num_restarts)
            return True
        self.restarting = False
        return False

    def _launch_on_loop(self) -> StageGroup:
        """Starts the stage processes from the event loop's thread: a stage dies with the
        thread that started it (PR_SET_PDEATHSIG), and this reader thread ends before the
        stages are stopped at shutdown."""
        async def launch() -> StageGroup:
            return self.core.launch()
        return asyncio.run_coroutine_threadsafe(launch(), self._loop).result()

    @property
    def _restartable(self) -> bool:
        # The stages of other nodes are started by their own `pipefill serve --node-rank N`,
        # which this process cannot restart: a multi-node pipeline stays down.
        return self.args.max_stage_restarts > 0 and self.args.nnodes == 1

    def _give_up(self, cause: str) -> None:
        n, window = self.args.max_stage_restarts, self.args.stage_restart_window
        if n == 0:
            self.failure = cause  # restarts are off: the failure itself is the reason
        elif self.args.nnodes > 1:
            self.failure = (f"{cause}; a multi-node pipeline is not restarted automatically: "
                            "restart `pipefill serve` on every node")
        else:
            self.failure = (f"the stages failed again after {n} restart(s) within {window} s "
                            f"(--max-stage-restarts {n}, --stage-restart-window {window}); not "
                            f"restarting them: restart the server once the cause is fixed. "
                            f"Last failure: {cause}")
            log.error("%s", self.failure)
        self.restarting = False

    def fail_all(self, message: str) -> None:
        """Ends every request in flight with an error (their pages are freed by the aborts
        that their generators send on the way out)."""
        self.core.fail_all(EngineDown(message))
