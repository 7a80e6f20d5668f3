"""Typed wire formats: every message that crosses a socket is msgpack (msgspec), decoded
against a schema. Nothing received is ever unpickled, so no received byte can run code.

Front end <-> stage 0 (ZMQ): a message is one small struct per kind, encoded as the msgpack
array [kind, payload]. The kinds and their payload types are the tables below; the decoder is
a tagged union of them, so a foreign message (random bytes, a pickle, an unknown kind, a known
kind with a payload of the wrong type) fails to decode. The payload types are the dataclasses
of base/plan.py themselves, so the schema follows their fields as they change.

  front end -> stage 0 : ("add", [NewRequest]), ("abort", rid), ("stats", None),
                         ("trace", None), ("stop", None)
  stage -> front end   : ("join", (rank, node_rank)), ("ready", info), ("outputs",
                         [RequestOutput]), ("rejected", (rid, msg)), ("stage_stats", (rank,
                         stats)), ("load", stats), ("trace", (rank, events)), ("fatal", message)

Stage <-> stage (gloo): the body of a P2P message is a PipeMessage or a list of StepResults,
encoded the same way (see p2p.py: header, body and tensors travel as one frame).

With a cluster secret, a ZMQ frame is sealed (`Seal`): HMAC-SHA256 over (sender id, counter,
send time, body). The receiver checks the HMAC before it decodes anything, and refuses a
counter it has already seen from that sender (replay within a run) and a send time more than
MAX_CLOCK_SKEW_S away from its own clock (replay of a recording from an earlier run).
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import struct
import threading
import time
from typing import Any, Union

import msgspec

from pipefill.base.plan import NewRequest, RequestOutput

log = logging.getLogger(__name__)

Stats = dict[str, Any]  # free-form numbers and strings (msgpack types only, never objects)

FRONT_TO_STAGE: dict[str, Any] = {
    "add": list[NewRequest],
    "abort": str,
    "stats": None,
    "trace": None,
    "stop": None,
}
STAGE_TO_FRONT: dict[str, Any] = {
    "join": tuple[int, int],  # (stage rank, node rank): a stage's first message
    "ready": Stats,
    "outputs": list[RequestOutput],
    "rejected": tuple[str, str],  # (rid, reason)
    "stage_stats": tuple[int, Stats],  # (rank, stats)
    "load": Stats,
    "trace": tuple[int, list[Stats]],  # (rank, Chrome-trace events)
    "fatal": str,
}

MAX_CLOCK_SKEW_S = 300.0
DROP_LOG_INTERVAL_S = 10.0


class WireError(ValueError):
    """A received message that is not what the schema (or the cluster secret) allows."""


class MessageCodec:
    """(kind, payload) <-> bytes for one direction of the front-end sockets."""

    def __init__(self, kinds: dict[str, Any], name: str):
        self._structs = {kind: _kind_struct(name, kind, typ) for kind, typ in kinds.items()}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Union[tuple(self._structs.values())])

    def encode(self, kind: str, payload: Any = None) -> bytes:
        cls = self._structs.get(kind)
        if cls is None:
            raise ValueError(f"unknown message kind {kind!r} (known: {sorted(self._structs)})")
        return self._encoder.encode(cls(payload))

    def decode(self, data: bytes) -> tuple[str, Any]:
        """Raises WireError for anything but a message of a known kind with a valid payload."""
        try:
            msg = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WireError(f"not a pipefill message: {e}") from None
        return msg.__struct_config__.tag, msg.payload


def _kind_struct(name: str, kind: str, typ: Any) -> type:
    # array_like: encoded as [kind, payload]; the tag is what the union dispatches on.
    field = ("payload", type(None), None) if typ is None else ("payload", typ)
    return msgspec.defstruct(f"{name}_{kind}", [field], tag=kind, array_like=True,
                             forbid_unknown_fields=True)


def front_to_stage() -> MessageCodec:
    return MessageCodec(FRONT_TO_STAGE, "ToStage")


def stage_to_front() -> MessageCodec:
    return MessageCodec(STAGE_TO_FRONT, "ToFront")


class BodyCodec:
    """One dataclass type <-> bytes (P2P bodies between stages, arguments of a stage process)."""

    def __init__(self, typ: type, json: bool = False):
        self.type = typ
        module = msgspec.json if json else msgspec.msgpack
        self._encoder = module.Encoder()
        self._decoder = module.Decoder(typ)

    def encode(self, obj) -> bytes:
        return self._encoder.encode(obj)

    def decode(self, data: bytes):
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WireError(f"not a {self.type.__name__}: {e}") from None


class Seal:
    """HMAC-SHA256 framing for one socket end: mac(32) | sender(8) | counter(8) | time(8) | body.

    The sender id is random per socket, the counter counts that socket's messages: a receiver
    accepts only increasing counters per sender, so a message cannot be replayed within a run;
    the send time bounds replays across runs to MAX_CLOCK_SKEW_S (nodes' clocks must agree to
    within that)."""

    _META = struct.Struct("!8sQd")
    _MAC_LEN = 32

    def __init__(self, key: bytes):
        if not key:
            raise ValueError("the cluster secret is empty")
        self.key = key
        self.sender = os.urandom(8)
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self._last_seen: dict[bytes, int] = {}

    def seal(self, body: bytes) -> bytes:
        with self._lock:
            meta = self._META.pack(self.sender, next(self._counter), time.time())
        return self._mac(meta, body) + meta + body

    def open(self, frame: bytes) -> bytes:
        """The body of an authentic, fresh frame; WireError otherwise."""
        head = self._MAC_LEN + self._META.size
        if len(frame) < head:
            raise WireError("missing HMAC (a message without the cluster secret)")
        mac, meta, body = frame[:self._MAC_LEN], frame[self._MAC_LEN:head], frame[head:]
        if not hmac.compare_digest(mac, self._mac(meta, body)):
            raise WireError("bad HMAC (a sender without the right --cluster-secret)")
        sender, counter, sent_at = self._META.unpack(meta)
        if abs(time.time() - sent_at) > MAX_CLOCK_SKEW_S:
            raise WireError(f"send time {sent_at:.0f} is more than {MAX_CLOCK_SKEW_S:.0f} s "
                            "from this node's clock (a replay, or clocks out of sync)")
        with self._lock:
            if counter <= self._last_seen.get(sender, 0):
                raise WireError("a replayed message (counter already seen)")
            self._last_seen[sender] = counter
        return body

    def _mac(self, meta: bytes, body: bytes) -> bytes:
        h = hmac.new(self.key, meta, hashlib.sha256)
        h.update(body)
        return h.digest()


class LogThrottle:
    """At most one warning line per interval_s, however many threads or connections report:
    the first at once, later ones counted into the next line. One instance shared by every
    connection of a listener (or a process) bounds what a flood from many connections logs."""

    def __init__(self, interval_s: float = DROP_LOG_INTERVAL_S, logger: logging.Logger = log):
        self.interval_s, self.logger = interval_s, logger
        self._lock = threading.Lock()
        self.num_reports = 0  # logged or not
        self._unlogged = 0
        self._logged_at = -float("inf")

    def warn(self, fmt: str, *args) -> None:
        with self._lock:
            self.num_reports += 1
            self._unlogged += 1
            now = time.monotonic()
            if now - self._logged_at < self.interval_s:
                return
            more, self._logged_at, self._unlogged = self._unlogged - 1, now, 0
        if more:
            fmt, args = fmt + " (%d more since the last line)", (*args, more)
        self.logger.warning(fmt, *args)


class DropLog:
    """Counts the messages dropped on one socket end and logs them through a LogThrottle (its
    own, or one shared with other sockets), so a flood of garbage cannot flood the log."""

    def __init__(self, where: str, interval_s: float = DROP_LOG_INTERVAL_S,
                 throttle: LogThrottle | None = None):
        self.where = where
        self.throttle = throttle or LogThrottle(interval_s)
        self.num_dropped = 0

    @property
    def interval_s(self) -> float:
        return self.throttle.interval_s

    @interval_s.setter
    def interval_s(self, value: float) -> None:
        self.throttle.interval_s = value

    def drop(self, reason: str) -> None:
        self.num_dropped += 1
        self.throttle.warn("dropped a message on %s: %s", self.where, reason)


def read_cluster_secret(secret: str | None, secret_file: str | None) -> bytes | None:
    """The key of --cluster-secret / --cluster-secret-file (None: no secret)."""
    if secret is not None and secret_file is not None:
        raise ValueError("give --cluster-secret or --cluster-secret-file, not both")
    if secret_file is not None:
        try:
            with open(secret_file, "rb") as f:
                key = f.read().strip()
        except OSError as e:
            raise ValueError(f"--cluster-secret-file {secret_file!r}: {e.strerror}") from None
        if not key:
            raise ValueError(f"--cluster-secret-file {secret_file!r} is empty")
        return key
    if secret is not None:
        if not secret:
            raise ValueError("--cluster-secret is empty")
        return secret.encode()
    return None


class Framer:
    """Bytes <-> (kind, payload) for one socket end: the codec, the seal when there is a
    secret, and a rate-limited log of what was dropped."""

    def __init__(self, outgoing: MessageCodec | None, incoming: MessageCodec | None,
                 secret: bytes | None, where: str):
        self.outgoing, self.incoming = outgoing, incoming
        self.seal = Seal(secret) if secret else None
        self.drops = DropLog(where)

    def pack(self, kind: str, payload: Any = None) -> bytes:
        body = self.outgoing.encode(kind, payload)
        return self.seal.seal(body) if self.seal else body

    def unpack(self, frame: bytes) -> tuple[str, Any] | None:
        """The message, or None (logged) when it is foreign, malformed or not authentic."""
        try:
            body = self.seal.open(frame) if self.seal else frame
            return self.incoming.decode(body)
        except WireError as e:
            self.drops.drop(f"{e} ({len(frame)} bytes)")
        except Exception as e:  # noqa: BLE001 - a hostile message must never kill the receiver
            self.drops.drop(f"{type(e).__name__}: {e} ({len(frame)} bytes)")
        return None
