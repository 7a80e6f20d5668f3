"""Starting stage processes and watching them from the front end (engine or server)."""
from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import time

from pipefill.config import ServerArgs
from pipefill.runtime.ipc import Addresses, FrontChannel

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600


class StageFailure(RuntimeError):
    """A stage process died or raised; the message names the stage and the cause."""


class StageGroup:
    """The front end's handle on the stage processes: start, talk, watch, stop."""

    def __init__(self, args: ServerArgs, model_file: str):
        self.args = args
        addrs = Addresses.fresh()
        self.channel = FrontChannel(addrs)
        # A fresh interpreter per stage (not multiprocessing): the user's main module is never
        # re-imported, and no thread pool state is inherited through fork.
        self.procs = [_spawn(args, model_file, rank, addrs) for rank in range(args.pp_size)]
        self.pending: list[tuple] = []  # messages that arrived while waiting for another kind
        self.info: dict = {}

    def wait_ready(self) -> dict:
        """Blocks until stage 0 reports ready (it waits for the others); returns its info."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            msg = self.channel.recv(100)
            if msg is not None:
                kind, payload = msg
                if kind == "ready":
                    self.info = payload
                    return payload
                if kind == "fatal":
                    self.close()
                    raise StageFailure(payload)
            else:
                self.check_alive()
        self.close()
        raise StageFailure(f"stages did not start within {STARTUP_TIMEOUT_S} s")

    def check_alive(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.poll() is not None:
                cause = _exit_cause(p.returncode)
                self.close()
                raise StageFailure(f"stage {rank} (pid {p.pid}) exited: {cause}")

    def send(self, kind: str, payload=None) -> None:
        self.channel.send(kind, payload)

    def recv(self, timeout_ms: int = 100) -> tuple | None:
        """Next message; raises StageFailure on a 'fatal' report or a dead stage."""
        msg = self.pending.pop(0) if self.pending else self.channel.recv(timeout_ms)
        if msg is None:
            self.check_alive()
            return None
        if msg[0] == "fatal":
            self.close()
            raise StageFailure(msg[1])
        return msg

    def request(self, kind: str, timeout_s: float = 30.0):
        """Sends a query and waits for the reply of the same kind (e.g. 'stats')."""
        self.send(kind)
        deadline = time.monotonic() + timeout_s
        held = []
        try:
            while time.monotonic() < deadline:
                msg = self.recv(100)
                if msg is not None and msg[0] == kind:
                    return msg[1]
                if msg is not None:
                    held.append(msg)
        finally:
            self.pending[:0] = held
        raise TimeoutError(f"no reply to {kind!r} within {timeout_s} s")

    def close(self, grace_s: float = 5.0) -> None:
        if not self.procs:
            return
        self.channel.send("stop", block=False)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(2)
        self.procs = []
        self.channel.close()


def _spawn(args: ServerArgs, model_file: str, rank: int, addrs: Addresses) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "pipefill.runtime.worker"],
                            stdin=subprocess.PIPE, start_new_session=False)
    proc.stdin.write(pickle.dumps((args, model_file, rank, addrs)))
    proc.stdin.close()
    return proc


def _exit_cause(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))
