"""`pipefill serve`: the OpenAI-compatible server over the pipeline."""
from __future__ import annotations

import argparse
import logging
import os
import signal

from pipefill.config import server_args_from_namespace, server_args_parser_group

log = logging.getLogger("pipefill.server")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve /v1/completions, /v1/chat/completions (with SSE "
                                   "streaming), /v1/models, /health and /metrics over a "
                                   "pipeline of --pp-size stage processes.")
    server_args_parser_group(p)
    p.set_defaults(run=run)


def model_name(args, source) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model_path in (None, "", "default"):
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(source.path)).removesuffix(".gguf")


def run(ns: argparse.Namespace) -> int:
    import uvicorn

    from pipefill.frontend import prepare
    from pipefill.model.tokenizer import load_tokenizer
    from pipefill.server.app import Served, build_app
    from pipefill.server.async_engine import AsyncEngine

    args = server_args_from_namespace(ns)
    if args.node_rank > 0:
        from pipefill.runtime.launch import run_other_node
        return run_other_node(args)
    args, source = prepare(args)
    served = Served(AsyncEngine(args, source), load_tokenizer(source),
                    model_name(args, source), args.api_key)
    failed = []

    def on_startup_failure(exc):
        failed.append(exc)
        server.should_exit = True

    app = build_app(served, on_startup_failure, shutting_down=lambda: server.should_exit)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it caught after its graceful shutdown; a no-op handler makes
    # that a normal return, so a SIGTERM'd server exits 0 after stopping its stages.
    signal.signal(signal.SIGTERM, lambda *_: None)
    log.info("serving %s on http://%s:%d (stages loading; /health says when ready)",
             served.model_name, args.host, args.port)
    server.run()
    if failed:
        raise RuntimeError(str(failed[0]))
    log.info("stopped")
    return 0
