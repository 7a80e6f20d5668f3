"""The prefill HTTP server's side of a refused request: when it answers a request that carries a
bootstrap room with an error (a prompt over its --max-model-len, a body it cannot take), the
room's decodes would otherwise wait for it until --disaggregation-waiting-timeout and then
answer 5xx, which the router counts as a fault and retries. RejectNotifier tells every prefill
stage (RejectRoom on a connection of its own to the stage's KV sender); each stage answers the
decodes that bootstrap the room from it with RoomFailed carrying the status and sentence.

The caller never waits: a thread sends. A stage it cannot reach is logged and skipped (that
room's decode then times out, as before)."""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from pipefill.disagg import channel as ch
from pipefill.disagg import messages as m

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
MAX_QUEUED = 4096  # refusals waiting to be sent; beyond that they are dropped (and logged)
MAX_REASON_CHARS = 2000  # a sentence, not the client's whole prompt


class RejectNotifier:
    """`endpoints()`: the prefill stages' transfer endpoints now (they change when the stages
    restart)."""

    def __init__(self, endpoints: Callable[[], list[m.Endpoint]], secret: bytes | None = None):
        self._endpoints, self._secret = endpoints, secret
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._conns: dict[m.Endpoint, ch.Channel] = {}
        self._thread = threading.Thread(target=self._run, name="pd-rejects", daemon=True)
        self._thread.start()

    def tell(self, room: int, status: int, reason: str) -> None:
        try:
            self._queue.put_nowait(m.RejectRoom(room, status, reason[:MAX_REASON_CHARS]))
        except queue.Full:
            log.warning("room %d: too many refusals queued; its decode will wait for "
                        "--disaggregation-waiting-timeout", room)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            msg = self._queue.get()
            if msg is None:
                break
            endpoints = self._endpoints()
            self._forget_others(endpoints)
            for endpoint in endpoints:
                self._send(endpoint, msg)
        for conn in self._conns.values():
            conn.close()

    def _forget_others(self, endpoints: list[m.Endpoint]) -> None:
        """Closes connections to stages that are gone (a restarted stage has a new port)."""
        for endpoint in [e for e in self._conns if e not in endpoints]:
            self._conns.pop(endpoint).close()

    def _send(self, endpoint: m.Endpoint, msg: m.RejectRoom) -> None:
        """Sends on the kept connection; once more on a fresh one if that was broken."""
        error = None
        for _ in range(2):
            conn = self._conns.get(endpoint)
            try:
                if conn is None:
                    conn = ch.connect(endpoint, CONNECT_TIMEOUT_S, self._secret,
                                      name=f"prefill stage {endpoint}")
                    self._conns[endpoint] = conn
                conn.send(msg)
                return
            except (ch.ConnectionClosed, OSError) as e:
                error = e
                self._conns.pop(endpoint, None)
                if conn is not None:
                    conn.close()
        log.warning("could not tell the prefill stage at %s that room %d was refused (%s): its "
                    "decode will wait for --disaggregation-waiting-timeout", endpoint, msg.room,
                    error)
