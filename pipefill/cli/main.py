"""`pipefill` command line: generate, bench (prefill), and later serve / sim.

User mistakes exit with code 2 and one sentence on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from pipefill.base.platform import keep_freed_memory_for_reuse
from pipefill.config import server_args_parser_group  # noqa: F401 - kept importable here
from pipefill.runtime.logging_setup import setup_logging


class UsageError(Exception):
    """A mistake the user can fix: printed as one sentence, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    from pipefill.bench import allreduce as bench_allreduce
    from pipefill.bench import attention as bench_attention
    from pipefill.bench import kv_transfer as bench_kv_transfer
    from pipefill.bench import link as bench_link
    from pipefill.bench import long_short as bench_long_short
    from pipefill.bench import make_model as bench_make_model
    from pipefill.bench import multiturn as bench_multiturn
    from pipefill.bench import nll as bench_nll
    from pipefill.bench import pd_serving as bench_pd_serving
    from pipefill.bench import decode as bench_decode
    from pipefill.bench import decode_gemm as bench_decode_gemm
    from pipefill.bench import prefill as bench_prefill
    from pipefill.bench import serving as bench_serving
    from pipefill.bench import tp_vs_pp as bench_tp_vs_pp
    from pipefill.cli import generate, plan, serve_pd, sim
    from pipefill.server import main as serve
    parser = argparse.ArgumentParser(
        prog="pipefill",
        description="Long-prompt LLM inference with chunked pipeline parallelism.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(sub)
    serve_pd.add_parser(sub)
    generate.add_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench_command", required=True, metavar="BENCHMARK")
    bench_prefill.add_parser(bench)
    bench_serving.add_parser(bench)
    bench_pd_serving.add_parser(bench)
    bench_attention.add_parser(bench)
    bench_kv_transfer.add_parser(bench)
    bench_nll.add_parser(bench)
    bench_multiturn.add_parser(bench)
    bench_long_short.add_parser(bench)
    bench_decode.add_parser(bench)
    bench_decode_gemm.add_parser(bench)
    bench_make_model.add_parser(bench)
    bench_allreduce.add_parser(bench)
    bench_link.add_parser(bench)
    bench_tp_vs_pp.add_parser(bench)
    sim.add_parser(sub)
    plan.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    setup_logging(getattr(ns, "log_level", "info"))
    # SIGTERM unwinds like Ctrl-C, so engines stop their stages on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    if ns.command == "bench":  # the baselines, peaks and splits it times in this process get
        keep_freed_memory_for_reuse()  # the allocator the stage processes run with
    try:
        return ns.run(ns) or 0
    except (UsageError, ValueError) as e:
        print(f"pipefill {ns.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:  # a stage failed: say so, without a traceback
        logging.getLogger("pipefill").debug("failure", exc_info=True)
        print(f"pipefill {ns.command}: error: {e}", file=sys.stderr)
        return 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
