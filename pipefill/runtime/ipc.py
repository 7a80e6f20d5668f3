"""ZMQ messages between the engine (or server) process and the stage processes.

The front end binds two sockets; stage 0 pulls requests from one, and every stage pushes to the
other (outputs from stage 0, start-up and failure reports from any stage). Messages are
(kind, payload) pairs, typed and encoded by wire.py (the kinds are listed there); a message that
does not decode (or, with a cluster secret, does not carry a valid HMAC) is logged and dropped.

One node: both sockets are ipc:// in a private (0700) temp folder, removed when the front end
closes. Several nodes: the events socket is TCP on PORT+1 of --dist-init-addr, bound to that
address's interface only; without --cluster-secret it is unauthenticated (a warning says so).
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from pipefill.config import ServerArgs
from pipefill.base.wire import Framer, front_to_stage, stage_to_front

log = logging.getLogger(__name__)

MAX_TCP_MESSAGE_BYTES = 1 << 30  # a peer announcing a larger frame is disconnected by ZMQ
JOIN_GRACE_S = 10.0  # how long "ready" waits for joins still on their way (other connections)


@dataclass(frozen=True)
class Addresses:
    requests: str  # front end -> stage 0 (always on node 0)
    events: str  # stages -> front end, as the stages connect to it
    events_bind: str  # the same, as the front end binds it
    folder: str | None = None  # the private folder of the ipc:// sockets (node 0)
    secret: bytes | None = field(default=None, repr=False)  # HMAC key of every message
    num_stages: int = 1  # the front end is ready only once every stage has joined

    @staticmethod
    def fresh(args: ServerArgs) -> "Addresses":
        secret = args.disagg.secret()
        folder = tempfile.mkdtemp(prefix="pipefill-") if args.node_rank == 0 else None
        requests = f"ipc://{os.path.join(folder, 'requests')}" if folder else ""
        if args.nnodes == 1:
            events = f"ipc://{os.path.join(folder, 'events')}"
            return Addresses(requests, events, events, folder, secret, args.pp_size)
        # Stages of other nodes report over TCP, next to the rendezvous port.
        host, _, port = args.dist_init_addr.rpartition(":")
        port = int(port) + 1
        return Addresses(requests, f"tcp://{host}:{port}", f"tcp://{_bind_ip(host)}:{port}",
                         folder, secret, args.pp_size)

    def remove_folder(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _bind_ip(host: str) -> str:
    """ZMQ binds an interface's address, not a host name: node 0's address as others see it."""
    if host.startswith("["):  # an IPv6 literal, [::1]
        return host
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except socket.gaierror as e:
        raise ValueError(f"--dist-init-addr host {host!r} does not resolve: {e}") from None


class FrontChannel:
    """The engine/server end: binds both sockets."""

    def __init__(self, addrs: Addresses, context: zmq.Context | None = None):
        self.addrs = addrs
        self.ctx = context or zmq.Context.instance()
        # The server sends from its event loop while a reader thread receives (and may close
        # everything when a stage dies): sends and close take this lock.
        self.lock = threading.Lock()
        self.closed = False
        self.framer = Framer(front_to_stage(), stage_to_front(), addrs.secret,
                             f"the front end's events socket ({addrs.events_bind})")
        self.joined: dict[int, int] = {}  # stage rank -> node rank, as stages announce
        self.join_grace_s = JOIN_GRACE_S
        self._held: deque[tuple] = deque()  # messages that arrived while "ready" waited
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.bind(addrs.requests)
        self.inp = self.ctx.socket(zmq.PULL)
        if addrs.events_bind.startswith("tcp://"):
            self.inp.setsockopt(zmq.MAXMSGSIZE, MAX_TCP_MESSAGE_BYTES)
            if addrs.secret is None:
                log.warning("multi-node control port %s is unauthenticated: anyone who can "
                            "reach it can send reports; set --cluster-secret (or "
                            "--cluster-secret-file) on every node", addrs.events_bind)
        self.inp.bind(addrs.events_bind)

    def send(self, kind: str, payload=None, block: bool = True) -> None:
        frame = self.framer.pack(kind, payload)
        with self.lock:
            if self.closed:
                return
            try:
                self.out.send(frame, 0 if block else zmq.NOBLOCK)
            except zmq.Again:
                if block:
                    raise  # only a non-blocking send (to a stage that may be gone) is dropped

    def recv(self, timeout_ms: int) -> tuple | None:
        """The next valid message within timeout_ms, or None; foreign ones are dropped."""
        if self._held:
            return self._held.popleft()
        msg = self._next(time.monotonic() + timeout_ms / 1000)
        if msg is not None and msg[0] == "ready" and self._missing():
            return self._ready_once_joined(msg)
        return msg

    def _next(self, deadline: float) -> tuple | None:
        while self.inp.poll(max(0, round((deadline - time.monotonic()) * 1000))):
            msg = self.framer.unpack(self.inp.recv())
            if msg is None:
                continue
            if msg[0] == "join":
                self._joined(*msg[1])
                continue
            return msg
        return None

    def _ready_once_joined(self, ready: tuple) -> tuple:
        """Stage 0 is ready only after every stage passed the barrier, so every join was sent
        before; a join that does not arrive was dropped: that stage cannot prove the secret."""
        deadline = time.monotonic() + self.join_grace_s
        while self._missing() and time.monotonic() < deadline:
            msg = self._next(min(deadline, time.monotonic() + 0.1))
            if msg is not None:
                self._held.append(msg)
        missing = self._missing()
        if not missing:
            return ready
        why = ("its messages fail the HMAC check: give every node the same --cluster-secret"
               if self.addrs.secret else "its reports do not reach the front end")
        log.error("stage(s) %s never joined: %s", missing, why)
        return ("fatal", f"stage(s) {', '.join(map(str, missing))} did not join the front end "
                         f"within {self.join_grace_s:.0f} s: {why}")

    def _missing(self) -> list[int]:
        return sorted(set(range(self.addrs.num_stages)) - set(self.joined))

    def _joined(self, rank: int, node_rank: int) -> None:
        self.joined[rank] = node_rank
        proof = " (cluster secret proven)" if self.addrs.secret else ""
        log.debug("stage %d of node %d joined%s", rank, node_rank, proof)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.out.close(linger=0)
            self.inp.close(linger=0)
            self.addrs.remove_folder()


class StageChannel:
    """A stage's end. Only stage 0 reads requests; every stage can report."""

    def __init__(self, addrs: Addresses, read_requests: bool, rank: int | None = None,
                 node_rank: int = 0):
        self.ctx = zmq.Context()
        self.framer = Framer(stage_to_front(), front_to_stage(), addrs.secret,
                             f"stage {rank}'s requests socket")
        self.events = self.ctx.socket(zmq.PUSH)
        # No high-water mark: reports queue here instead of blocking stage 0's loop when the
        # front end reads slowly, and none (outputs least of all) is dropped.
        self.events.setsockopt(zmq.SNDHWM, 0)
        self.events.connect(addrs.events)
        self.requests = None
        if read_requests:
            self.requests = self.ctx.socket(zmq.PULL)
            self.requests.connect(addrs.requests)
        if rank is not None:  # the first report: with a secret, the join is its proof
            self.report("join", (rank, node_rank))

    def report(self, kind: str, payload=None) -> None:
        self.events.send(self.framer.pack(kind, payload))

    def poll(self, timeout_ms: int) -> list[tuple]:
        """Every valid request message that arrives within timeout_ms (0 = only what is
        queued); foreign ones are dropped."""
        messages = []
        if self.requests.poll(timeout_ms):
            while True:
                try:
                    frame = self.requests.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = self.framer.unpack(frame)
                if msg is not None:
                    messages.append(msg)
        return messages

    def close(self) -> None:
        # linger lets the last reports (a fatal error, say) leave before the process exits.
        for s in (self.events, self.requests):
            if s is not None:
                s.close(linger=2000)
        self.ctx.term()
