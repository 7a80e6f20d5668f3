"""The handshake and the MACs of a PD connection (channel.py carries the frames).

With a cluster secret, a connection starts with a handshake of fixed-size frames, and nothing
larger is read or allocated before the peer has proved the secret:

  client -> server : MAGIC | client nonce                        (HELLO_BYTES)
  server -> client : MAGIC | server nonce | server proof          (REPLY_BYTES)
  client -> server : client proof                                 (MAC_BYTES)

A proof is HMAC-SHA256(secret, role | client nonce | server nonce); each side checks the
other's, and both derive one key per direction from the secret and the two fresh nonces.
Every frame after it ends with a MAC under its direction's key over (frame counter, length,
body), inside the frame's length, the counter being the number of frames sent that way before
it: a frame recorded on one connection is refused on any other (other keys), and out of order on its own. The page
bytes after a KVChunk header are covered by a MAC of their own (counted like a frame), sent
after them and checked before the receiver takes the chunk. A control frame that fails its
MAC, or does not decode, is dropped; page bytes that fail theirs end the connection.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

MAGIC = b"pipefill-pd/1\x00\x00\x00"
NONCE_BYTES = 32
MAC_BYTES = 32
HELLO_BYTES = len(MAGIC) + NONCE_BYTES
REPLY_BYTES = len(MAGIC) + NONCE_BYTES + MAC_BYTES

_FRAME_META = struct.Struct("!QcQ")  # counter, kind (frame or payload), length
_FRAME, _PAYLOAD = b"F", b"P"


class ConnectionClosed(ConnectionError):
    pass


class AuthenticationFailed(ConnectionClosed):
    """The peer did not prove the cluster secret (or spoke another protocol)."""


class PayloadTampered(ConnectionClosed):
    """Page bytes that are not the ones the authenticated peer sent."""


# ------------------------------------------------------------------ session keys and MACs

def _hmac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


class Session:
    """The keys one handshake left: one per direction, each with the count of frames (and
    payloads) sent that way so far, which every MAC covers."""

    def __init__(self, send_key: bytes, recv_key: bytes):
        # Keyed once; each MAC starts from a copy (cheaper than keying per frame).
        self._send = hmac.new(send_key, digestmod=hashlib.sha256)
        self._recv = hmac.new(recv_key, digestmod=hashlib.sha256)
        self.sent = 0
        self.received = 0

    @staticmethod
    def derive(secret: bytes, client_nonce: bytes, server_nonce: bytes,
               is_client: bool) -> "Session":
        c2s = _hmac(secret, b"key client->server", client_nonce, server_nonce)
        s2c = _hmac(secret, b"key server->client", client_nonce, server_nonce)
        return Session(c2s, s2c) if is_client else Session(s2c, c2s)

    def frame_mac(self, body: bytes) -> bytes:
        """The MAC of the next frame sent (the caller sends frames in this order)."""
        h = self._start(self._send, self.sent, _FRAME, len(body))
        self.sent += 1
        h.update(body)
        return h.digest()

    def check_frame(self, body, mac: bytes) -> bool:
        """True for the next frame the peer sent; a frame that fails does not count."""
        h = self._start(self._recv, self.received, _FRAME, len(body))
        h.update(body)
        if not hmac.compare_digest(h.digest(), mac):
            return False
        self.received += 1
        return True

    def payload_signer(self):
        """An HMAC to update with the payload's bytes as they are sent, then to send."""
        h = self._start(self._send, self.sent, _PAYLOAD, 0)
        self.sent += 1
        return h

    def payload_checker(self):
        h = self._start(self._recv, self.received, _PAYLOAD, 0)
        self.received += 1
        return h

    @staticmethod
    def _start(base, counter: int, kind: bytes, length: int):
        h = base.copy()
        h.update(_FRAME_META.pack(counter, kind, length))
        return h


def _recv_exact(sock: socket.socket, n: int, name: str) -> bytes:
    """n bytes of a handshake (n is one of the fixed handshake sizes)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise ConnectionClosed(f"{name}: no handshake within the timeout") from None
        except OSError as e:
            raise ConnectionClosed(f"{name}: {e}") from None
        if k == 0:
            raise ConnectionClosed(f"{name} closed the connection during the handshake (does "
                                   "it run with the same --cluster-secret?)")
        got += k
    return bytes(buf)


def client_handshake(sock: socket.socket, secret: bytes, name: str) -> Session:
    """The connecting side: raises AuthenticationFailed unless the server proves the secret."""
    nonce = os.urandom(NONCE_BYTES)
    try:
        sock.sendall(MAGIC + nonce)
    except OSError as e:
        raise ConnectionClosed(f"{name}: {e}") from None
    reply = _recv_exact(sock, REPLY_BYTES, name)
    magic, theirs = reply[:len(MAGIC)], reply[len(MAGIC):len(MAGIC) + NONCE_BYTES]
    proof = reply[len(MAGIC) + NONCE_BYTES:]
    if magic != MAGIC:
        raise AuthenticationFailed(f"{name} is not a pipefill PD endpoint with a cluster secret")
    if not hmac.compare_digest(proof, _hmac(secret, b"server", nonce, theirs)):
        raise AuthenticationFailed(f"{name} does not know this cluster secret: start both "
                                   "with the same --cluster-secret")
    try:
        sock.sendall(_hmac(secret, b"client", nonce, theirs))
    except OSError as e:
        raise ConnectionClosed(f"{name}: {e}") from None
    return Session.derive(secret, nonce, theirs, is_client=True)


def server_handshake(sock: socket.socket, secret: bytes, name: str) -> Session:
    """The accepting side: reads only fixed-size frames; AuthenticationFailed unless the
    client proves the secret."""
    hello = _recv_exact(sock, HELLO_BYTES, name)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthenticationFailed(f"{name}: not a PD handshake (a peer without "
                                   "--cluster-secret, or another protocol)")
    theirs, nonce = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
    try:
        sock.sendall(MAGIC + nonce + _hmac(secret, b"server", theirs, nonce))
    except OSError as e:
        raise ConnectionClosed(f"{name}: {e}") from None
    proof = _recv_exact(sock, MAC_BYTES, name)
    if not hmac.compare_digest(proof, _hmac(secret, b"client", theirs, nonce)):
        raise AuthenticationFailed(f"{name} does not know the cluster secret")
    return Session.derive(secret, theirs, nonce, is_client=False)
