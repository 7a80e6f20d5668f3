"""What goes back to a client: OpenAI-style errors, and one request's outputs turned into a
response, whole or streamed over SSE (text deltas, logprobs, usage)."""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from typing import TYPE_CHECKING

from fastapi.responses import Response

from pipefill.chunking.progress import PrefillProgress
from pipefill.server.async_engine import EngineDown
from pipefill.server.text import IncrementalDecoder, StopChecker, TokenLogprobs

if TYPE_CHECKING:
    from pipefill.server.app import Job, Served


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}  # e.g. Retry-After, or Connection: close

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}

    def response(self) -> Response:
        # ASCII-escaped: a message that quotes the client's text (a lone surrogate) still
        # encodes.
        return Response(json.dumps(self.body()), status_code=self.status,
                        media_type="application/json", headers=self.headers)


class RequestFailed(RuntimeError):
    """The stages could not finish this one request (the others go on). status: a 4xx when
    the request itself was at fault (a PD decode whose prefill refused it), else None."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def error_of(e: Exception) -> ApiError:
    """The answer for a request that failed after it was accepted."""
    if isinstance(e, ValueError):  # stage 0 rejected it: the request's own fault
        return ApiError(400, str(e))
    if isinstance(e, RequestFailed) and e.status is not None and 400 <= e.status < 500:
        return ApiError(e.status, str(e))  # not retried by the router, not a fault
    if isinstance(e, RequestFailed) and e.status in (502, 504):  # a PD decode's prefill peer
        return ApiError(e.status, str(e), kind="server_error")  # answered badly or too slowly
    if isinstance(e, RequestFailed):
        # Every parameter known to be bad is refused at the door, so a failure while
        # generating is the server's: 500, which the client may report or retry.
        return ApiError(500, f"the request failed while generating: {e}", kind="server_error")
    return ApiError(503, str(e), kind="server_error")


class Run:
    """Turns one request's outputs into OpenAI responses, streamed or whole."""

    def __init__(self, served: Served, job: Job):
        self.served, self.job = served, job
        self.decoder = IncrementalDecoder(served.tokenizer) if served.tokenizer else None
        self.stop = StopChecker(job.stops)
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.logprobs = TokenLogprobs() if job.logprobs is not None else None
        self.t0 = time.perf_counter()
        self.first_token_at: float | None = None
        self.cached_tokens = 0  # prompt tokens served from the prefix cache

    # -- the shared core: one output in, the new text out --
    async def events(self):
        """Yields text deltas (the echo first, when asked) until the request ends."""
        job = self.job
        if job.echo:
            yield job.prompt_text if job.prompt_text is not None else self._decode(job.prompt_ids)
        status = "aborted"  # unless it ends normally or the stages fail
        try:
            # aclosing: leaving early (a stop string, a disconnect) aborts at stage 0 at once.
            async with aclosing(self.served.engine.generate(
                    job.rid, job.prompt_ids, job.params, priority=job.priority)) as outputs:
                async for out in outputs:
                    for delta in self._on_output(out):
                        yield delta
                    if self.finish_reason:
                        break
            status = "ok"
        except (EngineDown, RequestFailed, ValueError):
            status = "error"
            raise
        finally:
            self._record(status)

    def _on_output(self, out) -> list[str]:
        if out.finish_reason == "error":
            raise RequestFailed(out.error or "no reason given", out.error_status)
        if out.prompt_logprobs is not None and self.job.echo and self.logprobs is not None:
            self._add_prompt_logprobs(out.prompt_logprobs)
        for size in out.chunk_sizes or []:
            self.served.metrics.chunk_size.observe(size)
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        deltas = [self._take(out)]
        if self.stop.stopped:
            self.finish_reason = "stop"
        elif out.finished:
            self.finish_reason = "stop" if out.finish_reason == "stop" else "length"
            deltas.append(self.stop.feed(self.decoder.flush() if self.decoder else ""))
            deltas.append(self.stop.flush())
        return [d for d in deltas if d]

    def _take(self, out) -> str:
        if out.new_token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.output_ids += out.new_token_ids
        text = self.decoder.push(out.new_token_ids) if self.decoder else ""
        if self.logprobs is not None and out.token_logprobs:
            self._add_logprobs(out)
        return self.stop.feed(text)

    def _add_prompt_logprobs(self, logprobs: list[float]) -> None:
        """With echo: the prompt's tokens first, the first one without a logprob."""
        tokens = [self._decode([t]) for t in self.job.prompt_ids]
        self.logprobs.add(tokens[0], None, None)
        for token, x in zip(tokens[1:], logprobs):
            self.logprobs.add(token, x, {token: x})

    def _add_logprobs(self, out) -> None:
        for i, token in enumerate(out.new_token_ids):
            tops = out.top_logprobs[i] if out.top_logprobs else []
            self.logprobs.add(self._decode([token]), out.token_logprobs[i],
                              {self._decode([t]): lp for t, lp in tops})

    def _decode(self, ids: list[int]) -> str:
        tok = self.served.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok else ""

    def _record(self, status: str) -> None:
        m = self.served.metrics
        m.requests.labels(status=status).inc()
        m.prompt_tokens.inc(len(self.job.prompt_ids))
        m.generation_tokens.inc(len(self.output_ids))
        end = time.perf_counter()
        m.e2e.observe(end - self.t0)
        if self.first_token_at is not None:
            m.ttft.observe(self.first_token_at - self.t0)
            if len(self.output_ids) > 1:
                m.tpot.observe((end - self.first_token_at) / (len(self.output_ids) - 1))

    def _progress_comment(self) -> str:
        """An SSE comment line (OpenAI clients skip them) that keeps the connection alive
        before the first token: the prefill's progress when stage 0 reports it (a prompt
        longer than one chunk), else that the request waits."""
        for item in (self.served.engine.load or {}).get("prefill") or []:
            if item[0] == self.job.rid:
                return f": {PrefillProgress.of(item).line()}\n\n"
        return ": waiting\n\n"

    def usage(self) -> dict:
        n_in, n_out = len(self.job.prompt_ids), len(self.output_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    # -- whole response --
    async def collect(self) -> dict:
        text = "".join([d async for d in self.events()])
        job = self.job
        logprobs = self._logprobs(self.logprobs.entries) if self.logprobs is not None else None
        if job.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": self.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": self.finish_reason}
            obj = "text_completion"
        return {"id": job.rid, "object": obj, "created": job.created,
                "model": self.served.model_name, "choices": [choice], "usage": self.usage()}

    def _logprobs(self, entries: list) -> dict:
        return TokenLogprobs.chat(entries) if self.job.chat else TokenLogprobs.completion(entries)

    # -- streamed response --
    async def sse(self, include_usage: bool):
        job = self.job
        obj = "chat.completion.chunk" if job.chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, first: bool = False) -> str:
            # The logprobs of the tokens that arrived since the last chunk (text held back
            # for a stop string or a split character comes later; its logprobs come now).
            entries = self.logprobs.unsent() if self.logprobs is not None else []
            logprobs = self._logprobs(entries) if entries else None
            if job.chat:
                d = {"role": "assistant", "content": delta or ""} if first else (
                    {"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": logprobs,
                          "finish_reason": finish}
            return _sse({"id": job.rid, "object": obj, "created": job.created,
                         "model": self.served.model_name, "choices": [choice]})
        try:
            if job.chat:
                yield chunk("", None, first=True)
            interval = self.served.serving.log_prefill_progress_interval
            async for delta in with_ticks(self.events(), interval):
                if delta is TICK:
                    if self.first_token_at is None:  # still in the queue or in prefill
                        yield self._progress_comment()
                    continue
                yield chunk(delta, None)
            yield chunk(None, self.finish_reason)
            if include_usage:
                yield _sse({"id": job.rid, "object": obj, "created": job.created,
                            "model": self.served.model_name, "choices": [],
                            "usage": self.usage()})
        except (EngineDown, RequestFailed, ValueError) as e:
            yield _sse(error_of(e).body())
        yield "data: [DONE]\n\n"


TICK = object()  # with_ticks: the interval passed without an item


async def with_ticks(items, interval_s: float):
    """The items of an async generator, with TICK whenever interval_s passes without one (0:
    never). Closing this closes the generator (a client that leaves aborts its request)."""
    if interval_s <= 0:
        async with aclosing(items):
            async for item in items:
                yield item
        return
    pending = asyncio.ensure_future(anext(items))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield TICK
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(items))
    finally:
        try:
            if not pending.done():  # left early: stop the generator's step before closing it
                pending.cancel()
                try:
                    await pending
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise  # the caller itself is being cancelled: let it
                except Exception:  # noqa: BLE001 - what the cancelled step ended in
                    pass
        finally:
            await items.aclose()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
