"""`pipefill serve-pd`: a prefill server, a decode server and the SGLang router (PD mode) as
child processes on this machine, the quick way to try PD disaggregation. Both servers get a
cluster secret made for this run (a 0600 file, removed at exit) unless the flags after `--`
give one. For several machines run the three commands it prints yourself, with a secret file
of your own on each."""
from __future__ import annotations

import argparse
import shlex
import subprocess
import time

from pipefill.disagg.launch import (check_alive, deployment_secret, die_with_parent, pd_commands,
                                    stop, wait_ready)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve-pd", help="prefill server + decode server + SGLang router on one machine",
        description="Starts `pipefill serve --disaggregation-mode prefill`, `pipefill serve "
                    "--disaggregation-mode decode` and `python -m sglang_router.launch_router "
                    "--pd-disaggregation` as child processes, waits until all are healthy, "
                    "prints the router URL, and stops all three on Ctrl-C / SIGTERM. Flags "
                    "after `--` go to both servers (e.g. -- --model-path DIR --page-size 16). "
                    "Both servers share a cluster secret made for this run (a 0600 file in a "
                    "private temporary folder, removed at exit), unless those flags give "
                    "--cluster-secret, --cluster-secret-file or --disaggregation-insecure.")
    p.add_argument("--host", default="127.0.0.1", help="Host of all three servers.")
    p.add_argument("--port", type=int, default=8000, help="The router's port (the URL to use).")
    p.add_argument("--prefill-port", type=int, default=0, help="Prefill server port (0: free).")
    p.add_argument("--decode-port", type=int, default=0, help="Decode server port (0: free).")
    p.add_argument("--prefill-pp-size", type=int, default=1,
                   help="Pipeline stages of the prefill server.")
    p.add_argument("--decode-pp-size", type=int, default=1,
                   help="Pipeline stages of the decode server (each decode stage receives its "
                        "own layers' KV from the prefill stages that hold them).")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                   help="The prefill's bootstrap port.")
    p.add_argument("--router-args", default="",
                   help="Extra flags for the router, one string (e.g. '--disable-circuit-"
                        "breaker').")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="Seconds to wait for all three to be healthy.")
    p.add_argument("server_args", nargs=argparse.REMAINDER,
                   help="After --: flags for both `pipefill serve` processes.")
    p.set_defaults(run=run)


def server_flags(ns) -> list[str]:
    return [a for a in ns.server_args if a != "--"]


def check_flags(ns) -> None:
    """A ValueError naming the flag for what serve-pd cannot run."""
    extra = server_flags(ns)
    for flag, size in (("--prefill-pp-size", ns.prefill_pp_size),
                       ("--decode-pp-size", ns.decode_pp_size)):
        if size < 1:
            raise ValueError(f"{flag} must be at least 1, got {size}")
    for bad in ("--pp-size", "--port", "--host", "--disaggregation-mode",
                "--disaggregation-bootstrap-port"):
        if any(a == bad or a.startswith(bad + "=") for a in extra):
            raise ValueError(f"{bad} is set by serve-pd itself: use its own flags "
                             "(--prefill-pp-size, --port, --prefill-port, ...)")


def commands(ns, secret_flags: list[str] = ()) -> tuple[list[str], list[str], list[str], str]:
    """(prefill, decode, router) command lines and the router URL; secret_flags go to both
    servers."""
    check_flags(ns)
    extra = server_flags(ns)
    return pd_commands(ns.host, ns.port, ns.prefill_port, ns.decode_port, ns.prefill_pp_size,
                       ns.disaggregation_bootstrap_port, extra + list(secret_flags),
                       ns.router_args, decode_pp_size=ns.decode_pp_size)


def run(ns) -> int:
    check_flags(ns)  # before a secret file exists
    with deployment_secret(server_flags(ns)) as secret_flags:
        return serve(ns, *commands(ns, secret_flags))


def serve(ns, prefill: list[str], decode: list[str], router: list[str], url: str) -> int:
    """Runs the three children until Ctrl-C / SIGTERM or one of them exits."""
    names = ("prefill", "decode", "router")
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, cmd in zip(names, (prefill, decode, router)):
            print(f"serve-pd: {name}: {shlex.join(cmd)}", flush=True)
            procs[name] = subprocess.Popen(cmd, preexec_fn=die_with_parent)
        ports = [cmd[cmd.index("--port") + 1] for cmd in (prefill, decode)]
        wait_ready(procs, [f"http://{ns.host}:{port}/health" for port in ports] +
                   [url + "/readiness"], ns.startup_timeout)
        print(f"serve-pd: ready: {url}", flush=True)
        while True:
            check_alive(procs)
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    finally:
        stop(procs)
