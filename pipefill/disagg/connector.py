"""A decode stage's connections to prefill servers, made off the stage's loop thread.

A request names its prefill's bootstrap service; the first request for a bootstrap makes the
decode look the prefill up and connect to its stages. That exchange is with a peer the decode
does not control: it runs on a worker thread, under one deadline for the whole exchange (a
peer that trickles a byte at a time hits it like a silent one), and whatever goes wrong becomes
a PeerError with an HTTP status and a sentence naming the bootstrap, for the requests that
wait on it. The loop thread only starts connects and takes their outcomes.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import contextmanager
from typing import Callable

from pipefill.disagg import channel as ch
from pipefill.disagg import messages as m

log = logging.getLogger(__name__)

CONNECT_WORKERS = 4  # connects to distinct prefills at the same time; more wait their turn
NOT_READY_RETRY_S = 0.2

BAD_ANSWER, TOO_SLOW = 502, 504  # the HTTP statuses of a request whose prefill failed it


class PeerError(Exception):
    """A prefill could not serve a request: `status` is 502 (it answered something unusable,
    or could not be reached) or 504 (it did not finish answering before the deadline)."""

    def __init__(self, status: int, sentence: str):
        super().__init__(sentence)
        self.status = status


class Deadline:
    """One exchange's deadline over all of its socket operations: when it passes, the channels
    it holds are closed, which ends any read still waiting on them."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._at = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._held: set[ch.Channel] = set()
        self.expired = False
        self._timer = threading.Timer(seconds, self.expire)
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        """Seconds left; socket.timeout once there are none (connects take it as their
        timeout)."""
        left = self._at - time.monotonic()
        if left <= 0 or self.expired:
            raise socket.timeout(f"the deadline of {self.seconds:g} s passed")
        return left

    @contextmanager
    def hold(self, conn: ch.Channel):
        """Closes conn if the deadline passes while the block runs."""
        with self._lock:
            self._held.add(conn)
            expired = self.expired
        if expired:
            conn.close()
        try:
            yield conn
        finally:
            with self._lock:
                self._held.discard(conn)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            held, self._held = list(self._held), set()
        for conn in held:
            conn.close()

    def cancel(self) -> None:
        self._timer.cancel()


def lookup(endpoint: m.Endpoint, deadline: Deadline, secret: bytes | None,
           retry_unreachable: bool = False) -> m.PrefillInfo:
    """The prefill's answer to a Lookup, asking again while it says it is not ready (its
    stages are still registering) until the deadline. retry_unreachable: also while nothing
    answers at all (at start-up, when the prefill may still be loading)."""
    last = "no answer"
    while True:
        try:
            reply = _ask(endpoint, deadline, secret)
        except (OSError, ch.ConnectionClosed) as e:
            if not retry_unreachable or deadline.expired:
                raise
            reply, last = None, str(e)
        if isinstance(reply, m.PrefillInfo):
            return reply
        if reply is not None and not isinstance(reply, m.NotReady):
            raise PeerError(BAD_ANSWER, f"the bootstrap answered {type(reply).__name__}, not "
                                        "the prefill's stages")
        if reply is not None:
            last = reply.reason[:200]
        if deadline.remaining() < NOT_READY_RETRY_S:
            raise PeerError(TOO_SLOW, f"the prefill was not ready within {deadline.seconds:g} "
                                      f"s ({last})")
        time.sleep(NOT_READY_RETRY_S)


def _ask(endpoint: m.Endpoint, deadline: Deadline, secret: bytes | None) -> m.Message:
    conn = ch.connect(endpoint, deadline.remaining(), secret, name=f"bootstrap {endpoint}")
    with deadline.hold(conn):
        try:
            conn.send(m.Lookup())
            return conn.recv()
        finally:
            conn.close()


def as_peer_error(e: BaseException, key: str, deadline: Deadline) -> PeerError:
    """Any failure of an exchange with the prefill at bootstrap `key`, as a sentence for the
    requests that named it."""
    where = f"the prefill server at bootstrap {key}"
    if deadline.expired or isinstance(e, (socket.timeout, TimeoutError)) or \
            (isinstance(e, PeerError) and e.status == TOO_SLOW):
        detail = f": {e}" if isinstance(e, PeerError) else ""
        return PeerError(TOO_SLOW, f"{where} did not finish answering within "
                                   f"{deadline.seconds:g} s (--disaggregation-connect-timeout)"
                                   f"{detail}")
    if isinstance(e, PeerError):
        return PeerError(e.status, f"{where} gave an unusable answer: {e}")
    if isinstance(e, ValueError):  # the answer's checks, or a pairing mismatch
        return PeerError(BAD_ANSWER, f"cannot take KV from {where}: {e}")
    if isinstance(e, (OSError, ch.ConnectionClosed)):
        return PeerError(BAD_ANSWER, f"cannot reach {where}: {e}")
    return PeerError(BAD_ANSWER, f"{where} gave an answer this decode cannot use "
                                 f"({type(e).__name__}: {e})")


class PrefillConnector:
    """Runs `connect(key, endpoint, deadline)` on a daemon thread (at most CONNECT_WORKERS at
    work at once), one at a time per key, each under a deadline of timeout_s from the moment
    it was asked for; then `on_done(key, error)` on that thread, error a PeerError or None.
    Daemon threads: a stage that exits never waits for a peer."""

    def __init__(self, connect: Callable[[str, m.Endpoint, Deadline], None], timeout_s: float,
                 on_done: Callable[[str, PeerError | None], None]):
        self._connect, self._timeout_s, self._on_done = connect, timeout_s, on_done
        self._slots = threading.BoundedSemaphore(CONNECT_WORKERS)
        self._lock = threading.Lock()
        self._busy: dict[str, Deadline] = {}  # key -> the deadline of its connect under way

    def start(self, key: str, endpoint: m.Endpoint) -> None:
        """Connects to the prefill at `key` unless a connect to it is under way already."""
        with self._lock:
            if key in self._busy:
                return
            # The deadline starts now: a connect that waits for a slot spends its time too.
            deadline = self._busy[key] = Deadline(self._timeout_s)
        threading.Thread(target=self._run, args=(key, endpoint, deadline), name="pd-connect",
                         daemon=True).start()

    def overdue(self) -> list[tuple[str, PeerError]]:
        """Connects still under way past their deadline, with the 504 of their requests. A
        worker may be stuck where closing sockets does not reach (a name lookup, a connect's
        handshake): its requests need not wait for it."""
        with self._lock:
            late = [(key, d) for key, d in self._busy.items() if d.expired]
        return [(key, as_peer_error(socket.timeout(), key, d)) for key, d in late]

    def _run(self, key: str, endpoint: m.Endpoint, deadline: Deadline) -> None:
        error, slot = None, False
        try:
            slot = self._slots.acquire(timeout=deadline.remaining())
            if not slot:
                raise socket.timeout("every connect slot stayed busy until the deadline")
            self._connect(key, endpoint, deadline)
        except Exception as e:  # noqa: BLE001 - a peer's garbage must not end the worker
            error = as_peer_error(e, key, deadline)
            log.warning("%s", error)
        finally:
            if slot:
                self._slots.release()
            deadline.cancel()
            with self._lock:
                self._busy.pop(key, None)
        self._on_done(key, error)
