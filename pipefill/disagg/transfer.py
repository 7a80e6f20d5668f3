"""KV transfer between a prefill stage (KVSender) and a decode stage (KVReceiver).

One TCP control connection per (decode stage, prefill stage) pair, opened by the decode,
carries every message of both directions (messages.py) and, with the `tcp` data path, the page
bytes after each KVChunk header. The sender's work runs on background threads: `send_pages`
only queues. The receiver writes straight into pre-allocated pages of its KV tensors, tracks
each room (rooms.py), and `wait_room` returns when the room is ready or failed. A dead peer is
found by a socket error at once, or by missing heartbeats within interval * max_misses.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import torch

from pipefill.disagg import channel as ch
from pipefill.disagg import messages as m
from pipefill.disagg.rooms import DecodeRooms, Item, Liveness, PrefillRooms, RoomResult

log = logging.getLogger(__name__)

BACKENDS = ("tcp", "mooncake")


@dataclass
class KVTensors:
    """One stage's KV cache, global layers [layer_start, layer_start + num_layers): k and v are
    [num_layers_here, ...] with one page of one layer contiguous: token-major [layers,
    num_pages * page_size, kv_heads, head_dim] (KVCache) or AMX-packed [layers, num_pages,
    kv_heads, page_size, head_dim] (AmxKVCache). Pages move as opaque bytes, so both ends must
    use the same layout (checked at bootstrap)."""
    k: torch.Tensor
    v: torch.Tensor
    page_size: int
    layer_start: int = 0
    num_pages: int = 0  # 0: k.shape[1] // page_size (token-major)
    layout: str = "token-major"

    def __post_init__(self):
        assert self.k.shape == self.v.shape and self.k.is_contiguous() and self.v.is_contiguous()
        if not self.num_pages:
            self.num_pages = self.k.shape[1] // self.page_size
        self._bytes = {}

    @staticmethod
    def from_cache(cache, layer_start: int) -> "KVTensors":
        """A stage's KVCache or AmxKVCache."""
        layout = "amx-packed" if cache.k.dim() == 5 else "token-major"
        return KVTensors(cache.k, cache.v, cache.page_size, layer_start, cache.num_pages, layout)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def layer_end(self) -> int:
        return self.layer_start + self.num_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def page_elems(self) -> int:
        return self.k[0].numel() // self.num_pages

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.k.element_size()

    def local(self, t: torch.Tensor, layer: int) -> torch.Tensor:
        return t[layer - self.layer_start]

    def pages(self, t: torch.Tensor, layer: int) -> torch.Tensor:
        """[num_pages, page_elems] view of one layer of k or v."""
        return self.local(t, layer).view(self.num_pages, self.page_elems)

    def byte_view(self, t: torch.Tensor, layer: int) -> memoryview:
        key = (t is self.k, layer)
        if key not in self._bytes:
            flat = self.local(t, layer).reshape(-1).view(torch.uint8)
            self._bytes[key] = memoryview(flat.numpy())
        return self._bytes[key]


def make_data_path(backend: str, kv: KVTensors, host: str):
    if backend == "tcp":
        from pipefill.disagg.transfer_tcp import TcpDataPath
        return TcpDataPath(kv)
    if backend == "mooncake":
        from pipefill.disagg.transfer_mooncake import MooncakeDataPath
        return MooncakeDataPath(kv, host)
    raise ValueError(f"--disaggregation-transfer-backend {backend!r}: one of {BACKENDS}")


@dataclass(frozen=True)
class Timing:
    bootstrap_timeout_s: float = 120.0
    waiting_timeout_s: float = 300.0
    heartbeat_interval_s: float = 2.0
    heartbeat_max_misses: int = 3

    @staticmethod
    def from_args(args) -> "Timing":
        """From ServerArgs' --disaggregation-* flags."""
        return Timing(args.disaggregation_bootstrap_timeout, args.disaggregation_waiting_timeout,
                      args.disaggregation_heartbeat_interval,
                      args.disaggregation_heartbeat_max_misses)


class _Peers:
    """Channels by peer name, a Liveness for them, and the loop that reads each."""

    def __init__(self, timing: Timing, clock):
        self.timing, self.clock = timing, clock
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.conns: dict[str, ch.Channel] = {}
        self.liveness = Liveness(timing.heartbeat_interval_s, timing.heartbeat_max_misses)
        self.stopped = threading.Event()

    def send(self, notices, on_dead: Callable[[str], None]) -> None:
        for peer, msg in notices:
            conn = self.conns.get(peer)
            if conn is None:
                continue
            try:
                conn.send(msg)
            except ch.ConnectionClosed:
                on_dead(peer)

    def run_ticker(self, tick: Callable[[float], None]) -> None:
        period = min(0.5, self.timing.heartbeat_interval_s / 2)
        while not self.stopped.wait(period):
            tick(self.clock())


class KVSender:
    """Prefill stage side. `release(room, pages)` gets back every page given to send_pages."""

    def __init__(self, kv: KVTensors, rank: int, *, release: Callable[[int, list[int]], None],
                 backend: str = "tcp", host: str = "127.0.0.1", port: int = 0,
                 timing: Timing = Timing(), secret: bytes | None = None, clock=time.monotonic):
        self.kv, self.rank, self.secret = kv, rank, secret
        self.name = f"prefill-{rank}-{os.getpid()}"
        self.data = make_data_path(backend, kv, host)
        self._p = _Peers(timing, clock)
        self.rooms = PrefillRooms(rank, timing.bootstrap_timeout_s, release)
        self.hellos: dict[str, m.DecodeHello] = {}
        self._queue: queue.Queue = queue.Queue()  # Items from the caller
        self._outboxes: dict[str, queue.Queue] = {}  # per decode: (item, dest) to send, in order
        self._listener = ch.listen(host, port)
        self.endpoint = m.Endpoint(host, self._listener.getsockname()[1])
        self.bytes_sent = 0
        self._last_heartbeat = -float("inf")
        for target, name in ((self._accept, "accept"), (self._dispatch, "dispatch"),
                             (lambda: self._p.run_ticker(self._tick), "tick")):
            threading.Thread(target=target, name=f"pd-{name}-{rank}", daemon=True).start()

    def registration(self, *, pp_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                     model_fingerprint: str) -> m.RegisterStage:
        from pipefill.runtime.platform import dtype_name
        return m.RegisterStage(self.rank, pp_size, self.kv.layer_start, self.kv.layer_end,
                               num_layers, self.endpoint, self.kv.page_size,
                               dtype_name(self.kv.dtype), num_kv_heads, head_dim,
                               model_fingerprint, self.data.name, self.kv.layout)

    # ---- the caller's side: never blocks on the network
    def open_room(self, room: int, sends_final: bool = False) -> None:
        with self._p.lock:
            self.rooms.open(room, self._p.clock(), sends_final)

    def send_pages(self, room: int, page_offset: int, src_pages: list[int],
                   is_last: bool = False) -> None:
        """Queues the request's pages [page_offset, page_offset + len(src_pages)) of this
        stage's layers (whole pages; the partial last page goes with is_last)."""
        self._queue.put(Item(room, page_offset, page_offset, list(src_pages), is_last))

    def send_final(self, room: int, final: m.FinalMeta) -> None:
        self._queue.put(Item(room, final=final))

    def fail_room(self, room: int, reason: str) -> None:
        with self._p.lock:
            notices = self.rooms.fail(room, reason)
        self._p.send(notices, self._peer_dead)

    def close(self) -> None:
        """Fails every live room (its decodes hear why, its pages are released), then stops."""
        with self._p.lock:
            notices = [n for room in list(self.rooms.live)
                       for n in self.rooms.fail(room, "the prefill stage is shutting down")]
        self._p.send(notices, lambda peer: None)
        self._p.stopped.set()
        self._queue.put(None)
        self._listener.close()
        with self._p.lock:
            for conn in self._p.conns.values():
                conn.close()
            for box in self._outboxes.values():
                box.put(None)

    # ---- threads
    def _accept(self) -> None:
        while not self._p.stopped.is_set():
            conn = ch.accept(self._listener, self.secret)
            if conn is None:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: ch.Channel) -> None:
        peer = None
        try:
            hello = conn.recv()
            if not isinstance(hello, m.DecodeHello):
                conn.drops.drop(f"expected DecodeHello, got {type(hello).__name__}")
                return
            if hello.page_bytes != self.kv.page_bytes:
                log.error("decode %s has %d-byte pages, this stage %d: refused", hello.decode_id,
                          hello.page_bytes, self.kv.page_bytes)
                return
            peer = hello.decode_id
            with self._p.lock:
                self._p.conns[peer], self.hellos[peer] = conn, hello
                self._p.liveness.seen(peer, self._p.clock())
                # One sending thread per decode: a slow or stalled decode delays only itself.
                box = self._outboxes[peer] = queue.Queue()
                threading.Thread(target=self._send_loop, args=(box,), daemon=True,
                                 name=f"pd-send-{self.rank}").start()
            while True:
                self._on_message(peer, conn.recv())
        except ch.ConnectionClosed:
            pass
        finally:
            conn.close()
            if peer is not None and self._p.conns.get(peer) is conn:
                self._peer_dead(peer)

    def _on_message(self, peer: str, msg) -> None:
        now = self._p.clock()
        with self._p.lock:
            self._p.liveness.seen(peer, now)
            if isinstance(msg, m.RoomBootstrap):
                work, notices = self.rooms.on_bootstrap(peer, msg, now)
                self._route(work)
            elif isinstance(msg, m.DropRoom):
                notices = self.rooms.on_drop(peer, msg)
            elif isinstance(msg, m.Heartbeat):
                return
            else:
                self._p.conns[peer].drops.drop(f"{type(msg).__name__} is not for a prefill stage")
                return
        self._p.send(notices, self._peer_dead)

    def _dispatch(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._p.lock:
                self._route(self.rooms.add(item, self._p.clock()))

    def _route(self, work) -> None:
        """Hands (item, dest) pairs to their decode's sending thread (under the lock)."""
        for item, dest in work:
            box = self._outboxes.get(dest.peer)
            if box is not None:
                box.put((item, dest))
            else:  # the decode is gone: its rooms are failing, nothing to send
                log.debug("room %d: no connection to %s", item.room, dest.peer)

    def _send_loop(self, box: queue.Queue) -> None:
        while True:
            entry = box.get()
            if entry is None:
                return
            self._send_one(*entry)

    def _send_one(self, item: Item, dest) -> None:
        with self._p.lock:
            if not self.rooms.begin_send(item.room):
                return  # failed or dropped meanwhile: its pages are already released
            conn, hello = self._p.conns.get(dest.peer), self.hellos.get(dest.peer)
        ok, dead = False, False
        try:
            if conn is None:
                raise ch.ConnectionClosed(f"decode {dest.peer} is gone")
            if item.final is not None:
                conn.send(msgspec.structs.replace(item.final, room=item.room, nonce=dest.nonce))
            else:
                self._send_chunk(conn, item, dest, hello)
            ok = True
        except ch.ConnectionClosed:
            dead = True
        except Exception as e:  # a failed write: the decode must hear it, not wait for it
            log.warning("room %d: sending to %s failed: %s", item.room, dest.peer, e)
            self.fail_room(item.room, f"sending its KV failed: {e}")
        with self._p.lock:
            notices = self.rooms.end_send(item, dest.peer, ok)
        if dead:
            self._peer_dead(dest.peer)
        self._p.send(notices, self._peer_dead)

    def _send_chunk(self, conn, item: Item, dest, hello: m.DecodeHello) -> None:
        ls = max(self.kv.layer_start, hello.layer_start)
        le = min(self.kv.layer_end, hello.layer_end)
        n, end = len(item.src_pages), item.page_offset + len(item.src_pages)
        if end > len(dest.dst_pages):
            raise ValueError(f"the request has more pages here ({end}) than the decode "
                             f"allocated ({len(dest.dst_pages)})")
        nbytes = self.data.payload_bytes(n, le - ls)
        header = m.KVChunk(item.room, dest.nonce, self.rank, item.chunk_id, item.page_offset, n,
                           ls, le, nbytes, item.is_last)
        self.data.send(conn, header, item.src_pages, dest.dst_pages[item.page_offset:end], hello)
        self.bytes_sent += 2 * n * (le - ls) * self.kv.page_bytes

    def _peer_dead(self, peer: str) -> None:
        with self._p.lock:
            conn = self._p.conns.pop(peer, None)
            self.hellos.pop(peer, None)
            box = self._outboxes.pop(peer, None)
            if box is not None:
                box.put(None)
            self._p.liveness.forget(peer)
            notices = self.rooms.on_peer_dead(peer)
        if conn is not None:
            conn.close()
        self._p.send(notices, lambda p: None)

    def _tick(self, now: float) -> None:
        with self._p.lock:
            notices = self.rooms.tick(now)
            dead = self._p.liveness.dead(now)
            beat = now - self._last_heartbeat >= self._p.timing.heartbeat_interval_s
            if beat:
                self._last_heartbeat = now
                hb = m.Heartbeat(self.name, self.rooms.heartbeat_rooms())
                notices += [(peer, hb) for peer in self._p.conns]
        for peer in dead:
            log.warning("decode %s missed its heartbeats: dropping its rooms", peer)
            self._peer_dead(peer)
        self._p.send(notices, self._peer_dead)


class KVReceiver:
    """Decode stage side. `release(room, pages)` gets back the pages of every room that does not
    succeed; on success they belong to the caller (RoomResult.pages)."""

    def __init__(self, kv: KVTensors, *, release: Callable[[int, list[int]], None],
                 backend: str = "tcp", host: str = "127.0.0.1", timing: Timing = Timing(),
                 secret: bytes | None = None, clock=time.monotonic):
        self.kv, self.secret = kv, secret
        self.name = f"decode-{kv.layer_start}-{os.getpid()}-{os.urandom(3).hex()}"
        self.data = make_data_path(backend, kv, host)
        self._p = _Peers(timing, clock)
        self.rooms = DecodeRooms(timing.waiting_timeout_s, release, self.data.one_sided,
                                 drain_grace_s=timing.heartbeat_interval_s *
                                 timing.heartbeat_max_misses)
        self.prefills: dict[str, dict[str, tuple[int, int]]] = {}  # key -> stage -> layers
        self._expected: dict[str, dict[str, int]] = {}
        self._last_heartbeat = -float("inf")
        threading.Thread(target=lambda: self._p.run_ticker(self._tick), name="pd-tick",
                         daemon=True).start()

    def connect(self, key: str, info: m.PrefillInfo, timeout_s: float = 10.0,
                decode_layer_ranges: list[tuple[int, int]] | None = None) -> None:
        """Opens a connection to every stage of prefill `key` (e.g. its bootstrap host:port)
        whose layers overlap this stage's; decode_layer_ranges: the whole decode pipeline's.
        Stages still connected are kept: calling it again reconnects only the lost ones."""
        ranges = decode_layer_ranges or [(self.kv.layer_start, self.kv.layer_end)]
        hello = m.DecodeHello(self.name, self.kv.layer_start, self.kv.layer_end,
                              self.kv.page_bytes, **self.data.hello_fields())
        stages, expected = {}, {}
        for s in info.stages:
            ls, le = max(s.layer_start, self.kv.layer_start), min(s.layer_end, self.kv.layer_end)
            if ls >= le:
                continue
            stage = f"{key}/{s.rank}"
            stages[stage] = (ls, le)
            expected[stage] = sum(1 for a, b in ranges if max(a, s.layer_start) <
                                  min(b, s.layer_end))
            if stage in self._p.conns:
                continue
            conn = ch.connect(s.endpoint, timeout_s, self.secret, name=f"prefill {stage}")
            conn.send(hello)
            with self._p.lock:
                self._p.conns[stage] = conn
                self._p.liveness.seen(stage, self._p.clock())
                self.rooms.on_stage_alive(stage)
            threading.Thread(target=self._read, args=(stage, conn), daemon=True).start()
        self.prefills[key], self._expected[key] = stages, expected

    def connected(self, key: str) -> bool:
        stages = self.prefills.get(key)
        return bool(stages) and all(s in self._p.conns for s in stages)

    def expect_room(self, room: int, key: str, dst_pages: list[int], *,
                    num_prompt_tokens: int | None = None, want_final: bool = True) -> int:
        """Asks every stage of prefill `key` for the room's KV into dst_pages; the nonce."""
        if not self.connected(key):
            raise RuntimeError(f"not connected to every stage of prefill {key}: connect() "
                               "first (again after a stage was lost)")
        nonce = int.from_bytes(os.urandom(8), "little") >> 1
        stages = self.prefills[key]
        with self._p.lock:
            self.rooms.expect(room, nonce, dst_pages, stages, self._p.clock(), want_final,
                              num_prompt_tokens)
        notices = [(st, m.RoomBootstrap(room, nonce, list(dst_pages), self._expected[key][st]))
                   for st in stages]
        self._p.send(notices, self._stage_dead)
        return nonce

    def wait_room(self, room: int, timeout_s: float | None = None) -> RoomResult | None:
        """The room's result once it is ready or failed; None if timeout_s passed first."""
        with self._p.changed:
            self._p.changed.wait_for(lambda: self.rooms.result(room) is not None, timeout_s)
            return self.rooms.take_result(room)

    def take_finished(self) -> list[RoomResult]:
        """Every room that ended since the last call (for a loop that polls, never waits)."""
        with self._p.lock:
            rooms = list(self.rooms.results)
            return [self.rooms.take_result(room) for room in rooms]

    def progress(self, room: int) -> dict[str, int] | None:
        """Pages delivered so far per prefill stage (None once the room ended)."""
        with self._p.lock:
            r = self.rooms.live.get(room)
            return None if r is None else {s: len(r.delivered.get(s, ())) for s in r.stages}

    def drop_room(self, room: int, reason: str = "aborted") -> None:
        with self._p.lock:
            notices = self.rooms.abort(room, reason, self._p.clock())
            self._p.changed.notify_all()
        self._p.send(notices, self._stage_dead)

    def close(self) -> None:
        """Aborts every waiting room (the prefill stages are told to drop them), then stops."""
        with self._p.lock:
            now = self._p.clock()
            notices = [n for room in list(self.rooms.live)
                       for n in self.rooms.abort(room, "the decode is shutting down", now)]
            self._p.changed.notify_all()
        self._p.send(notices, lambda stage: None)
        self._p.stopped.set()
        with self._p.lock:
            for conn in self._p.conns.values():
                conn.close()

    def _read(self, stage: str, conn: ch.Channel) -> None:
        try:
            while True:
                msg = conn.recv()
                with self._p.lock:
                    self._p.liveness.seen(stage, self._p.clock())
                if isinstance(msg, m.KVChunk):
                    self._on_chunk(stage, conn, msg)
                else:
                    self._on_control(stage, msg)
        except ch.ConnectionClosed:
            pass
        finally:
            conn.close()
            if not self._p.stopped.is_set():
                self._stage_dead(stage, conn)

    def _on_chunk(self, stage: str, conn: ch.Channel, msg: m.KVChunk) -> None:
        with self._p.lock:
            dst = self.rooms.begin_chunk(stage, msg)
        expected = self.data.payload_bytes(msg.num_pages, msg.layer_end - msg.layer_start)
        if msg.nbytes != expected and dst is not None:
            with self._p.lock:
                self.rooms.end_chunk(stage, msg, self._p.clock(), ok=False)
            raise ch.ConnectionClosed(f"{stage}: a chunk announced {msg.nbytes} bytes, its "
                                      f"pages are {expected}")
        ok = False
        try:
            if dst is None:
                _skip(conn, msg.nbytes)
            else:
                self.data.receive(conn, msg, dst)
                ok = True
        finally:
            if dst is not None:
                with self._p.lock:
                    self.rooms.end_chunk(stage, msg, self._p.clock(), ok=ok)
                    self._p.changed.notify_all()

    def _on_control(self, stage: str, msg) -> None:
        now, notices = self._p.clock(), []
        with self._p.lock:
            if isinstance(msg, m.FinalMeta):
                notices = self.rooms.on_final(stage, msg, now)
            elif isinstance(msg, m.RoomFailed):
                notices = self.rooms.on_failed(stage, msg, now)
            elif isinstance(msg, m.DropAck):
                self.rooms.on_drop_ack(stage, msg, now)
            elif isinstance(msg, m.Heartbeat):
                self.rooms.on_heartbeat(stage, msg.rooms, now)
            else:
                self._p.conns[stage].drops.drop(f"{type(msg).__name__} is not for a decode")
            self._p.changed.notify_all()
        self._p.send(notices, self._stage_dead)

    def _stage_dead(self, stage: str, conn: ch.Channel | None = None) -> None:
        with self._p.lock:
            if conn is not None and self._p.conns.get(stage) not in (conn, None):
                return  # an old connection of a stage since reconnected
            conn = self._p.conns.pop(stage, None)
            self._p.liveness.forget(stage)
            notices = self.rooms.on_stage_dead(stage, self._p.clock())
            self._p.changed.notify_all()
        if conn is not None:
            conn.close()
        self._p.send(notices, lambda s: None)

    def _tick(self, now: float) -> None:
        with self._p.lock:
            notices = self.rooms.tick(now)
            dead = self._p.liveness.dead(now)
            if now - self._last_heartbeat >= self._p.timing.heartbeat_interval_s:
                self._last_heartbeat = now
                notices += [(st, m.Heartbeat(self.name)) for st in self._p.conns]
            self._p.changed.notify_all()
        for stage in dead:
            log.warning("prefill stage %s missed its heartbeats: failing its rooms", stage)
            self._stage_dead(stage)
        self._p.send(notices, self._stage_dead)


def _skip(conn: ch.Channel, nbytes: int) -> None:
    """Reads and discards the page bytes of a dropped chunk, keeping the stream in step."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    left = nbytes
    while left:
        k = min(left, len(scratch))
        conn.recv_into(scratch[:k])
        left -= k
