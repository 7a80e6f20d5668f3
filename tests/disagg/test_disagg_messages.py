"""Control messages of PD disaggregation: typed round trips, foreign bytes dropped (never
unpickled), HMAC-sealed channels, the framing's defences."""
from __future__ import annotations

import pickle
import socket
import struct
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from pipefill.disagg import channel as ch
from pipefill.disagg import handshake as hs
from pipefill.disagg import messages as m

EP = m.Endpoint("127.0.0.1", 4242)
SAMPLES = [
    m.RegisterStage(1, 2, 15, 30, 30, EP, 64, "bfloat16", 3, 64, "abcd", "tcp"),
    m.Ack(True), m.Ack(False, "no"), m.Lookup(), m.NotReady("stages so far: [0]"),
    m.PrefillInfo([m.RegisterStage(0, 1, 0, 30, 30, EP, 64, "float32", 3, 64, "f", "mooncake")]),
    m.DecodeHello("decode-1", 0, 30, 49152, "127.0.0.1:1234", [1 << 40, 2], [3, 4]),
    m.RoomBootstrap((1 << 63) - 1, 5, [7, 3, 9], 1),
    m.KVChunk(1, 2, 0, 3, 4, 5, 0, 15, 1 << 33, True),
    m.FinalMeta(9, 8, 100, 42, -0.25, [(42, -0.25), (7, -3.5)], b"\x00\x01state"),
    m.FinalMeta(9, 8, 100, 42),
    m.RoomFailed(1, 2, 0, "boom"), m.RoomFailed(1, 2, 0, "too long", 400),
    m.RejectRoom(1, 400, "too long"), m.DropRoom(1, 2, "timeout"), m.DropAck(1, 2, 1),
    m.Heartbeat("prefill-0", [1, 2, 3]),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg):
    assert m.decode(m.encode(msg)) == msg


def test_every_message_kind_is_sampled():
    kinds = set(m.Message.__args__)
    assert kinds == {type(x) for x in SAMPLES}


@pytest.mark.parametrize("junk", [
    b"", b"\x00", b"garbage bytes \xff\xfe", pickle.dumps({"room": 1}),
    pickle.dumps(m.Ack(True).__class__),  # a pickle naming one of our classes
    msgspec.msgpack.encode(["NoSuchKind", 1, 2]),
    msgspec.msgpack.encode(["RoomBootstrap", "not a number", 5, [1], 1]),  # wrong field type
    msgspec.msgpack.encode(["KVChunk", 1, 2]),  # missing fields
    msgspec.msgpack.encode({"room": 1}),
], ids=range(9))
def test_foreign_bytes_are_dropped(junk, caplog):
    assert m.decode(junk) is None


def test_model_fingerprint_follows_the_architecture():
    a = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}
    assert m.model_fingerprint(a) == m.model_fingerprint(dict(reversed(list(a.items()))))
    assert m.model_fingerprint(a) != m.model_fingerprint({**a, "num_layers": 31})


def _pair(secret=None):
    """Two ends of a socket pair; with a secret, after the handshake (the accepting end's
    half on a thread)."""
    a, b = socket.socketpair()
    if secret is None:
        return ch.Channel(a, None, "a"), ch.Channel(b, None, "b")
    with ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(hs.server_handshake, b, secret, "b")
        session = hs.client_handshake(a, secret, "a")
        return ch.Channel(a, session, "a"), ch.Channel(b, accepted.result(), "b")


def test_channel_drops_garbage_frames_and_keeps_reading():
    a, b = _pair()
    a.sock.sendall(struct.pack("!I", 5) + b"junk!")  # a frame that is not a message
    a.send(m.Heartbeat("x"))
    assert b.recv() == m.Heartbeat("x")
    assert b.drops.num_dropped == 1


def test_channel_closes_on_an_absurd_frame_length():
    a, b = _pair()
    a.sock.sendall(struct.pack("!I", ch.MAX_FRAME_BYTES + 1))
    with pytest.raises(ch.ConnectionClosed, match="not a pipefill message"):
        b.recv()


def test_sealed_channel_accepts_the_secret_and_drops_the_rest():
    a, b = _pair(b"s3cret")
    a.send(m.DropRoom(1, 2, "x"))
    assert b.recv() == m.DropRoom(1, 2, "x")
    # Keys of its own: it cannot know the ones the handshake derived.
    intruder = ch.Channel(a.sock, hs.Session(b"k" * 32, b"k" * 32), "intruder")
    intruder.send(m.DropRoom(3, 4, "forged"))
    plain = ch.Channel(a.sock, None, "plain")
    plain.send(m.DropRoom(5, 6, "unsealed"))
    a.send(m.Heartbeat("ok"))
    assert b.recv() == m.Heartbeat("ok")  # the two foreign frames were dropped on the way
    assert b.drops.num_dropped == 2


def test_sealed_channel_refuses_a_replayed_frame():
    a, b = _pair(b"k")
    frames = []
    real = a.sock

    class Recorder:
        def sendall(self, data):
            frames.append(data)
            real.sendall(data)
    a.sock = Recorder()
    a.send(m.Heartbeat("once"))
    assert b.recv() == m.Heartbeat("once")
    real.sendall(frames[0])  # the same bytes again
    a.send(m.Heartbeat("next"))
    assert b.recv() == m.Heartbeat("next")
    assert b.drops.num_dropped == 1
