"""Starting stage processes and watching them from the front end (engine or server)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from pipefill.base.platform import free_port
from pipefill.config import ServerArgs, resolve
from pipefill.model.loader import WeightSource, resolve_model_path
from pipefill.runtime.heartbeat import Board, StallWatch, board_path
from pipefill.runtime.ipc import Addresses, FrontChannel
from pipefill.runtime.worker import encode_stage_start, process_name

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600


class StageFailure(RuntimeError):
    """A stage process died or raised; the message names the stage and the cause."""


@dataclass
class RestartBudget:
    """Crash-loop guard of the stage supervisor: at most max_restarts restarts within any
    window_s seconds."""
    max_restarts: int
    window_s: float
    times: deque = field(default_factory=deque)  # monotonic times of the recent restarts

    def take(self, now: float) -> bool:
        """True (and counts a restart) if one more restart fits in the window."""
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.max_restarts:
            return False
        self.times.append(now)
        return True


class StageGroup:
    """The front end's handle on the stage processes: start, talk, watch, stop."""

    def __init__(self, args: ServerArgs, model_file: str):
        if args.layout.world_size > 1 and args.dist_init_addr is None:
            args = args.replace(dist_init_addr=f"127.0.0.1:{free_port()}")
        self.layout = args.layout
        self.stall_timeout_s = args.serving.stage_stall_timeout
        addrs = Addresses.fresh(args)
        self.channel = FrontChannel(addrs)
        self.channel.out.setsockopt(zmq.SNDTIMEO, 200)  # blocking sends wake up to check
        # Made before the stages start: each maps it when it starts (ipc.py's private folder).
        self.board = Board.create(board_path(addrs.folder), self.layout.pp_size)
        self.watch: StallWatch | None = None  # set once the stages are ready
        self.procs = spawn_local_stages(args, model_file, addrs)
        self.info: dict = {}

    def wait_ready(self, cancelled=lambda: False) -> dict:
        """Blocks until stage 0 reports ready (it waits for the others); returns its info.
        cancelled() turning true (the server is stopping) stops the stages and raises."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if cancelled():
                self.close(grace_s=1.0)
                raise StageFailure("start-up cancelled: the front end is stopping")
            msg = self.channel.recv(100)
            if msg is not None:
                kind, payload = msg
                if kind == "ready":
                    self.info = payload
                    self._start_watch()
                    return payload
                if kind == "fatal":
                    self._fail([payload])
            else:
                self.check_alive()
        self.close()
        raise StageFailure(f"stages did not start within {STARTUP_TIMEOUT_S} s")

    def check_alive(self) -> None:
        if any(p.poll() is not None for p in self.procs):
            self._fail([])

    def _start_watch(self) -> None:
        if self.stall_timeout_s > 0:
            self.watch = StallWatch(self.board, self.layout.local_ranks, self.layout.pp_size,
                                    self.stall_timeout_s, time.monotonic())

    def check_progress(self, requests_in_flight: bool) -> None:
        """The stall watchdog (runtime/heartbeat.py): a stage that has work but made no
        progress for --stage-stall-timeout seconds is stopped with the rest of the group, and
        StageFailure says which."""
        if self.watch is None or not self.procs:
            return
        stall = self.watch.check(requests_in_flight, time.monotonic())
        if stall is None:
            return
        wedged = self.procs[stall.rank] if stall.watched else None
        message = stall.sentence(wedged.pid if wedged else None)
        log.error("%s; stopping the stages", message)
        if wedged is not None:  # it would not answer "stop"; the others see it die and exit
            wedged.kill()
        self.close(grace_s=1.0)
        raise StageFailure(message)

    def _fail(self, reports: list[str]) -> None:
        """Stops everything and raises one error that leads with the root cause: a stage
        that died comes before the stages that then lost their link to it."""
        deadline = time.monotonic() + 0.5  # let the other reports and exits arrive
        while time.monotonic() < deadline:
            msg = self.channel.recv(50)
            if msg is not None and msg[0] == "fatal":
                reports.append(msg[1])
        died = [f"{name} (pid {p.pid}) exited: {_exit_cause(p.returncode)}"
                for name, p in zip(process_names(self.layout), self.procs)
                if p.poll() is not None and p.returncode != 0 and not any(
                    r.startswith(f"{name} ") for r in reports)]
        self.close(grace_s=1.0)
        raise StageFailure("; ".join(died + reports) or "a stage exited")

    def send(self, kind: str, payload=None, block: bool = True) -> None:
        """block=True waits while stage 0 is busy but raises StageFailure once a stage is
        dead or the group closed (a send to a dead stage 0 would otherwise block forever);
        block=False drops the message if it cannot leave at once."""
        while True:
            try:
                self.channel.send(kind, payload, block)
                return
            except zmq.Again:  # SNDTIMEO passed: still worth waiting for?
                dead = [f"{name} (pid {p.pid}) exited: {_exit_cause(p.returncode)}"
                        for name, p in zip(process_names(self.layout), self.procs)
                        if p.poll() is not None]
                if self.channel.closed or dead:
                    raise StageFailure(f"could not send {kind!r}: "
                                       f"{'; '.join(dead) or 'the stages are stopped'}") \
                        from None

    def recv(self, timeout_ms: int = 100) -> tuple | None:
        """Next message; raises StageFailure on a 'fatal' report or a dead stage."""
        msg = self.channel.recv(timeout_ms)
        if msg is None:
            self.check_alive()
            return None
        if msg[0] == "fatal":
            self._fail([msg[1]])
        return msg

    def gather(self, kind: str, reply: str, timeout_s: float = 600.0) -> dict[int, object]:
        """Sends a control message that travels down the pipe; returns each stage's reply
        by rank. (The reply comes after the micro-batches in flight, hence the long wait.)"""
        self.send(kind)
        replies: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < self.layout.pp_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"stages did not answer {kind!r} within {timeout_s} s")
            msg = self.recv(100)
            if msg is not None and msg[0] == reply:
                rank, payload = msg[1]
                replies[rank] = payload
        return replies

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
        # The board stays mapped until this group is collected: the server's reader thread
        # may be reading it right now.
        self.watch = None
        self.channel.close()


def spawn_local_stages(args: ServerArgs, model_file: str, addrs: Addresses):
    """This node's stage processes (Layout.local_processes): the stages' TP leaders first, in
    stage order (procs[i] is stage local_ranks[i]), then the other TP ranks."""
    # A fresh interpreter per stage (not multiprocessing): the user's main module is never
    # re-imported, and no thread-pool state is inherited through fork.
    return [_spawn(args, model_file, rank, addrs, t)
            for rank, t in args.layout.local_processes]


def process_names(layout) -> list[str]:
    """Names of this node's stage processes, in spawn_local_stages's order."""
    return [process_name(rank, t) for rank, t in layout.local_processes]


def run_node_stages(args: ServerArgs, model_file: str) -> int:
    """Nodes other than 0: run this node's stages until they exit; their reports go to node 0."""
    addrs = Addresses.fresh(args)
    procs = spawn_local_stages(args, model_file, addrs)
    names = process_names(args.layout)
    log.info("node %d: running %s; waiting for them to finish", args.node_rank,
             ", ".join(names))
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        codes = [p.wait() for p in procs]
    for name, code in zip(names, codes):
        if code:
            log.error("%s %s", name, _exit_cause(code))
    return 0 if not any(codes) else 1


def run_other_node(args: ServerArgs) -> int:
    """--node-rank > 0 (`pipefill generate|serve`): host this node's stages; node 0 runs the
    front end."""
    model_file = resolve_model_path(args.model_path)
    args = resolve(args, WeightSource(model_file, vocabulary=False).config)
    return run_node_stages(args, model_file)


def _spawn(args: ServerArgs, model_file: str, rank: int, addrs: Addresses,
           tp_rank: int = 0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "pipefill.runtime.stage_main"],
                            stdin=subprocess.PIPE, start_new_session=False)
    proc.stdin.write(encode_stage_start(args, model_file, rank, addrs, tp_rank))
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
