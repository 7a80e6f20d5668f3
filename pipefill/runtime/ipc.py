"""ZMQ messages between the engine (or server) process and the stage processes.

The front end binds two sockets; stage 0 pulls requests from one, and every stage pushes to the
other (outputs from stage 0, start-up and failure reports from any stage). Messages are
(kind, payload) tuples, pickled.

  front end -> stage 0 : ("add", [NewRequest]), ("abort", rid), ("stats", None),
                         ("trace", None), ("stop", None)
  stage -> front end   : ("ready", info), ("outputs", [RequestOutput]), ("rejected", (rid, msg)),
                         ("stage_stats", dict), ("load", dict), ("trace", (rank, events)),
                         ("fatal", message)
"""
from __future__ import annotations

import os
import pickle
import tempfile
import threading
from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class Addresses:
    requests: str  # front end -> stage 0 (always on node 0)
    events: str  # stages -> front end, as the stages connect to it
    events_bind: str  # the same, as the front end binds it

    @staticmethod
    def fresh(nnodes: int = 1, host: str | None = None, port: int | None = None
              ) -> "Addresses":
        d = tempfile.mkdtemp(prefix="pipefill-")
        requests = f"ipc://{os.path.join(d, 'requests')}"
        if nnodes == 1:
            events = f"ipc://{os.path.join(d, 'events')}"
            return Addresses(requests, events, events)
        # Stages of other nodes report over TCP, next to the rendezvous port.
        return Addresses(requests, f"tcp://{host}:{port}", f"tcp://*:{port}")


class FrontChannel:
    """The engine/server end: binds both sockets."""

    def __init__(self, addrs: Addresses, context: zmq.Context | None = None):
        self.ctx = context or zmq.Context.instance()
        # The server sends from its event loop while a reader thread receives (and may close
        # everything when a stage dies): sends and close take this lock.
        self.lock = threading.Lock()
        self.closed = False
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.bind(addrs.requests)
        self.inp = self.ctx.socket(zmq.PULL)
        self.inp.bind(addrs.events_bind)

    def send(self, kind: str, payload=None, block: bool = True) -> None:
        with self.lock:
            if self.closed:
                return
            try:
                self.out.send(pickle.dumps((kind, payload)), 0 if block else zmq.NOBLOCK)
            except zmq.Again:
                if block:
                    raise  # only a non-blocking send (to a stage that may be gone) is dropped

    def recv(self, timeout_ms: int) -> tuple | None:
        if self.inp.poll(timeout_ms):
            return pickle.loads(self.inp.recv())
        return None

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.out.close(linger=0)
            self.inp.close(linger=0)


class StageChannel:
    """A stage's end. Only stage 0 reads requests; every stage can report."""

    def __init__(self, addrs: Addresses, read_requests: bool):
        self.ctx = zmq.Context()
        self.events = self.ctx.socket(zmq.PUSH)
        self.events.connect(addrs.events)
        self.requests = None
        if read_requests:
            self.requests = self.ctx.socket(zmq.PULL)
            self.requests.connect(addrs.requests)

    def report(self, kind: str, payload=None) -> None:
        self.events.send(pickle.dumps((kind, payload)))

    def poll(self, timeout_ms: int) -> list[tuple]:
        """Every request message that arrives within timeout_ms (0 = only what is queued)."""
        messages = []
        if self.requests.poll(timeout_ms):
            while True:
                try:
                    messages.append(pickle.loads(self.requests.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return messages

    def close(self) -> None:
        # linger lets the last reports (a fatal error, say) leave before the process exits.
        for s in (self.events, self.requests):
            if s is not None:
                s.close(linger=2000)
        self.ctx.term()
