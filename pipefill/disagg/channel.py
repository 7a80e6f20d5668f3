"""One TCP connection carrying length-prefixed control frames (messages.py), optionally sealed
with the cluster secret (HMAC, wire.Seal), and raw page bytes after a KVChunk header.

A frame that does not decode, or fails the HMAC, is dropped and logged (at most one line per
interval); a length over MAX_FRAME_BYTES means the stream is not ours: the connection closes.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading

from pipefill.disagg import messages as m
from pipefill.runtime.wire import DropLog, Seal

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 << 20  # control frames are small; page lists of a 1M-token prompt fit
_LEN = struct.Struct("!I")
SOCKET_BUFFER_BYTES = 4 << 20


class ConnectionClosed(ConnectionError):
    pass


def make_seal(secret: bytes | None) -> Seal | None:
    """The cluster's HMAC framing (shared with the front-end sockets), or None."""
    return Seal(secret) if secret else None


class Channel:
    def __init__(self, sock: socket.socket, secret: bytes | None = None, name: str = "peer"):
        self.sock = sock
        self.name = name
        self._seal = make_seal(secret)
        self._send_lock = threading.Lock()
        self.drops = DropLog(f"the PD connection with {name}")
        self.closed = False

    def send(self, msg: m.Message, payload=None) -> None:
        """Sends one frame; `payload(sock)` then writes raw bytes under the same lock, so a
        header and its page bytes are never interleaved with another sender's frame."""
        body = m.encode(msg)
        with self._send_lock:
            if self._seal is not None:  # sealed under the lock: counters leave in order
                body = self._seal.seal(body)
            try:
                self.sock.sendall(_LEN.pack(len(body)) + body)
                if payload is not None:
                    payload(self.sock)
            except OSError as e:
                raise ConnectionClosed(f"{self.name}: {e}") from None

    def recv(self) -> m.Message:
        """The next valid message; raises ConnectionClosed at EOF or on a foreign stream."""
        while True:
            (n,) = _LEN.unpack(self._read(_LEN.size))
            if n > MAX_FRAME_BYTES:
                self.close()
                raise ConnectionClosed(f"{self.name}: a {n}-byte frame is not a pipefill "
                                       "message (stream closed)")
            body = self._read(n)
            if self._seal is not None:
                try:
                    body = self._seal.open(body)
                except ValueError as e:
                    self.drops.drop(str(e))
                    continue
            msg = m.decode(body)
            if msg is None:
                self.drops.drop("not a disaggregation message")
                continue
            return msg

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

    def _read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
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
            name: str | None = None) -> Channel:
    sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s)
    sock.settimeout(None)  # reads block; liveness comes from heartbeats and socket errors
    return Channel(_tune(sock), secret, name or str(endpoint))


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


def accept(listener: socket.socket, secret: bytes | None) -> Channel | None:
    """The next connection, or None when the listener was closed."""
    try:
        sock, addr = listener.accept()
    except OSError:
        return None
    return Channel(_tune(sock), secret, f"{addr[0]}:{addr[1]}")
