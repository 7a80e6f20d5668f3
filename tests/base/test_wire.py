"""Typed wire messages (pipefill/base/wire.py) and the ZMQ channels built on them: every
message kind round-trips; garbage, pickles, truncated or mistyped messages and bad HMACs are
dropped with a log line and never executed; stage reports never block on a slow front end;
the IPC folder is private and removed on close."""
from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import threading
import types
import typing
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipefill.config import ServerArgs
from pipefill.base import wire
from pipefill.runtime.ipc import Addresses, FrontChannel, StageChannel
from pipefill.runtime.worker import StageStart, decode_stage_start, encode_stage_start
from pipefill.base.plan import (NewRequest, PipeMessage, RequestOutput, SamplingParams,
                                StepResult)

HYPOTHESIS = settings(max_examples=40, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow])


# ---- strategies derived from the types (new dataclass fields are covered automatically) -----

def strategy(t) -> st.SearchStrategy:
    """Values of type t that msgpack can carry exactly (64-bit ints, floats without NaN)."""
    scalars = {int: st.integers(-2**63, 2**63 - 1), float: st.floats(allow_nan=False),
               str: st.text(max_size=8), bool: st.booleans(), type(None): st.none(),
               None: st.none()}
    if t in scalars:
        return scalars[t]
    if t is Any:
        return st.one_of(*(scalars[k] for k in (int, float, str, bool, None)))
    if isinstance(t, type) and issubclass(t, enum.Enum):  # CacheOp.kind
        return st.sampled_from(list(t))
    if t is tuple:  # PipeMessage.control: a bare tuple of words
        return st.lists(st.text(max_size=6), max_size=2).map(tuple)
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy(a) for a in args))
    if origin is list:
        return st.lists(strategy(args[0]), max_size=3)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy(args[0]), max_size=3).map(tuple)
        return st.tuples(*(strategy(a) for a in args))
    if origin is dict:
        return st.dictionaries(strategy(args[0]), strategy(args[1]), max_size=3)
    if dataclasses.is_dataclass(t):
        hints = typing.get_type_hints(t)
        return st.builds(t, **{f.name: strategy(hints[f.name]) for f in dataclasses.fields(t)
                               if f.init})
    raise TypeError(f"no strategy for {t!r}: extend tests/base/test_wire.py::strategy")


def kinds_and_payloads(table):
    return st.sampled_from(sorted(table)).flatmap(
        lambda kind: st.tuples(st.just(kind), strategy(table[kind])))


# ---- round trips ----------------------------------------------------------------------------

@HYPOTHESIS
@given(kinds_and_payloads(wire.FRONT_TO_STAGE))
def test_every_front_to_stage_kind_round_trips(msg):
    codec = wire.front_to_stage()
    assert codec.decode(codec.encode(*msg)) == msg


@HYPOTHESIS
@given(kinds_and_payloads(wire.STAGE_TO_FRONT))
def test_every_stage_to_front_kind_round_trips(msg):
    codec = wire.stage_to_front()
    assert codec.decode(codec.encode(*msg)) == msg


@HYPOTHESIS
@given(strategy(PipeMessage), strategy(StepResult))
def test_p2p_bodies_round_trip(msg, result):
    for body in (msg, result):
        codec = wire.BodyCodec(type(body))
        assert codec.decode(codec.encode(body)) == body


def test_a_real_plan_round_trips():
    from pipefill.base.plan import SampleSpec, SeqWork, StepPlan
    plan = StepPlan(7, [SeqWork("a", 0, 3, [1, 2, 3], [0], SampleSpec(0.7, 0.9, 5, 1, 0, 2)),
                        SeqWork("b", 5, 6, [9], [1, 2], None, [4])])
    msg = PipeMessage(plan, [0.25], None)
    out = wire.BodyCodec(PipeMessage).decode(wire.BodyCodec(PipeMessage).encode(msg))
    assert out == msg and isinstance(out.plan.seqs[0].sample, SampleSpec)
    stop = wire.BodyCodec(PipeMessage).decode(wire.BodyCodec(PipeMessage).encode(
        PipeMessage(None, control=("stop",))))
    assert stop.control == ("stop",)


def test_cache_ops_travel_as_their_kind_and_an_unknown_kind_is_refused():
    from pipefill.base.plan import CacheOp, CopyKind, PageOps, StepPlan
    codec = wire.BodyCodec(PipeMessage)
    ops = PageOps([3], [4], [CacheOp(CopyKind.STORE, 1, 5), CacheOp(CopyKind.FETCH, 2, -1, "ab")])
    data = codec.encode(PipeMessage(StepPlan(1, [], ops)))
    out = codec.decode(data)
    assert out.plan.page_ops == ops and out.plan.page_ops.cache_ops[0].kind is CopyKind.STORE
    with pytest.raises(wire.WireError, match="Invalid enum value 'stash'"):
        codec.decode(data.replace(b"store", b"stash"))


def test_stage_start_round_trips_and_checks_the_args():
    args = ServerArgs(pp_size=2, chunked_prefill_size="auto", cluster_secret="s3",
                      dynamic_chunking_smooth_factor=0.5)
    addrs = Addresses("ipc:///x/requests", "tcp://h:2", "tcp://1.2.3.4:2", "/x", b"\x00key")
    start = decode_stage_start(encode_stage_start(args, "/m.gguf", 1, addrs))
    assert start == StageStart(args, "/m.gguf", 1, addrs)
    bad = encode_stage_start(args, "/m.gguf", 1, addrs).replace(b'"pp_size":2', b'"pp_size":0')
    with pytest.raises(wire.WireError, match="--pp-size must be at least 1"):
        decode_stage_start(bad)


def test_p2p_body_codec_rejects_foreign_bytes(tmp_path):
    codec = wire.BodyCodec(PipeMessage)
    good = codec.encode(PipeMessage(None, control=("stop",)))
    for data in (good[:-1], b"", pickle.dumps(PipeMessage(None)), wire.BodyCodec(
            StepResult).encode(StepResult(1))):
        with pytest.raises(wire.WireError, match="not a PipeMessage"):
            codec.decode(data)


def test_unknown_kind_is_a_sender_error():
    with pytest.raises(ValueError, match="unknown message kind 'exec'"):
        wire.front_to_stage().encode("exec", "x")


# ---- hostile input --------------------------------------------------------------------------

class _MakesFile:
    """Unpickling this creates a file: proof that a pickle was executed."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def hostile_frames(tmp_path, kinds=wire.FRONT_TO_STAGE) -> dict[str, bytes]:
    """Frames that must never decode for a receiver of these kinds."""
    other_way = ["fatal", "x"] if "fatal" not in kinds else ["add", []]
    good = wire.front_to_stage().encode("add", [NewRequest("r", [1, 2], SamplingParams())])
    return {
        "pickle": pickle.dumps(("add", _MakesFile(str(tmp_path / "pwned")))),
        "pickle-tuple-of-kind": pickle.dumps(("stop", None)),
        "garbage": os.urandom(64),
        "empty": b"",
        "truncated": good[:len(good) // 2],
        "wrong payload type": msgspec.msgpack.encode(["abort", 5]),
        "unknown kind": msgspec.msgpack.encode(["exec", "rm -rf /"]),
        "a kind of the other direction": msgspec.msgpack.encode(other_way),
        "a map": msgspec.msgpack.encode({"kind": "stop"}),
        "extra field": msgspec.msgpack.encode(["stop", None, 1]),
    }


def test_hostile_frames_are_dropped_and_logged_not_executed(tmp_path, caplog):
    framer = wire.Framer(None, wire.front_to_stage(), None, "test")
    framer.drops.interval_s = 0.0  # log every drop here
    for name, frame in hostile_frames(tmp_path).items():
        caplog.clear()
        assert framer.unpack(frame) is None, name
        assert "dropped a message on test" in caplog.text, name
    assert not (tmp_path / "pwned").exists()
    assert framer.drops.num_dropped == len(hostile_frames(tmp_path))


@HYPOTHESIS
@given(st.binary(max_size=200))
def test_random_bytes_never_raise(data):
    framer = wire.Framer(None, wire.stage_to_front(), None, "test")
    msg = framer.unpack(data)
    assert msg is None or msg[0] in wire.STAGE_TO_FRONT


def test_drop_log_is_rate_limited(caplog):
    framer = wire.Framer(None, wire.front_to_stage(), None, "test")
    for _ in range(100):
        framer.unpack(b"\xc1garbage")
    assert caplog.text.count("dropped a message") == 1  # the next line waits DROP_LOG_INTERVAL_S
    assert framer.drops.num_dropped == 100


def test_hmac_wrong_missing_replayed_or_stale_is_dropped(caplog):
    codec = wire.front_to_stage()
    sender = wire.Framer(codec, None, b"secret", "a")
    receiver = wire.Framer(None, codec, b"secret", "b")
    receiver.drops.interval_s = 0.0
    frame = sender.pack("abort", "r1")
    assert receiver.unpack(frame) == ("abort", "r1")
    assert receiver.unpack(frame) is None and "replayed" in caplog.text
    wrong = wire.Framer(codec, None, b"other", "c").pack("abort", "r2")
    assert receiver.unpack(wrong) is None and "bad HMAC" in caplog.text
    plain = codec.encode("stop")
    assert receiver.unpack(plain) is None and "missing HMAC" in caplog.text
    tampered = bytearray(sender.pack("abort", "r3"))
    tampered[-1] ^= 1
    assert receiver.unpack(bytes(tampered)) is None
    seal = sender.seal  # a correctly signed frame sent long ago (a recorded replay)
    meta = seal._META.pack(seal.sender, 10**6, 1000.0)
    body = codec.encode("stop")
    assert receiver.unpack(seal._mac(meta, body) + meta + body) is None
    assert "from this node's clock" in caplog.text
    assert receiver.unpack(sender.pack("abort", "r4")) == ("abort", "r4")


def test_cluster_secret_flags(tmp_path):
    assert wire.read_cluster_secret(None, None) is None
    assert wire.read_cluster_secret("abc", None) == b"abc"
    (tmp_path / "s").write_text("xyz\n")
    assert wire.read_cluster_secret(None, str(tmp_path / "s")) == b"xyz"
    with pytest.raises(ValueError, match="not both"):
        wire.read_cluster_secret("abc", str(tmp_path / "s"))
    with pytest.raises(ValueError, match="--cluster-secret-file .*No such file"):
        wire.read_cluster_secret(None, str(tmp_path / "missing"))
    (tmp_path / "e").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        wire.read_cluster_secret(None, str(tmp_path / "e"))
    assert "abc" not in repr(ServerArgs(cluster_secret="abc"))


# ---- real sockets ---------------------------------------------------------------------------

@pytest.fixture
def channels():
    made = []

    def make(args=ServerArgs(), **stage_kw):
        addrs = Addresses.fresh(args)
        front = FrontChannel(addrs, zmq.Context())
        stage = StageChannel(addrs, read_requests=True, **stage_kw)
        made.append((front, stage))
        return front, stage, addrs
    yield make
    for front, stage in made:
        stage.close()
        front.close()
        front.ctx.term()


def raw_push(address: str, frames: list[bytes]) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.connect(address)
    for f in frames:
        s.send(f)
    s.close(linger=5000)
    ctx.term()


def test_channels_drop_hostile_frames_and_keep_serving(channels, tmp_path):
    front, stage, addrs = channels()
    hostile = list(hostile_frames(tmp_path).values())
    for frame in hostile:  # the requests socket is the front end's PUSH: inject through it
        front.out.send(frame)
    front.send("abort", "r1")
    got = []
    while not got:
        got = stage.poll(1000)
    assert got == [("abort", "r1")]
    assert stage.framer.drops.num_dropped == len(hostile)
    hostile = list(hostile_frames(tmp_path, wire.STAGE_TO_FRONT).values())
    raw_push(addrs.events, hostile)
    for _ in range(30):  # each recv drops what arrived, then waits out its timeout
        if front.framer.drops.num_dropped == len(hostile):
            break
        assert front.recv(1000) is None
    stage.report("rejected", ("r2", "too long"))
    assert front.recv(10_000) == ("rejected", ("r2", "too long"))
    assert front.framer.drops.num_dropped == len(hostile)
    assert not (tmp_path / "pwned").exists()


def test_a_stage_without_the_secret_is_not_accepted(channels, caplog):
    front, stage, addrs = channels(ServerArgs(cluster_secret="right"), rank=0)
    intruder = StageChannel(dataclasses.replace(addrs, secret=b"wrong"), False, rank=1)
    intruder.report("fatal", "stage 1 failed")  # would take the server down if accepted
    intruder.close()
    stage.report("load", {"running": 1})
    assert front.recv(10_000) == ("load", {"running": 1})
    assert front.recv(200) is None
    assert front.joined == {0: 0}  # the join of rank 0 proved the secret, rank 1's did not
    assert "bad HMAC" in caplog.text


@pytest.mark.parametrize("intruder_secret", [b"right", b"wrong"])
def test_ready_needs_every_stage_to_prove_the_secret(channels, intruder_secret):
    front, stage, addrs = channels(ServerArgs(cluster_secret="right", pp_size=2), rank=0)
    front.join_grace_s = 0.5
    other = StageChannel(dataclasses.replace(addrs, secret=intruder_secret), False, rank=1)
    stage.report("ready", {"num_pages": 8})
    msg = front.recv(10_000)
    other.close()
    if intruder_secret == b"right":
        assert msg == ("ready", {"num_pages": 8}) and front.joined == {0: 0, 1: 0}
    else:
        assert msg[0] == "fatal" and "stage(s) 1 did not join" in msg[1]
        assert "same --cluster-secret" in msg[1]


def test_stage_reports_never_block_on_a_slow_front_end(channels):
    """ZMQ's default high-water marks (1,000 messages each side) used to block stage 0's loop
    once the front end fell behind; now reports queue and none is lost."""
    front, stage, _ = channels()
    n = 5000
    sent = threading.Event()

    def report_all():
        for i in range(n):
            stage.report("outputs", [RequestOutput(f"r{i}", [i])])
        sent.set()
    t = threading.Thread(target=report_all, daemon=True)
    t.start()
    t.join(120)  # a hang guard, not a timing threshold: blocked sends never finish
    assert sent.is_set(), "stage reports blocked on a front end that does not read"
    got = [front.recv(10_000) for _ in range(n)]
    assert [m[1][0].new_token_ids for m in got] == [[i] for i in range(n)]


def test_ipc_folder_is_private_and_removed(channels):
    front, _, addrs = channels()
    assert os.stat(addrs.folder).st_mode & 0o777 == 0o700
    assert addrs.requests.startswith("ipc://" + addrs.folder)
    front.close()
    assert not os.path.exists(addrs.folder)


def test_multi_node_events_bind_the_rendezvous_interface(caplog):
    from pipefill.base.platform import free_port
    port = free_port()
    args = ServerArgs(pp_size=2, nnodes=2, dist_init_addr=f"localhost:{port - 1}")
    addrs = Addresses.fresh(args)
    assert addrs.events == f"tcp://localhost:{port}"
    assert addrs.events_bind == f"tcp://127.0.0.1:{port}"
    front = FrontChannel(addrs, zmq.Context())
    try:
        assert "unauthenticated" in caplog.text
    finally:
        front.close()
        front.ctx.term()
    other = Addresses.fresh(args.replace(node_rank=1))
    assert other.folder is None and other.events == addrs.events


# ---- P2P between two real gloo ranks --------------------------------------------------------

P2P_PEER = """
import datetime, os, pickle, sys, time
import torch, torch.distributed as dist
rank, port, mode, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2, timeout=datetime.timedelta(seconds=60))
from pipefill.runtime import p2p
if rank == 0:  # a sender that does not speak the protocol
    class MakesFile:
        def __reduce__(self):
            return (open, (marker, "w"))
    body = pickle.dumps(MakesFile())
    rows = 10 if mode == "rows" else -1
    size = (1 << 40) if mode == "huge" else len(body)
    frame_len = p2p.frame_layout(len(body), -1, ())[1]  # as if there were no tensors
    header = p2p.Header(0, size, rows, frame_len, p2p.FIRST_SLOT_BYTES).pack()
    frame = bytearray(frame_len)
    frame[:len(header)] = header
    frame[p2p.HEADER_BYTES:p2p.HEADER_BYTES + len(body)] = body
    if mode == "foreign":  # the framing of an older pipefill: (body length, rows), then the body
        frame = bytearray(torch.tensor([len(body), -1], dtype=torch.int64).numpy().tobytes())
    dist.send(torch.frombuffer(frame, dtype=torch.uint8), 1, tag=100)
    time.sleep(120)  # stays up until the test ends it: the receiver sees the bytes, not a close
else:
    pipe = p2p.Pipe(1, 2, 8, torch.float32, torch.device("cpu"))
    try:
        pipe.recv_forward()
        print("RECEIVED")
    except RuntimeError as e:
        print("ERROR:", e)
    sys.stdout.flush()
    os._exit(0)
"""

P2P_ERRORS = {"pickle": "malformed message", "huge": "malformed header: body of",
              "rows": "malformed header: a frame of", "foreign": "not a pipefill frame"}


@pytest.mark.parametrize("mode", list(P2P_ERRORS))
def test_p2p_rejects_a_foreign_frame_with_a_clear_error(tmp_path, mode):
    import subprocess
    import sys

    from pipefill.base.platform import free_port
    port, marker = str(free_port()), str(tmp_path / "pwned")
    procs = [subprocess.Popen([sys.executable, "-c", P2P_PEER, str(r), port, mode, marker],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    try:
        out = procs[1].communicate(timeout=120)[0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "ERROR: link to stage 0 failed" in out, out
    assert P2P_ERRORS[mode] in out, out
    assert not os.path.exists(marker)
