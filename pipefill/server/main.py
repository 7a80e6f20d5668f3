"""`pipefill serve`: the OpenAI-compatible server over the pipeline."""
from __future__ import annotations

import argparse
import logging
import os
import signal

from pipefill.config import Serving, server_args_from_namespace, server_args_parser_group

log = logging.getLogger("pipefill.server")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve /v1/completions, /v1/chat/completions (with SSE "
                                   "streaming), /v1/models, /health and /metrics over a "
                                   "pipeline of --pp-size stage processes.")
    server_args_parser_group(p)
    p.set_defaults(run=run)


def model_name(serving: Serving, model_path: str | None, source) -> str:
    if serving.served_model_name:
        return serving.served_model_name
    if model_path in (None, "", "default"):
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(source.path)).removesuffix(".gguf")


class RestartGate:
    """ASGI middleware: while the supervisor restarts the stages, /v1 requests wait here for
    them (up to --stage-restart-timeout, then a 503 with a sentence) instead of being turned
    away at once; /health and /metrics answer meanwhile."""

    def __init__(self, app, engine):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and \
                self.engine.restarting:
            from pipefill.server.async_engine import EngineDown
            try:
                await self.engine.wait_until_up()
            except EngineDown as e:
                from fastapi.responses import JSONResponse
                response = JSONResponse({"error": {"message": str(e), "type": "server_error",
                                                   "param": None, "code": 503}},
                                        status_code=503)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def run(ns: argparse.Namespace) -> int:
    import uvicorn

    from pipefill.frontend import prepare
    from pipefill.model.tokenizer import load_tokenizer
    from pipefill.server.app import Served, build_app
    from pipefill.server.async_engine import AsyncEngine
    from pipefill.server.connections import guarded_protocol
    from pipefill.server.metrics import ServerMetrics

    args = server_args_from_namespace(ns)
    if args.node_rank > 0:
        from pipefill.runtime.launch import run_other_node
        return run_other_node(args)
    args, source = prepare(args)
    serving, disagg = args.serving, args.disagg
    if disagg.insecure_warning:
        log.warning("%s", disagg.insecure_warning)
    metrics = ServerMetrics()
    # A PD prefill's bootstrap service starts here (the front-end core's), before uvicorn.
    engine = AsyncEngine(args, source, on_restart=metrics.stage_restarts.inc)
    served = Served(engine, load_tokenizer(source, args.chat_template),
                    model_name(serving, args.model_path, source), serving.api_key, metrics)
    failed = []

    def on_startup_failure(exc):
        failed.append(exc)
        server.should_exit = True

    app = RestartGate(build_app(served, on_startup_failure,
                                shutting_down=lambda: server.should_exit), engine)
    # Our h11 protocol (header deadline, connection cap) rather than uvicorn's choice between
    # h11 and httptools; no WebSocket upgrades (no route takes one).
    config = uvicorn.Config(app, host=serving.host, port=serving.port, log_level="warning",
                            timeout_graceful_shutdown=serving.shutdown_timeout, ws="none",
                            http=guarded_protocol(serving.header_read_timeout,
                                                  serving.max_connections))
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it caught after its graceful shutdown; a no-op handler makes
    # that a normal return, so a SIGTERM'd server exits 0 after stopping its stages.
    signal.signal(signal.SIGTERM, lambda *_: None)
    log.info("serving %s on http://%s:%d (stages loading; /health says when ready)",
             served.model_name, serving.host, serving.port)
    try:
        server.run()
    finally:
        engine.core.close()  # the stages are down already; this stops the PD services
    if failed:
        raise RuntimeError(str(failed[0]))
    log.info("stopped")
    return 0
