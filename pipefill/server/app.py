"""The OpenAI-compatible HTTP API over the pipeline: /v1/completions, /v1/chat/completions
(streaming over SSE), /v1/models, /health and /metrics."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from pipefill.chunking.progress import PrefillProgress
from pipefill.config import DisaggMode, Disaggregation, Serving
from pipefill.disagg.http_fields import ROUTER_MODEL, FieldError, pd_info
from pipefill.model.tokenizer import NO_TEMPLATE
from pipefill.base.plan import SamplingParams
from pipefill.server.admission import Admission
from pipefill.server.async_engine import AsyncEngine, EngineDown
from pipefill.server.metrics import ServerMetrics
from pipefill.server.protocol import (MAX_STOP_CHARS, MAX_STOP_STRINGS, ChatCompletionRequest,
                                      CompletionRequest, ErrorResponse, loads_body)
from pipefill.server.responses import ApiError, RequestFailed, Run, error_of
from pipefill.server.text import longest_token_bytes

log = logging.getLogger("pipefill.server")

# Below this many characters a prompt is tokenized on the event loop: handing it to the
# tokenizer thread costs more (SmolLM2's tokenizer: 100 characters 0.07 ms inline, 0.25 ms
# through the thread; even at 1,000; a 0.9 MB prompt takes 0.7 s, which would stop every
# other request and /health for as long).
INLINE_TOKENIZE_CHARS = 1000
# How long a server stopped during loading waits for the start-up thread to stop the stages
# (it polls every 0.1 s, then gives them 1 s to exit) before closing them itself.
STOP_LOADING_S = 10.0


@dataclass
class Served:
    """Everything a route needs, built once at start-up."""
    engine: AsyncEngine
    tokenizer: object
    model_name: str
    api_key: str | None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    token_bytes: int = 0  # the most prompt bytes one token stands for
    # One thread: the tokenizer object is shared, and big prompts need not run side by side.
    tokenizer_thread: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        1, thread_name_prefix="pipefill-tokenizer"))
    admission: Admission | None = None

    def __post_init__(self):
        self.token_bytes = self.token_bytes or longest_token_bytes(self.tokenizer)
        self.admission = self.admission or Admission(
            self.args.max_running_requests, self.serving.max_queued_requests, self.metrics)

    @property
    def max_body_bytes(self) -> int:
        """Larger bodies cannot hold a prompt that fits --max-model-len (JSON may escape a
        byte as six), so they are refused before they are read whole."""
        return 2**20 + 6 * self.args.max_model_len * self.token_bytes

    @property
    def args(self):
        return self.engine.args

    @property
    def serving(self) -> Serving:
        return self.engine.args.serving

    @property
    def disagg(self) -> Disaggregation:
        return self.engine.args.disagg


def build_app(served: Served, on_startup_failure=None, shutting_down=None) -> FastAPI:
    """shutting_down: a callable that turns true when the server starts its graceful exit;
    requests still running shortly before the grace period ends are failed visibly (an
    error event and [DONE]) rather than cut off."""
    @asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()
        starting = loop.run_in_executor(None, served.engine.start, loop)
        starting.add_done_callback(lambda f: _startup_done(f, on_startup_failure))
        watcher = asyncio.create_task(_fail_late_requests(served, shutting_down))
        progress = asyncio.create_task(_log_prefill_progress(served))
        yield
        watcher.cancel()
        progress.cancel()
        # Stopped while the stages load: start() stops them and returns (ARCHITECTURE.md,
        # 'A request's path'); closing them from here would pull the sockets from under it.
        served.engine.stop_loading()
        await asyncio.wait([starting], timeout=STOP_LOADING_S)
        served.engine.shutdown()
        served.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pipefill", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return exc.response()

    @app.get("/health")
    async def health():
        e = served.engine
        insecure = served.disagg.insecure_warning
        note = {"warning": insecure} if insecure else {}
        if e.healthy:
            return {"status": "ok", **note}
        status = "down" if e.failure else "loading"
        return JSONResponse({"status": status, "error": e.failure, **note}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        served.metrics.observe_load(served.engine.load)
        served.metrics.healthy.set(1 if served.engine.healthy else 0)
        return Response(served.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(served, request)
        return {"object": "list", "data": [{
            "id": served.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "pipefill", "max_model_len": served.args.max_model_len}]}

    @app.post("/v1/completions", **_documented(CompletionRequest, "text_completion"))
    async def completions(request: Request):
        authorize(served, request)
        body = await parse(request, CompletionRequest, served)
        return await handle(served, request, body, chat=False)

    @app.post("/v1/chat/completions", **_documented(ChatCompletionRequest, "chat.completion"))
    async def chat_completions(request: Request):
        authorize(served, request)
        body = await parse(request, ChatCompletionRequest, served)
        return await handle(served, request, body, chat=True)

    vocab_size = served.engine.source.config.vocab_size
    app.openapi = lambda: _openapi(app, served.model_name, vocab_size)
    return app


_REF = "#/components/schemas/{model}"
_REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)


def _documented(model, obj: str) -> dict:
    """The route's OpenAPI: the body parse() checks (the route reads raw JSON itself, so that
    every error is an OpenAI-style 400, never FastAPI's 422) and the answers it gives."""
    ok = {"description": f"A {obj} object, or with stream: true server-sent events of "
                         f"{obj} chunks ending in 'data: [DONE]'",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    errors = {status: {"model": ErrorResponse, "description": why} for status, why in (
        (400, "Invalid request: a sentence says what to change"),
        (401, "Missing or wrong API key"),
        (408, "The body did not arrive within --body-read-timeout"),
        (413, "Request body too large for --max-model-len"),
        (415, "Content-Type is not application/json"),
        (429, "Running and queued requests are at their limit: retry after Retry-After"),
        (500, "The request failed while generating"),
        (503, "The model is loading, a stage is down, or --max-connections are open"))}
    body = {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}
    return {"openapi_extra": {"requestBody": body}, "responses": {200: ok, **errors}}


def _openapi(app: FastAPI, model_name: str, vocab_size: int) -> dict:
    """The generated schema plus the request models, with what only the running server knows:
    its model's name and vocabulary."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        models = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in _REQUEST_MODELS:
            js = model.model_json_schema(ref_template=_REF)
            models.update(js.pop("$defs", {}))
            js["properties"]["model"] = {"anyOf": [{"enum": [model_name]}, {"type": "null"}],
                                         "default": None, "description": "The served model"}
            models[model.__name__] = js
        _bound_prompt(models["CompletionRequest"]["properties"]["prompt"], vocab_size)
        app.openapi_schema = schema
    return app.openapi_schema


async def _fail_late_requests(served: Served, shutting_down) -> None:
    if shutting_down is None:
        return
    while not shutting_down():
        await asyncio.sleep(0.1)
    await asyncio.sleep(max(0.0, served.serving.shutdown_timeout - 1.0))
    served.engine.fail_all("the server is shutting down")


async def _log_prefill_progress(served: Served) -> None:
    """One line per long prompt in prefill every --log-prefill-progress-interval seconds, from
    stage 0's latest load report (a prefill of 100K+ tokens on CPU takes many minutes)."""
    interval = served.serving.log_prefill_progress_interval
    if interval <= 0:
        return
    while True:
        await asyncio.sleep(interval)
        for item in (served.engine.load or {}).get("prefill") or []:
            p = PrefillProgress.of(item)
            log.info("request %s: %s (%.0f%%, %.0f s since it was admitted)", p.rid, p.line(),
                     100 * p.done / max(p.total, 1), p.age_s)


def _startup_done(future, on_failure) -> None:
    if future.exception() is not None:
        log.error("%s", future.exception())
        if on_failure is not None:
            on_failure(future.exception())


def authorize(served: Served, request: Request) -> None:
    if served.api_key and request.headers.get("authorization") != f"Bearer {served.api_key}":
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                       kind="authentication_error")


async def parse(request: Request, model, served: Served):
    kind = request.headers.get("content-type")
    media = (kind or "").split(";")[0].strip().lower()
    if kind is not None and media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"Content-Type must be application/json, got {kind[:100]!r}")
    raw = await read_body(request, served.max_body_bytes, served.serving.body_read_timeout)
    try:
        data = loads_body(raw)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}", param=where) from None


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body within timeout_s of the request's headers (uvicorn has no body
    timeout: a client that stops half-way would hold its buffered bytes for as long as it
    keeps the connection). A 408 closes the connection; a client that left is one log line."""
    too_large = ApiError(413, f"the request body is larger than {limit} bytes, more than a "
                              f"prompt of --max-model-len tokens needs")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s "
                            f"(--body-read-timeout); {size} bytes came", headers={
                                "Connection": "close"}) from None
    except ClientDisconnect:
        log.info("a client (%s) disconnected after %d bytes of its request body to %s; "
                 "nothing was run", _peer(request), size, request.url.path)
        raise ApiError(499, "the client disconnected before its request body was complete",
                       headers={"Connection": "close"}) from None
    return b"".join(chunks)


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "unknown"


def _bound_prompt(prompt: dict, vocab_size: int) -> None:
    """One non-empty prompt: text, or token ids within the vocabulary (a list of one)."""
    ids = {"type": "array", "minItems": 1,
           "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    prompt["anyOf"] = [{"type": "string", "minLength": 1}, ids,
                       {"type": "array", "items": {"type": "string", "minLength": 1},
                        "minItems": 1, "maxItems": 1},
                       {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}]


@dataclass
class Job:
    """One request on its way through: ids, params and what to send back."""
    rid: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    stops: list[str]
    chat: bool
    echo: bool = False
    logprobs: int | None = None
    priority: int = 0  # --schedule-policy priority
    created: int = field(default_factory=lambda: int(time.time()))


async def make_job(served: Served, body, chat: bool) -> Job:
    if body.n != 1:
        raise ApiError(400, f"n = {body.n} is not supported: pipefill returns one choice "
                            "(n = 1)", param="n")
    if body.model is not None and body.model != served.model_name and not (
            chat and body.model == ROUTER_MODEL and served.disagg.enabled):
        raise ApiError(400, f"model {body.model!r} is not served here; this server serves "
                            f"{served.model_name!r}", param="model")
    max_tokens = requested_max_tokens(body, chat)
    check_limits(body)
    prompt_text, ids = await tokenized_prompt(served, body, chat)
    if max_tokens is None:  # as many as fit; a prompt too long for one is check_prompt's 400
        max_tokens = max(1, served.args.max_model_len - len(ids))
    logprobs = (body.top_logprobs or 0) if chat and body.logprobs else (
        None if chat else body.logprobs)
    echo = not chat and body.echo
    stops = served.tokenizer.eos_token_ids if served.tokenizer else ()
    params = SamplingParams(max_tokens, body.temperature, body.top_p, body.top_k, body.seed,
                            body.ignore_eos, tuple(stops),
                            return_prompt_logprobs=echo and logprobs is not None,
                            logprobs=logprobs)
    try:
        served.engine.check_prompt(ids, params)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    rid = served.engine.new_rid("chatcmpl" if chat else "cmpl")
    return Job(rid, ids, prompt_text, params, body.stop_strings(), chat, echo, logprobs,
               body.priority)


def requested_max_tokens(body, chat: bool) -> int | None:
    """max_completion_tokens (chat) or max_tokens; None when neither is given. Zero is a 400,
    as OpenAI answers it, not "no limit"."""
    name = "max_completion_tokens" if chat and body.max_completion_tokens is not None else \
        "max_tokens"
    value = getattr(body, name)
    if value is not None and value < 1:
        raise ApiError(400, f"{name} must be at least 1, got {value}: ask for one token or "
                            "more", param=name)
    return value


def check_limits(body) -> None:
    """Bounds that protect the server rather than the model: stop strings are searched after
    every token, and the stages' messages carry 64-bit integers."""
    stops = body.stop_strings()
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings are accepted, got "
                            f"{len(stops)}", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop: a stop string may have at most {MAX_STOP_CHARS} "
                            "characters", param="stop")
    for name in ("seed", "top_k", "priority"):
        value = getattr(body, name)
        if value is not None and not -2**63 <= value < 2**63:
            raise ApiError(400, f"{name} must fit in 64 bits, got {value}", param=name)


def check_text(served: Served, text: str, param: str) -> None:
    """Refuses text the tokenizer cannot take, and text too long for --max-model-len before
    tokenizing it (10 MB take ~10 s to tokenize, with the event loop blocked)."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} is not valid Unicode: it contains an unpaired surrogate "
                            "(e.g. \\ud800)", param=param) from None
    limit = served.args.max_model_len * served.token_bytes
    if size > limit:
        raise ApiError(400, f"{param} is {size} bytes; no prompt of --max-model-len "
                            f"({served.args.max_model_len}) tokens is longer than {limit} "
                            "bytes with this tokenizer", param=param)


async def tokenized_prompt(served: Served, body, chat: bool) -> tuple[str | None, list[int]]:
    """prompt_of, in the tokenizer thread unless the text is short: tokenizing a long prompt
    on the event loop would stall every other request, /health included, meanwhile."""
    if prompt_chars(body, chat) < INLINE_TOKENIZE_CHARS:
        return prompt_of(served, body, chat)
    served.metrics.tokenizing.inc()
    try:
        return await asyncio.get_running_loop().run_in_executor(
            served.tokenizer_thread, prompt_of, served, body, chat)
    finally:
        served.metrics.tokenizing.dec()


def prompt_chars(body, chat: bool) -> int:
    if chat:
        return sum(len(m.text()) for m in body.messages)
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return len(prompt) if isinstance(prompt, str) else 0


def prompt_of(served: Served, body, chat: bool) -> tuple[str | None, list[int]]:
    tok = served.tokenizer
    if chat:
        if tok is None or not tok.has_chat_template:
            raise ApiError(400, NO_TEMPLATE)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        check_text(served, "".join(m["content"] for m in messages), "messages")
        try:
            text = tok.apply_chat_template(messages)
        except Exception as e:  # noqa: BLE001 - templates raise on conversations they refuse
            raise ApiError(400, f"the model's chat template refused these messages: "
                                f"{type(e).__name__}: {e}", param="messages") from None
        check_text(served, text, "messages")
        return text, encode(tok.encode_chat, messages)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, "one prompt per request: send a string or a list of token ids",
                           param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tok is None:
            raise ApiError(400, "this model has no tokenizer: send token ids", param="prompt")
        check_text(served, prompt, "prompt")
        return prompt, encode(tok.encode, prompt)
    return None, list(prompt)


def encode(fn, arg) -> list[int]:
    try:
        return fn(arg)
    except Exception as e:  # noqa: BLE001 - checked text should encode; answer, don't crash
        raise ApiError(400, f"the prompt could not be tokenized: {type(e).__name__}: {e}",
                       param="prompt") from None


async def handle(served: Served, request: Request, body, chat: bool):
    try:
        return await _handle(served, request, body, chat)
    except ApiError as e:
        if served.disagg.mode is DisaggMode.PREFILL:
            tell_decodes(served, body, e)
        raise


def tell_decodes(served: Served, body, error: ApiError) -> None:
    """A PD prefill refused a request that names a room: the room's decodes answer the same
    status and sentence at once (FrontEnd.refuse_room)."""
    try:
        pd = pd_info(body.model_extra, "prefill")
    except ValueError:
        return  # no usable room: no decode can be waiting for it
    served.engine.core.refuse_room(pd, error.status, error.message)


async def _handle(served: Served, request: Request, body, chat: bool):
    if not served.engine.healthy:
        raise ApiError(503, served.engine.failure or "the model is still loading",
                       kind="server_error")
    release = served.admission.hold()
    response = None
    try:
        response = await _answer(served, request, body, chat, release)
        return response
    finally:
        if not isinstance(response, HeldStream):  # a stream gives its place back at its end
            release()


class HeldStream(StreamingResponse):
    """A streamed answer that gives its request's place back when the stream ends, however it
    ends (finished, failed, or the client went away)."""

    def __init__(self, content, release, **kwargs):
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


async def _answer(served: Served, request: Request, body, chat: bool, release):
    job = await make_job(served, body, chat)
    disagg = served.disagg
    try:
        pd = pd_info(body.model_extra, disagg.mode.value, disagg.prefill_bootstrap)
    except FieldError as e:
        raise ApiError(e.status, str(e), param="bootstrap_host" if e.status == 403 else None
                       ) from None
    try:  # a prefill computes the first token only: it goes to the decode with the KV
        job.params = served.engine.core.pd_params(job.params, pd)
    except ValueError as e:
        raise ApiError(400, str(e), param="echo") from None
    if pd is not None:
        served.engine.attach_pd(job.rid, pd)
    if disagg.mode is DisaggMode.PREFILL:
        body.stream = False
    run = Run(served, job)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return HeldStream(run.sse(include_usage), release, media_type="text/event-stream")
    task = asyncio.create_task(run.collect())
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # the generator's cleanup aborts the request and frees its pages
            return Response(status_code=499)
    try:
        return task.result()
    except (EngineDown, RequestFailed, ValueError) as e:
        raise error_of(e) from None
