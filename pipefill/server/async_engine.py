"""The server's side of the stages: start them, stream each request's outputs to its asyncio
task, watch the stages and fail every request fast when one dies.

A reader thread owns the receiving socket (and the stage watch); the event loop only sends.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator

from pipefill.config import ServerArgs
from pipefill.model.loader import WeightSource
from pipefill.runtime.launch import StageFailure, StageGroup
from pipefill.scheduler.plan import NewRequest, RequestOutput, SamplingParams

log = logging.getLogger("pipefill.server")


class EngineDown(RuntimeError):
    """The stages are not (or no longer) serving."""


class AsyncEngine:
    def __init__(self, args: ServerArgs, source: WeightSource):
        self.args = args
        self.source = source
        self.ready = False
        self.failure: str | None = None
        self.load: dict = {}
        self.kv_capacity_tokens = 0
        self._stages: StageGroup | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ids = itertools.count()

    # ---- lifecycle (start() runs in a thread: loading takes a while) ---------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        try:
            self._stages = StageGroup(self.args, self.source.path)
            info = self._stages.wait_ready()
        except StageFailure as e:
            self.failure = str(e)
            raise
        self.kv_capacity_tokens = info["num_pages"] * self.args.page_size
        self._reader = threading.Thread(target=self._read, name="pipefill-reader", daemon=True)
        self._reader.start()
        self.ready = True
        log.info("stages ready: %d stage(s), KV cache of %d tokens", self.args.pp_size,
                 self.kv_capacity_tokens)

    def shutdown(self) -> None:
        self._stopping.set()
        if self._reader is not None:
            self._reader.join(5)
        if self._stages is not None and self.args.trace_dir and self.failure is None:
            self._write_trace()
        if self._stages is not None:
            self._stages.close()
            self._stages = None
        self.ready = False

    def _write_trace(self) -> None:
        from pipefill.runtime.trace import write_trace
        replies = self._stages.gather("trace", "trace", timeout_s=10)
        events = [e for rank in sorted(replies) for e in replies[rank]]
        if events:
            stats = write_trace(self.args.trace_dir, "serve", events, self.args.pp_size)
            log.info("trace written to %s", stats["json"])

    @property
    def healthy(self) -> bool:
        return self.ready and self.failure is None

    # ---- requests ----------------------------------------------------------------------------

    def new_rid(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def generate(self, rid: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes; aborts it if the caller goes away
        (a client disconnect cancels the task that iterates here)."""
        if not self.healthy:
            raise EngineDown(self.failure or "the model is still loading")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            self._stages.send("add", [NewRequest(rid, prompt_ids, params)])
            while not finished:
                out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(rid, None)
            if not finished and self._stages is not None and self.failure is None:
                self._stages.send("abort", rid, block=False)

    # ---- the reader thread -------------------------------------------------------------------

    def _read(self) -> None:
        while not self._stopping.is_set():
            try:
                msg = self._stages.recv(100)
            except StageFailure as e:
                log.error("a stage failed: %s", e)
                self.failure = str(e)
                self._loop.call_soon_threadsafe(self.fail_all, str(e))
                return
            if msg is not None:
                self._loop.call_soon_threadsafe(self._dispatch, msg)

    def _dispatch(self, msg: tuple) -> None:
        kind, payload = msg
        if kind == "outputs":
            for out in payload:
                queue = self._queues.get(out.rid)
                if queue is not None:
                    queue.put_nowait(out)
        elif kind == "rejected":
            rid, message = payload
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(ValueError(message))
        elif kind == "load":
            self.load = payload

    def fail_all(self, message: str) -> None:
        """Ends every request in flight with an error (their pages are freed by the aborts
        that their generators send on the way out)."""
        for queue in self._queues.values():
            queue.put_nowait(EngineDown(message))
