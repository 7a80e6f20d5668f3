"""A PD trio on one machine (prefill server, decode server, the SGLang router in PD mode): its
command lines, its cluster secret, and the child processes of whoever starts it (`pipefill
serve-pd`, `pipefill bench pd-serving`): they die with their parent, are waited for until
healthy, and are stopped router first."""
from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

from pipefill.base.platform import free_port

_PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 30
SECRET_FLAGS = ("--cluster-secret", "--cluster-secret-file", "--disaggregation-insecure")


def write_secret_file(folder: str) -> str:
    """A fresh random cluster secret in folder/cluster-secret, readable by this user only."""
    path = os.path.join(folder, "cluster-secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def gives_secret(extra: list[str]) -> bool:
    """True if the servers' flags already settle authentication (a secret, or insecure)."""
    return any(a == flag or a.startswith(flag + "=") for a in extra for flag in SECRET_FLAGS)


@contextlib.contextmanager
def deployment_secret(extra: list[str]) -> Iterator[list[str]]:
    """The flags that give both PD servers one secret made for this deployment: a 0600 file in
    a private (0700) temporary folder, removed on exit. [] when `extra` settles it already."""
    if gives_secret(extra):
        yield []
        return
    folder = tempfile.mkdtemp(prefix="pipefill-pd-")
    try:
        yield ["--cluster-secret-file", write_secret_file(folder)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def pd_commands(host: str, port: int, prefill_port: int, decode_port: int,
                prefill_pp_size: int, bootstrap_port: int, extra: list[str],
                router_args: str = "", decode_pp_size: int = 1
                ) -> tuple[list[str], list[str], list[str], str]:
    """(prefill, decode, router) command lines and the router URL (port 0: a free one);
    `extra` goes to both servers."""
    pport, dport = prefill_port or free_port(), decode_port or free_port()
    base = [sys.executable, "-m", "pipefill.cli.main", "serve", "--host", host]
    prefill = base + ["--port", str(pport), "--pp-size", str(prefill_pp_size),
                      "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                      str(bootstrap_port)] + extra
    decode = base + ["--port", str(dport), "--pp-size", str(decode_pp_size),
                     "--disaggregation-mode", "decode", "--disaggregation-prefill-bootstrap",
                     f"{host}:{bootstrap_port}"] + extra
    router = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
              "--prefill", f"http://{host}:{pport}", str(bootstrap_port),
              "--decode", f"http://{host}:{dport}", "--host", host, "--port",
              str(port), "--prometheus-host", host, "--prometheus-port",
              str(free_port())] + shlex.split(router_args)
    return prefill, decode, router, f"http://{host}:{port}"


def die_with_parent() -> None:
    """preexec_fn of a child: SIGTERM when the parent dies, so no server is orphaned."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def healthy(url: str) -> bool:
    import httpx
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(procs: dict[str, subprocess.Popen], urls: list[str], timeout_s: float) -> None:
    """Until every URL answers 200; a sentence if a child exits or timeout_s passes first."""
    deadline = time.monotonic() + timeout_s
    while not all(healthy(u) for u in urls):
        check_alive(procs)
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every server was healthy within {timeout_s:g} s "
                               "(--startup-timeout)")
        time.sleep(0.5)


def check_alive(procs: dict[str, subprocess.Popen]) -> None:
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
