"""`pipefill serve-pd`: a prefill server, a decode server and the SGLang router (PD mode) as
child processes on this machine, the quick way to try PD disaggregation. For several machines
run the three commands it prints yourself."""
from __future__ import annotations

import argparse
import ctypes
import shlex
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 30


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve-pd", help="prefill server + decode server + SGLang router on one machine",
        description="Starts `pipefill serve --disaggregation-mode prefill`, `pipefill serve "
                    "--disaggregation-mode decode` and `python -m sglang_router.launch_router "
                    "--pd-disaggregation` as child processes, waits until all are healthy, "
                    "prints the router URL, and stops all three on Ctrl-C / SIGTERM. Flags "
                    "after `--` go to both servers (e.g. -- --model-path DIR --page-size 16).")
    p.add_argument("--host", default="127.0.0.1", help="Host of all three servers.")
    p.add_argument("--port", type=int, default=8000, help="The router's port (the URL to use).")
    p.add_argument("--prefill-port", type=int, default=0, help="Prefill server port (0: free).")
    p.add_argument("--decode-port", type=int, default=0, help="Decode server port (0: free).")
    p.add_argument("--prefill-pp-size", type=int, default=1,
                   help="Pipeline stages of the prefill server (the decode runs one).")
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


def commands(ns) -> tuple[list[str], list[str], list[str], str]:
    """(prefill, decode, router) command lines and the router URL."""
    from pipefill.runtime.launch import free_port
    extra = [a for a in ns.server_args if a != "--"]
    for bad in ("--pp-size", "--port", "--host", "--disaggregation-mode",
                "--disaggregation-bootstrap-port"):
        if any(a == bad or a.startswith(bad + "=") for a in extra):
            raise ValueError(f"{bad} is set by serve-pd itself: use its own flags "
                             "(--prefill-pp-size, --port, --prefill-port, ...)")
    pport, dport = ns.prefill_port or free_port(), ns.decode_port or free_port()
    base = [sys.executable, "-m", "pipefill.cli.main", "serve", "--host", ns.host]
    prefill = base + ["--port", str(pport), "--pp-size", str(ns.prefill_pp_size),
                      "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                      str(ns.disaggregation_bootstrap_port)] + extra
    decode = base + ["--port", str(dport), "--pp-size", "1",
                     "--disaggregation-mode", "decode", "--disaggregation-prefill-bootstrap",
                     f"{ns.host}:{ns.disaggregation_bootstrap_port}"] + extra
    router = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
              "--prefill", f"http://{ns.host}:{pport}", str(ns.disaggregation_bootstrap_port),
              "--decode", f"http://{ns.host}:{dport}", "--host", ns.host, "--port",
              str(ns.port), "--prometheus-host", ns.host, "--prometheus-port",
              str(free_port())] + shlex.split(ns.router_args)
    return prefill, decode, router, f"http://{ns.host}:{ns.port}"


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _healthy(url: str) -> bool:
    import httpx
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def run(ns) -> int:
    prefill, decode, router, url = commands(ns)
    names = ("prefill", "decode", "router")
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, cmd in zip(names, (prefill, decode, router)):
            print(f"serve-pd: {name}: {shlex.join(cmd)}", flush=True)
            procs[name] = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
        ports = [cmd[cmd.index("--port") + 1] for cmd in (prefill, decode)]
        wait_ready(procs, [f"http://{ns.host}:{port}/health" for port in ports] +
                   [url + "/readiness"], ns.startup_timeout)
        print(f"serve-pd: ready: {url}", flush=True)
        while True:
            _check_alive(procs)
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    finally:
        stop(procs)


def wait_ready(procs: dict[str, subprocess.Popen], urls: list[str], timeout_s: float) -> None:
    """Until every URL answers 200; a sentence if a child exits or timeout_s passes first."""
    deadline = time.monotonic() + timeout_s
    while not all(_healthy(u) for u in urls):
        _check_alive(procs)
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every server was healthy within {timeout_s:g} s "
                               "(--startup-timeout)")
        time.sleep(0.5)


def _check_alive(procs) -> None:
    for name, p in procs.items():
        if p.poll() is not None:
            raise RuntimeError(f"the {name} process exited with code {p.returncode}")


def stop(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM to every child (router first: no new requests), then SIGKILL after a grace."""
    for name in sorted(procs, key=lambda n: n != "router"):
        p = procs[name]
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs.values():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
