"""The TCP connections of the PD transfer plane: length-prefixed control frames (messages.py),
raw page bytes after a KVChunk header, and the listeners that accept them.

With a cluster secret a connection starts with the handshake of handshake.py, and every frame
and page payload after it carries a MAC under the session keys it derived.

Without a secret (insecure mode) there is no handshake and no MAC: anyone who reaches the port
is believed. A frame's buffer then grows as its bytes arrive, so a declared length costs memory
only once the bytes are sent.

Bounds: a listener serves at most max_connections at a time (max_handshakes of them still
unauthenticated) and closes the rest at once; its accept loop logs an accept error (out of
file descriptors) and retries after a pause, and stops only when the listener is closed; a
send that the peer takes no byte of for send_timeout_s fails and closes the connection, and
`post` hands a message to a writer thread of the connection, so a peer that stops reading
holds no other peer's thread. What is dropped or refused is logged through throttles shared by
the whole process: many connections cannot flood the log.
"""
from __future__ import annotations

import fcntl
import hmac
import logging
import queue
import select
import socket
import struct
import termios
import threading
from typing import Callable, Iterable

from pipefill.disagg import messages as m
from pipefill.base.wire import DropLog, LogThrottle
from pipefill.disagg.handshake import (MAC_BYTES, ConnectionClosed, PayloadTampered,
                                       Session, client_handshake, server_handshake)

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 << 20  # control frames are small; page lists of a 1M-token prompt fit
SMALL_FRAME_BYTES = 64 << 10  # a frame up to this is read into a buffer of its size at once
READ_PIECE_BYTES = 1 << 20  # a larger one grows by what has arrived, at most this per read
SOCKET_BUFFER_BYTES = 4 << 20
SEND_TIMEOUT_S = 20.0  # a peer that takes no byte for this long is dropped
HANDSHAKE_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 256  # per listener, the authenticated and the handshaking together
MAX_HANDSHAKES = 64  # per listener, connections that have not proved the secret yet
MAX_POSTED = 4096  # messages queued for one connection's writer; beyond: the peer is dropped
ACCEPT_RETRY_S = (0.05, 1.0)  # first and longest pause after an accept error

_LEN = struct.Struct("!I")

# Shared by every PD connection of this process: a flood from many connections logs a line per
# interval per kind, with the count of the rest.
MESSAGE_DROPS = LogThrottle(logger=log)
CONNECTION_REFUSALS = LogThrottle(logger=log)
ACCEPT_ERRORS = LogThrottle(logger=log)



# ------------------------------------------------------------------ one connection

def _set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """A send() that moves no byte for `seconds` fails (EAGAIN) instead of blocking forever;
    reads are not affected."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def _why(e: OSError) -> str:
    if isinstance(e, (BlockingIOError, socket.timeout)):
        return "the peer took no bytes within the send timeout (it stopped reading)"
    return str(e)


class Channel:
    """One connection; `session` is the handshake's (None in insecure mode)."""

    def __init__(self, sock: socket.socket, session: Session | None = None, name: str = "peer",
                 send_timeout_s: float = SEND_TIMEOUT_S):
        self.sock = sock
        self.name = name
        self.session = session
        _set_send_timeout(sock, send_timeout_s)
        self._send_lock = threading.Lock()
        self._post_lock = threading.Lock()
        self._outbox: queue.SimpleQueue | None = None
        self.drops = DropLog(f"the PD connection with {name}", throttle=MESSAGE_DROPS)
        self.closed = False

    # ---- sending
    def send(self, msg: m.Message, payload: Callable | None = None) -> None:
        """Sends one frame; then `payload(write)` writes raw bytes through `write(view)` under
        the same lock, so a header and its page bytes are never interleaved with another
        sender's frame (with a session, the payload's MAC follows them). Any failure closes the
        connection: a partly written frame leaves the stream unusable."""
        body = m.encode(msg)
        with self._send_lock:
            if self.closed:
                raise ConnectionClosed(f"{self.name}: the connection is closed")
            try:
                if self.session is not None:  # under the lock: counters leave in order
                    body += self.session.frame_mac(body)
                self.sock.sendall(_LEN.pack(len(body)) + body)
                if payload is not None:
                    self._send_payload(payload)
            except OSError as e:
                self.close()
                raise ConnectionClosed(f"{self.name}: {_why(e)}") from None
            except BaseException:
                self.close()
                raise

    def _send_payload(self, payload: Callable) -> None:
        signer = self.session.payload_signer() if self.session is not None else None

        def write(view) -> None:
            if signer is not None:
                signer.update(view)
            self.sock.sendall(view)
        payload(write)
        if signer is not None:
            self.sock.sendall(signer.digest())

    def post(self, msg: m.Message) -> None:
        """Queues msg for this connection's writer thread: never blocks on the network. A send
        that fails closes the connection, so its reader hears of it."""
        self._enqueue(msg)

    def flush(self, timeout_s: float) -> None:
        """Waits up to timeout_s until what was posted before has been sent (or failed)."""
        done = threading.Event()
        if self._enqueue(done):
            done.wait(timeout_s)

    def _enqueue(self, item) -> bool:
        overflow = False
        with self._post_lock:
            if self.closed:
                return False
            if self._outbox is None:
                self._outbox = queue.SimpleQueue()
                threading.Thread(target=self._write_posted, args=(self._outbox,), daemon=True,
                                 name=f"pd-write {self.name}").start()
            overflow = self._outbox.qsize() >= MAX_POSTED
            if not overflow:
                self._outbox.put(item)
        if overflow:
            CONNECTION_REFUSALS.warn("dropped the PD connection with %s: %d messages wait for "
                                     "it (it does not keep up)", self.name, MAX_POSTED)
            self.close()
        return not overflow

    def _write_posted(self, outbox: queue.SimpleQueue) -> None:
        while True:
            item = outbox.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self.send(item)
            except ConnectionClosed:
                pass  # closed by send: the rest of the queue is dropped on the way to None

    # ---- receiving
    def recv(self) -> m.Message:
        """The next valid message; raises ConnectionClosed at EOF or on a foreign stream."""
        while True:
            (n,) = _LEN.unpack(self._read_exact(_LEN.size))
            if n > MAX_FRAME_BYTES:
                self.close()
                raise ConnectionClosed(f"{self.name}: a {n}-byte frame is not a pipefill "
                                       "message (stream closed)")
            body = self._read_frame(n)
            if self.session is not None:
                if n < MAC_BYTES:
                    self.drops.drop("a frame without a MAC")
                    continue
                body, mac = memoryview(body)[:-MAC_BYTES], body[-MAC_BYTES:]
                if not self.session.check_frame(body, mac):
                    self.drops.drop("a frame failed its MAC (forged, replayed or out of order)")
                    continue
            msg = m.decode(body)
            if msg is None:
                self.drops.drop("not a disaggregation message")
                continue
            return msg

    def recv_payload(self, views: Iterable[memoryview]) -> None:
        """Reads the page bytes after a KVChunk header (nbytes > 0) into `views`, in order;
        with a session, then their MAC: PayloadTampered, and the connection closed, when they
        are not the bytes the peer sent."""
        checker = self.session.payload_checker() if self.session is not None else None
        for view in views:
            self.recv_into(view)
            if checker is not None:
                checker.update(view)
        if checker is not None and \
                not hmac.compare_digest(self._read_exact(MAC_BYTES), checker.digest()):
            self.close()
            raise PayloadTampered(f"{self.name}: a KV chunk's page bytes fail their MAC "
                                  "(changed on the way): chunk refused, connection closed")

    def recv_into(self, view: memoryview) -> None:
        got, n = 0, len(view)
        while got < n:
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except OSError as e:
                raise ConnectionClosed(f"{self.name}: {e}") from None
            if k == 0:
                raise ConnectionClosed(f"{self.name}: connection closed")
            got += k

    def _read_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return buf

    def _read_frame(self, n: int) -> bytearray:
        """n bytes; beyond a small frame the buffer grows by what has arrived, so a declared
        length costs memory only once its bytes are sent."""
        if n <= SMALL_FRAME_BYTES:
            return self._read_exact(n)
        buf = bytearray()
        while len(buf) < n:
            waiting = self._bytes_waiting()
            buf += self._read_exact(max(1, min(waiting, READ_PIECE_BYTES, n - len(buf))))
        return buf

    def _bytes_waiting(self) -> int:
        """Waits (up to the socket's timeout) until there is something to read, then how many
        bytes the kernel holds (0 at EOF: the read that follows says so)."""
        timeout = self.sock.gettimeout()
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        try:
            if not poller.poll(None if timeout is None else timeout * 1000):
                raise ConnectionClosed(f"{self.name}: the rest of a frame did not come within "
                                       f"{timeout:g} s")
            count = fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except OSError as e:
            raise ConnectionClosed(f"{self.name}: {e}") from None
        return struct.unpack("i", count)[0]

    def close(self) -> None:
        with self._post_lock:
            if self.closed:
                return
            self.closed = True
            if self._outbox is not None:
                self._outbox.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
        except OSError:
            pass
        self.sock.close()


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    return sock


def connect(endpoint: m.Endpoint, timeout_s: float, secret: bytes | None = None,
            name: str | None = None, send_timeout_s: float = SEND_TIMEOUT_S) -> Channel:
    """A connection to endpoint, authenticated when there is a secret (AuthenticationFailed
    when the peer does not prove it); timeout_s bounds the connect and the handshake."""
    name = name or str(endpoint)
    sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s)
    try:
        _tune(sock)
        session = client_handshake(sock, secret, name) if secret else None
        sock.settimeout(None)  # reads block; liveness comes from heartbeats and socket errors
        return Channel(sock, session, name, send_timeout_s)
    except BaseException:
        sock.close()
        raise


def listen(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free port (read it from getsockname)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(64)
    return sock


# ------------------------------------------------------------------ listeners

class Listener:
    """Accepts connections on a thread of its own until `close()`; each is authenticated (with
    a secret) and handed to `handle(conn)` on a thread of its own, and closed when handle
    returns."""

    def __init__(self, host: str, port: int, handle: Callable[[Channel], None], *,
                 secret: bytes | None = None, name: str = "PD listener",
                 send_timeout_s: float = SEND_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 max_handshakes: int = MAX_HANDSHAKES,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S):
        self._sock = listen(host, port)
        self.port = self._sock.getsockname()[1]
        self.name, self._handle, self._secret = name, handle, secret
        self.send_timeout_s, self.handshake_timeout_s = send_timeout_s, handshake_timeout_s
        self.max_connections, self.max_handshakes = max_connections, max_handshakes
        self._lock = threading.Lock()
        self.num_open = 0  # connections being served (handshaking ones included)
        self.num_handshaking = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"pd-accept {name}")
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self._sock.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        pause = ACCEPT_RETRY_S[0]
        while not self._closed.is_set():
            try:
                sock, addr = self._sock.accept()
            except OSError as e:
                if self._closed.is_set():
                    return
                ACCEPT_ERRORS.warn("%s: accept failed (%s); retrying in %.2f s", self.name,
                                   e.strerror or e, pause)
                self._closed.wait(pause)
                pause = min(2 * pause, ACCEPT_RETRY_S[1])
                continue
            pause = ACCEPT_RETRY_S[0]
            self._start(sock, f"{addr[0]}:{addr[1]}")

    def _start(self, sock: socket.socket, name: str) -> None:
        """Serves the connection on a thread of its own, or closes it at once over the caps."""
        full = self._take_slot()
        if full is None:
            try:
                threading.Thread(target=self._serve, args=(sock, name), daemon=True,
                                 name="pd-conn").start()
                return
            except RuntimeError as e:  # no thread to be had: as full as it gets
                self._release_slot(self._secret is not None)
                full = str(e)
        sock.close()
        CONNECTION_REFUSALS.warn("%s: refused a connection from %s (%s)", self.name, name, full)

    def _take_slot(self) -> str | None:
        """None when the connection may be served, else why not."""
        with self._lock:
            if self.num_open >= self.max_connections:
                return f"{self.num_open} connections open, the most it serves"
            if self._secret is not None and self.num_handshaking >= self.max_handshakes:
                return f"{self.num_handshaking} connections have not proved the secret yet"
            self.num_open += 1
            self.num_handshaking += self._secret is not None
            return None

    def _release_slot(self, handshaking: bool) -> None:
        with self._lock:
            self.num_open -= 1
            self.num_handshaking -= handshaking

    def _serve(self, sock: socket.socket, name: str) -> None:
        handshaking, conn = self._secret is not None, None
        try:
            _tune(sock)
            session = None
            if handshaking:
                sock.settimeout(self.handshake_timeout_s)
                session = server_handshake(sock, self._secret, name)
                sock.settimeout(None)
                with self._lock:
                    self.num_handshaking -= 1
                handshaking = False
            conn = Channel(sock, session, name, self.send_timeout_s)
            self._handle(conn)
        except (ConnectionClosed, OSError) as e:
            if handshaking:  # a peer that did not prove the secret
                CONNECTION_REFUSALS.warn("%s: refused a connection: %s", self.name, e)
        finally:
            if conn is not None:
                conn.close()
            else:
                sock.close()
            self._release_slot(handshaking)
