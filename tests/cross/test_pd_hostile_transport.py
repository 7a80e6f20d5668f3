"""The PD transfer plane against a peer on the same network: frames declared huge, recorded
and replayed, KV bytes changed on the way, a decode that stops reading, an accept loop out of
file descriptors, strangers re-registering a prefill stage, floods of bad frames and of
connections. Real sockets throughout; the prefill side is the real KVSender and bootstrap
service (the file-descriptor case runs the service as its own process)."""
from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import torch

from conftest import wait_until
from pipefill.bench.memory import proc_status_bytes
from pipefill.disagg import channel as ch
from pipefill.disagg import handshake as hs
from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import BootstrapServer, lookup_prefill, register_stage
from pipefill.disagg.transfer import KVTensors, Timing
from pipefill.disagg.transfer_receiver import KVReceiver
from pipefill.disagg.transfer_sender import KVSender

SECRET = b"the cluster secret"
PAGE, HEADS, DIM = 16, 8, 64
FAST = Timing(bootstrap_timeout_s=20, waiting_timeout_s=20, heartbeat_interval_s=0.2,
              heartbeat_max_misses=3, send_timeout_s=1.0)
MODES = pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "insecure"])
pytestmark = pytest.mark.timeout(120)  # a regression that blocks fails instead of hanging


def kv_tensors(layers: int, pages: int, seed: int | None = None) -> KVTensors:
    shape = (layers, pages * PAGE, HEADS, DIM)
    if seed is None:
        return KVTensors(torch.zeros(shape), torch.zeros(shape), PAGE)
    g = torch.Generator().manual_seed(seed)
    return KVTensors(torch.randn(shape, generator=g), torch.randn(shape, generator=g), PAGE)


def sender_with_service(kv: KVTensors, secret, timing=FAST):
    service = BootstrapServer(port=0, secret=secret)
    sender = KVSender(kv, 0, release=lambda room, pages: None, timing=timing, secret=secret)
    register_stage(service.endpoint, registration(sender), secret=secret)
    return service, sender


def registration(sender: KVSender, endpoint: m.Endpoint | None = None) -> m.RegisterStage:
    reg = sender.registration(pp_size=1, num_layers=sender.kv.num_layers, num_kv_heads=HEADS,
                              head_dim=DIM, model_fingerprint="tiny")
    return reg if endpoint is None else msgspec.structs.replace(reg, endpoint=endpoint)


def stage_at(port: int) -> m.RegisterStage:
    """A registration of stage 0 (of 1) whose endpoint is port on this host."""
    return m.RegisterStage(0, 1, 0, 2, 2, m.Endpoint("127.0.0.1", port), PAGE, "float32",
                           HEADS, DIM, "tiny", "tcp")


def free_port() -> int:
    """A port nobody listens on (picked by binding, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_to_eof(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """What the other end sent until it closed (a reset, when it closed with our bytes
    unread, ends it too)."""
    sock.settimeout(timeout_s)
    out = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            out += chunk
    except ConnectionResetError:
        pass
    return bytes(out)


class Relay:
    """A man in the middle: a TCP relay to `target` that records what each client sends and
    can flip one byte of what the server sends, at offset flip_at of a connection's stream."""

    def __init__(self, target: m.Endpoint, flip_at: int | None = None):
        self.target, self.flip_at = target, flip_at
        self.recorded: list[bytearray] = []  # per connection, the client's bytes
        self.flipped = False
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = m.Endpoint("127.0.0.1", self._server.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection((self.target.host, self.target.port))
            record = bytearray()
            self.recorded.append(record)
            for src, dst, rec in ((client, upstream, record), (upstream, client, None)):
                threading.Thread(target=self._pump, args=(src, dst, rec), daemon=True).start()

    def _pump(self, src, dst, record: bytearray | None) -> None:
        offset = 0
        try:
            while data := src.recv(1 << 16):
                if record is not None:
                    record += data
                elif self.flip_at is not None and offset <= self.flip_at < offset + len(data):
                    data = bytearray(data)
                    data[self.flip_at - offset] ^= 0x01
                    self.flipped = True
                offset += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


# ------------------------------------------------------------------ memory before trust

@MODES
def test_a_thousand_connections_declaring_64_mib_frames_cost_no_memory(secret):
    """Each connection declares a 64 MiB frame and sends nothing more, 200 of them held open
    at a time: nothing is allocated for a frame before its bytes arrive (and, with a secret,
    nothing but the handshake's fixed-size frames is read before the peer proved it)."""
    service, sender = sender_with_service(kv_tensors(2, 8, seed=0), secret)
    target = (sender.endpoint.host, sender.endpoint.port)
    declare = struct.pack("!I", 64 << 20)
    try:
        for _ in range(20):  # warm up: the first connection threads' stacks and arenas
            with socket.create_connection(target) as s:
                s.sendall(declare)
        time.sleep(0.3)
        base = proc_status_bytes(os.getpid(), "VmRSS")
        growth = 0
        for _ in range(5):
            held = []
            for i in range(200):
                s = socket.create_connection(target)
                s.sendall(declare)
                held.append(s)
                if i % 10 == 9:  # fail early: each frame allocated would be 64 MiB
                    time.sleep(0.01)
                    growth = max(growth, proc_status_bytes(os.getpid(), "VmRSS") - base)
                    assert growth < 48 << 20, f"RSS grew {growth >> 20} MiB"
            for s in held:
                s.close()
        assert growth < 16 << 20, f"RSS grew {growth / 2**20:.1f} MiB over 1,000 connections"
    finally:
        sender.close()
        service.close()


# ------------------------------------------------------------------ replay and tampering

def test_a_registration_recorded_on_one_connection_is_refused_on_another(caplog):
    """An attacker who recorded stage 0's registration replays it after the stage restarted
    elsewhere (both endpoints are gone by then, so only the connection's authentication stands
    in the way): the decodes must still be sent to the restarted stage."""
    service = BootstrapServer(port=0, secret=SECRET)
    relay = Relay(service.endpoint)
    try:
        first, restarted = stage_at(free_port()), stage_at(free_port())
        register_stage(relay.endpoint, first, timeout_s=10, secret=SECRET)
        register_stage(service.endpoint, restarted, timeout_s=10, secret=SECRET)
        assert lookup_prefill(service.endpoint, 5, SECRET).stages[0].endpoint == \
            restarted.endpoint
        recorded = bytes(relay.recorded[0])
        with socket.create_connection((service.endpoint.host, service.endpoint.port)) as s:
            s.sendall(recorded)
            answer = read_to_eof(s)
        info = lookup_prefill(service.endpoint, 5, SECRET)
        assert info.stages[0].endpoint == restarted.endpoint
        assert len(answer) <= hs.REPLY_BYTES  # the handshake's reply at most, never an Ack
    finally:
        relay.close()
        service.close()


def test_frames_delivered_out_of_order_are_refused():
    """Two frames of one authenticated connection, recorded and delivered second first: the
    second is refused (its counter is not the next one), the first is taken."""
    listener_side: list[ch.Channel] = []
    taken = threading.Event()

    def hold(conn: ch.Channel) -> None:
        listener_side.append(conn)
        taken.set()
        time.sleep(5)  # the test reads it meanwhile; the listener closes it after
    listener = ch.Listener("127.0.0.1", 0, hold, secret=SECRET)
    client = ch.connect(m.Endpoint("127.0.0.1", listener.port), 5, SECRET)
    try:
        real, recorded = client.sock, []

        class Recorder:
            def sendall(self, data):
                recorded.append(bytes(data))
        client.sock = Recorder()
        client.send(m.Heartbeat("first"))
        client.send(m.Heartbeat("second"))
        real.sendall(recorded[1] + recorded[0])
        assert taken.wait(5)
        server = listener_side[0]
        assert server.recv() == m.Heartbeat("first")
        assert server.drops.num_dropped == 1
    finally:
        real.close()
        listener.close()


def test_a_changed_kv_payload_byte_fails_the_room_and_closes_the_connection():
    """A relay between the decode and the prefill stage flips one byte 1 MiB into what the
    stage sends (inside the first chunk's 6 MiB of page bytes): the chunk does not count, the
    room fails with a sentence saying why, and the connection closes."""
    src = kv_tensors(2, 48, seed=1)
    service, sender = sender_with_service(src, SECRET)
    relay = Relay(sender.endpoint, flip_at=1 << 20)
    receiver = KVReceiver(kv_tensors(2, 48), release=lambda room, pages: None, timing=FAST,
                          secret=SECRET)
    try:
        info = lookup_prefill(service.endpoint, 5, SECRET)
        via_relay = m.PrefillInfo([msgspec.structs.replace(info.stages[0],
                                                           endpoint=relay.endpoint)])
        receiver.connect("p", via_relay)
        pages = list(range(48))
        receiver.expect_room(1, "p", pages, want_final=False)
        sender.open_room(1)
        sender.send_pages(1, 0, pages, is_last=True)
        res = receiver.wait_room(1, 20)
        assert relay.flipped
        assert res is not None and not res.ok and "fail their MAC" in res.reason, res
        assert wait_until(lambda: not receiver.connected("p"))
    finally:
        receiver.close()
        relay.close()
        sender.close()
        service.close()


# ------------------------------------------------------------------ a peer that stops reading

def test_a_decode_that_stops_reading_is_dropped_and_delays_no_other_decode():
    """Decode A asks for a 64 MiB room and never reads; decode B, on the same prefill stage,
    must get its room and the stage's heartbeats meanwhile (heartbeat window 0.6 s), and A is
    dropped within the send timeout (1 s)."""
    layers, pages = 4, 128  # 64 KiB pages: a room of 64 MiB, far more than socket buffers
    shape = (layers, pages * PAGE, HEADS, 2 * DIM)
    src = KVTensors(torch.randn(shape), torch.randn(shape), PAGE)
    sender = KVSender(src, 0, release=lambda room, p: None, timing=FAST)
    stalled = ch.connect(sender.endpoint, 5, name="stalled decode")
    receiver = KVReceiver(KVTensors(torch.zeros(shape), torch.zeros(shape), PAGE),
                          release=lambda room, p: None, timing=FAST)
    try:
        stalled.send(m.DecodeHello("stalled", 0, layers, src.page_bytes))
        sender.open_room(1)
        sender.send_pages(1, 0, list(range(pages)), is_last=True)
        stalled.send(m.RoomBootstrap(1, 77, list(range(pages)), 1))
        assert wait_until(lambda: any("stalled" in peer for peer in sender.hellos), 5)
        time.sleep(0.3)  # its sending thread is now blocked on the full socket
        receiver.connect("p", m.PrefillInfo([registration(sender)]))
        start = time.monotonic()
        receiver.expect_room(2, "p", list(range(8)), want_final=False)
        sender.open_room(2)
        sender.send_pages(2, 0, list(range(8)), is_last=True)
        assert receiver.wait_room(2, 10).ok
        # Well past the heartbeat window: the stage's heartbeats kept reaching B.
        while time.monotonic() - start < 2.5:
            assert receiver.connected("p"), "B lost the prefill stage's heartbeats"
            time.sleep(0.05)
        assert not any("stalled" in peer for peer in sender.hellos), "A was not dropped"
    finally:
        receiver.close()
        stalled.close()
        sender.close()


# ------------------------------------------------------------------ accept loops

SERVICE_OUT_OF_FDS = r"""
import logging, os, resource, sys
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from pipefill.disagg.bootstrap import BootstrapServer
service = BootstrapServer(port=0, secret=sys.argv[1].encode())
open_fds = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE,
                   (open_fds + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(service.endpoint.port, flush=True)
sys.stdin.read()
"""


def test_an_accept_loop_survives_running_out_of_file_descriptors():
    """The bootstrap service as its own process with 4 file descriptors to spare: 12 silent
    connections run it out (accept fails with EMFILE); once they are gone it must serve again."""
    proc = subprocess.Popen([sys.executable, "-c", SERVICE_OUT_OF_FDS, SECRET.decode()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        endpoint = m.Endpoint("127.0.0.1", int(proc.stdout.readline()))
        silent = [socket.create_connection((endpoint.host, endpoint.port)) for _ in range(12)]
        time.sleep(1.0)  # the service accepts what it can, then accept() fails
        for s in silent:
            s.close()
        register_stage(endpoint, stage_at(free_port()), timeout_s=20, secret=SECRET)
        assert lookup_prefill(endpoint, 10, SECRET).stages[0].rank == 0
    finally:
        proc.kill()
        err = proc.stderr.read()
        proc.wait()
    accept_errors = [line for line in err.splitlines() if "accept failed" in line]
    assert accept_errors and "Too many open files" in accept_errors[0], err
    assert len(accept_errors) <= 2, err  # rate-limited, however often it retried


def test_connections_over_the_cap_are_closed_at_once_and_threads_stay_bounded():
    service = BootstrapServer(port=0, max_connections=8)
    target = (service.endpoint.host, service.endpoint.port)
    threads_before = threading.active_count()
    try:
        held = [socket.create_connection(target) for _ in range(60)]
        time.sleep(0.5)
        assert threading.active_count() - threads_before <= 8
        served = []
        for s in held:  # the service closed every connection beyond the cap
            s.settimeout(0.05)
            try:
                served.append(s.recv(1) != b"")
            except socket.timeout:
                served.append(True)  # still open: one of the 8 it serves
            except ConnectionResetError:
                served.append(False)
        assert sum(served) == 8
        for s in held:
            s.close()
        register_stage(service.endpoint, stage_at(free_port()), timeout_s=10)
    finally:
        service.close()


# ------------------------------------------------------------------ bootstrap registration

@MODES
def test_a_stranger_cannot_take_over_a_live_stage(secret):
    """With a secret, peers without it or with another one cannot register at all; and even a
    peer with the right one (or anyone, without a secret) cannot replace a stage whose
    endpoint still answers. A restart (the old endpoint gone) is taken."""
    service, sender = sender_with_service(kv_tensors(2, 8, seed=0), secret)
    real = sender.endpoint
    stranger = stage_at(free_port())
    try:
        if secret is not None:
            with pytest.raises(RuntimeError):
                register_stage(service.endpoint, stranger, timeout_s=1)
            with pytest.raises(RuntimeError, match="same --cluster-secret"):
                register_stage(service.endpoint, stranger, timeout_s=1, secret=b"a guess")
        with pytest.raises(RuntimeError, match="still answers"):
            register_stage(service.endpoint, stranger, timeout_s=1, secret=secret)
        assert lookup_prefill(service.endpoint, 5, secret).stages[0].endpoint == real
        sender.close()  # the stage restarts elsewhere
        sender = KVSender(kv_tensors(2, 8, seed=0), 0, release=lambda room, p: None,
                          timing=FAST, secret=secret)
        register_stage(service.endpoint, registration(sender), timeout_s=10, secret=secret)
        assert lookup_prefill(service.endpoint, 5, secret).stages[0].endpoint == \
            sender.endpoint != real
    finally:
        sender.close()
        service.close()


# ------------------------------------------------------------------ floods and the log

@MODES
def test_bad_frames_from_many_connections_log_a_few_lines(secret, caplog):
    """300 connections, one after the other, each with one bad frame (garbage that does not
    decode; with a secret, garbage instead of the handshake): a line or two, not 300."""
    service, sender = sender_with_service(kv_tensors(2, 8, seed=0), secret)
    target = (sender.endpoint.host, sender.endpoint.port)
    # 48 bytes: a whole frame, and as long as the handshake's first frame.
    body = b"\xc1 is no msgpack, and no handshake either".ljust(hs.HELLO_BYTES - 4, b".")
    garbage = struct.pack("!I", len(body)) + body
    throttles = (ch.MESSAGE_DROPS, ch.CONNECTION_REFUSALS)
    reports = sum(t.num_reports for t in throttles)
    caplog.set_level(logging.WARNING)
    try:
        for _ in range(300):
            with socket.create_connection(target) as s:
                s.sendall(garbage)
                s.shutdown(socket.SHUT_WR)
                read_to_eof(s)  # the stage read it and closed its end
        assert sum(t.num_reports for t in throttles) - reports == 300  # each was refused
        lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(lines) <= 2, "\n".join(r.getMessage() for r in lines)
        # ... and the stage still serves a decode.
        receiver = KVReceiver(kv_tensors(2, 8), release=lambda room, p: None, timing=FAST,
                              secret=secret)
        try:
            receiver.connect("p", lookup_prefill(service.endpoint, 5, secret))
            receiver.expect_room(3, "p", [0, 1], want_final=False)
            sender.open_room(3)
            sender.send_pages(3, 0, [4, 5], is_last=True)
            assert receiver.wait_room(3, 10).ok
        finally:
            receiver.close()
    finally:
        sender.close()
        service.close()
