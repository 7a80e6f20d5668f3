"""KVReceiver: the decode stage's side of the KV transfer (see transfer.py).

One reader thread per prefill stage connection (at most channel.MAX_CONNECTIONS) writes page
bytes straight into the KV tensors (tcp; with a cluster secret, a chunk counts only once its
bytes passed their MAC) or takes the notices of one-sided writes (mooncake); a writer thread
per connection sends the control messages; a ticker thread runs the waiting timeouts and
heartbeats."""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from pipefill.disagg import channel as ch
from pipefill.disagg import messages as m
from pipefill.disagg.decode_rooms import DecodeRooms, RoomResult
from pipefill.disagg.transfer import KVTensors, Peers, StageTensors, Timing, make_data_path

log = logging.getLogger(__name__)

CLOSE_FLUSH_S = 2.0  # on close, how long the prefill stages' connections may take to hear why


class KVReceiver:
    """Decode stage side. `release(room, pages)` gets back the pages of every room that does not
    succeed; on success they belong to the caller (RoomResult.pages)."""

    def __init__(self, kv: KVTensors | StageTensors, *, release: Callable[[int, list[int]], None],
                 backend: str = "tcp", host: str = "127.0.0.1", timing: Timing = Timing(),
                 secret: bytes | None = None, clock=time.monotonic,
                 staging_bytes: int | None = None):
        # A TP stage's ranks' KV: each rank's pages take exactly its heads (ARCHITECTURE.md,
        # 'KV heads across TP sizes').
        self.kv, self.secret = StageTensors.of(kv), secret
        self.name = f"decode-{kv.layer_start}-{os.getpid()}-{os.urandom(3).hex()}"
        self.data = make_data_path(backend, self.kv, host, staging_bytes)
        self._p = Peers(timing, clock)

        def released(room: int, pages: list[int]) -> None:
            self._free_staging(room)  # with the pages: no write into either can still happen
            release(room, pages)
        self.rooms = DecodeRooms(timing.waiting_timeout_s, released, self.data.one_sided,
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
        Stages still connected are kept: calling it again reconnects only the lost ones.
        timeout_s bounds each TCP connect. Runs on any thread (a decode connects on worker
        threads while its loop asks for rooms of prefills already connected)."""
        ranges = decode_layer_ranges or [(self.kv.layer_start, self.kv.layer_end)]
        hello = m.DecodeHello(self.name, self.kv.layer_start, self.kv.layer_end,
                              self.kv.page_bytes, **self.data.hello_fields(),
                              kv_heads=self.kv.head_map, num_kv_heads=self.kv.num_kv_heads,
                              window_layers=self.kv.window_layers())
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
            if len(self._p.conns) >= ch.MAX_CONNECTIONS:
                raise RuntimeError(f"this decode stage already has {len(self._p.conns)} prefill "
                                   "connections, the most it keeps")
            conn = ch.connect(s.endpoint, timeout_s, self.secret, name=f"prefill {stage}",
                              send_timeout_s=self._p.timing.send_timeout_s)
            conn.send(hello)
            with self._p.lock:
                self._p.conns[stage] = conn
                self._p.liveness.seen(stage, self._p.clock())
                self.rooms.on_stage_alive(stage)
            threading.Thread(target=self._read, args=(stage, conn), daemon=True).start()
        with self._p.lock:  # a room asked for meanwhile sees both maps of one connect
            self.prefills[key], self._expected[key] = stages, expected

    def connected(self, key: str) -> bool:
        with self._p.lock:
            stages = self.prefills.get(key)
            return bool(stages) and all(s in self._p.conns for s in stages)

    def expect_room(self, room: int, key: str, dst_pages: list[int], *,
                    num_prompt_tokens: int | None = None, want_final: bool = True,
                    dst_window: list[int] = ()) -> int:
        """Asks every stage of prefill `key` for the room's KV into dst_pages (and its window
        layers' into dst_window, one entry a page, -1: none); the nonce."""
        if not self.connected(key):
            raise RuntimeError(f"not connected to every stage of prefill {key}: connect() "
                               "first (again after a stage was lost)")
        nonce = int.from_bytes(os.urandom(8), "little") >> 1
        with self._p.lock:
            stages, expected = self.prefills[key], self._expected[key]
            self.rooms.expect(room, nonce, dst_pages, stages, self._p.clock(), want_final,
                              num_prompt_tokens, dst_window)
            # One-sided writes into fragmented pages go through a staging region per stage.
            staging = self.data.plan_room(room, nonce, stages, dst_pages) \
                if self.data.one_sided else {}
        notices = [(st, m.RoomBootstrap(room, nonce, list(dst_pages), expected[st],
                                        staging.get(st, 0), list(dst_window)))
                   for st in stages]
        self._p.send(notices)
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

    def wait_finished(self, timeout_s: float, wake=lambda: False) -> list[RoomResult]:
        """Like take_finished, but waits up to timeout_s for a room to end (or for `wake()`,
        checked under the receiver's lock whenever its state changes, to turn true)."""
        with self._p.changed:
            self._p.changed.wait_for(lambda: bool(self.rooms.results) or wake(), timeout_s)
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
        self._p.send(notices)

    def close(self) -> None:
        """Aborts every waiting room (the prefill stages are told to drop them), then stops."""
        with self._p.lock:
            now = self._p.clock()
            notices = [n for room in list(self.rooms.live)
                       for n in self.rooms.abort(room, "the decode is shutting down", now)]
            self._p.changed.notify_all()
        self._p.send(notices)
        self._p.flush(CLOSE_FLUSH_S)
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
            window_dst, why = self.rooms.window_dst(msg) if dst is not None else ([], None)
            if why is not None:  # the room fails with the sentence; the stream stays in step
                self.rooms.end_chunk(stage, msg, self._p.clock(), ok=False)
                notices, dst = self.rooms.abort(msg.room, why, self._p.clock()), None
                self._p.changed.notify_all()
        if why is not None:
            log.warning("room %d from %s: %s", msg.room, stage, why)
            self._p.send(notices)
        expected = self._payload_bytes(msg)
        if msg.nbytes != expected and dst is not None:
            with self._p.lock:
                self.rooms.end_chunk(stage, msg, self._p.clock(), ok=False)
            raise ch.ConnectionClosed(f"{stage}: a chunk announced {msg.nbytes} bytes, its "
                                      f"pages are {expected}")
        ok, notices = False, []
        try:
            if dst is None:
                _skip(conn, msg.nbytes)
            elif window_dst:
                self.data.receive(conn, msg, dst, window_dst)
                ok = True
            else:
                self.data.receive(conn, msg, dst)
                ok = True
        except ch.PayloadTampered as e:
            with self._p.lock:  # the room hears why; the closed connection fails the rest
                notices = self.rooms.abort(msg.room, str(e), self._p.clock())
            raise
        finally:
            if dst is not None:
                with self._p.lock:
                    self.rooms.end_chunk(stage, msg, self._p.clock(), ok=ok)
                    self._free_staging(msg.room)
                    self._p.changed.notify_all()
            self._p.send(notices)

    def _payload_bytes(self, msg: m.KVChunk) -> int:
        """The bytes a chunk's pages take here: its layers', and the window layers' of the
        window pages it names."""
        ls, le = msg.layer_start, msg.layer_end
        window = self.kv.window
        num_window = len(window.layers_in(ls, le)) if window is not None else 0
        return self.data.payload_bytes(msg.num_pages, len(self.kv.layers_in(ls, le))) + \
            self.data.payload_bytes(len(msg.window_pages), num_window)

    def _on_control(self, stage: str, msg) -> None:
        now, notices = self._p.clock(), []
        with self._p.lock:
            if isinstance(msg, m.FinalMeta):
                notices = self.rooms.on_final(stage, msg, now)
                self._free_staging(msg.room)
            elif isinstance(msg, m.RoomFailed):
                notices = self.rooms.on_failed(stage, msg, now)
            elif isinstance(msg, m.DropAck):
                self.rooms.on_drop_ack(stage, msg, now)
            elif isinstance(msg, m.Heartbeat):
                self.rooms.on_heartbeat(stage, msg.rooms, now)
            else:
                self._p.conns[stage].drops.drop(f"{type(msg).__name__} is not for a decode")
            self._p.changed.notify_all()
        self._p.send(notices)

    def _free_staging(self, room: int) -> None:
        """Frees a room's staging regions once it left `live` (ready, or failed and released);
        under the lock."""
        if self.data.one_sided and room not in self.rooms.live:
            self.data.end_room(room)

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
        self._p.send(notices)

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
        self._p.send(notices)


def _skip(conn: ch.Channel, nbytes: int) -> None:
    """Reads and discards the page bytes of a dropped chunk (checking their MAC), keeping the
    stream in step."""
    if nbytes:
        conn.recv_payload(_scratch_views(nbytes))


def _scratch_views(nbytes: int):
    scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
    for at in range(0, nbytes, len(scratch)):
        yield scratch[:min(len(scratch), nbytes - at)]
