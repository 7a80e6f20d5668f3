"""KVSender: the prefill stage's side of the KV transfer (see transfer.py).

Threads: one accepts decode connections (channel.Listener: at most MAX_CONNECTIONS, each
authenticated with the cluster secret), one reads each of them (bootstraps, drops, heartbeats;
on the prefill HTTP server's own connection, the rooms it refused), one dispatches the caller's
queued items to the rooms, one sends the chunks per decode and one writes the control messages
per decode (a stalled decode delays only itself, and is dropped after the send timeout), and one
ticks timeouts and heartbeats."""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from typing import Callable

import msgspec

from pipefill.disagg import channel as ch
from pipefill.disagg import messages as m
from pipefill.disagg.prefill_rooms import Item, PrefillRooms
from pipefill.disagg.heads import check_pairing, head_map_of
from pipefill.disagg.transfer import KVTensors, Peers, StageTensors, Timing, make_data_path

log = logging.getLogger(__name__)

CLOSE_FLUSH_S = 2.0  # on close, how long the decodes' connections may take to hear why

# A RoomBootstrap may name at most this many times the stage's own pool of pages (a request
# here holds its whole prompt in the pool; the decode adds a page or so of headroom).
ROOM_PAGES_PER_POOL = 2


class KVSender:
    """Prefill stage side. `release(room, pages)` gets back every page given to send_pages.

    A decode is known by its connection (its DecodeHello's id plus a number per connection):
    another connection cannot take over its name, its rooms, or where its KV goes."""

    def __init__(self, kv: KVTensors | StageTensors, rank: int, *,
                 release: Callable[[int, list[int]], None], backend: str = "tcp",
                 host: str = "127.0.0.1", port: int = 0,
                 timing: Timing = Timing(), secret: bytes | None = None, clock=time.monotonic):
        # A TP stage's ranks' KV, each with its heads (ARCHITECTURE.md, 'KV heads across TP
        # sizes'): every chunk gives each decode rank exactly its heads.
        self.kv, self.rank, self.secret = StageTensors.of(kv), rank, secret
        self.name = f"prefill-{rank}-{os.getpid()}"
        self.data = make_data_path(backend, self.kv, host)
        self._p = Peers(timing, clock)
        self.rooms = PrefillRooms(rank, timing.bootstrap_timeout_s, release,
                                  claim_timeout_s=timing.claim_timeout_s,
                                  max_room_pages=ROOM_PAGES_PER_POOL * kv.num_pages,
                                  windowed=self.kv.window is not None)
        self._conn_ids = itertools.count(1)
        self.hellos: dict[str, m.DecodeHello] = {}
        self.head_maps: dict[str, list[list[int]]] = {}  # per decode: its ranks' KV heads
        self._queue: queue.Queue = queue.Queue()  # Items from the caller
        self._outboxes: dict[str, queue.Queue] = {}  # per decode: (item, dest) to send, in order
        self.bytes_sent = 0
        self.pages_sent = self.window_pages_sent = 0  # pages of the global / window layers
        self._last_heartbeat = -float("inf")
        for target, name in ((self._dispatch, "dispatch"),
                             (lambda: self._p.run_ticker(self._tick), "tick")):
            threading.Thread(target=target, name=f"pd-{name}-{rank}", daemon=True).start()
        self._listener = ch.Listener(host, port, self._read, secret=secret,
                                     name=f"prefill stage {rank}",
                                     send_timeout_s=timing.send_timeout_s)
        self.endpoint = m.Endpoint(host, self._listener.port)

    def registration(self, *, pp_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                     model_fingerprint: str, kv_latent: list[int] | None = None
                     ) -> m.RegisterStage:
        from pipefill.base.platform import dtype_name
        return m.RegisterStage(self.rank, pp_size, self.kv.layer_start, self.kv.layer_end,
                               num_layers, self.endpoint, self.kv.page_size,
                               dtype_name(self.kv.dtype), num_kv_heads, head_dim,
                               model_fingerprint, self.data.name, self.kv.layout,
                               kv_latent or [], self.kv.head_map, self.kv.window_layers())

    # ---- the caller's side: never blocks on the network
    def open_room(self, room: int, sends_final: bool = False) -> None:
        with self._p.lock:
            self.rooms.open(room, self._p.clock(), sends_final)

    def send_pages(self, room: int, page_offset: int, src_pages: list[int],
                   is_last: bool = False, window_table: list[int] | None = None) -> None:
        """Queues the request's pages [page_offset, page_offset + len(src_pages)) of this
        stage's layers (whole pages; the partial last page goes with is_last). window_table:
        with is_last, where the window layers keep pages of their own, the request's window
        table at the end of its prefill (-1 where freed): the pages the decode's table names
        cross with this last chunk (ARCHITECTURE.md, 'Window pages')."""
        self._queue.put(Item(room, page_offset, page_offset, list(src_pages), is_last,
                             window_src=None if window_table is None else list(window_table)))

    def send_final(self, room: int, final: m.FinalMeta) -> None:
        self._queue.put(Item(room, final=final))

    def fail_room(self, room: int, reason: str) -> None:
        with self._p.lock:
            notices = self.rooms.fail(room, reason)
        self._p.send(notices)

    def reject_room(self, room: int, status: int, reason: str) -> None:
        """The HTTP server refused the room's request: its decodes answer status at once."""
        with self._p.lock:
            notices = self.rooms.reject(room, status, reason, self._p.clock())
        self._p.send(notices)

    def close(self) -> None:
        """Fails every live room (its decodes hear why, its pages are released), then stops."""
        with self._p.lock:
            notices = [n for room in list(self.rooms.live)
                       for n in self.rooms.fail(room, "the prefill stage is shutting down")]
        self._p.send(notices)
        self._p.flush(CLOSE_FLUSH_S)
        self._p.stopped.set()
        self._queue.put(None)
        self._listener.close()
        with self._p.lock:
            for conn in self._p.conns.values():
                conn.close()
            for box in self._outboxes.values():
                box.put(None)

    # ---- threads
    def _read(self, conn: ch.Channel) -> None:
        """A decode's connection, on the listener's thread for it."""
        peer = None
        try:
            hello = conn.recv()
            if isinstance(hello, m.RejectRoom):
                self._serve_refusals(conn, hello)
                return
            if not isinstance(hello, m.DecodeHello):
                conn.drops.drop(f"expected DecodeHello, got {type(hello).__name__}")
                return
            if hello.page_bytes != self.kv.page_bytes:
                log.error("decode %s has %d-byte pages, this stage %d: refused", hello.decode_id,
                          hello.page_bytes, self.kv.page_bytes)
                return
            why = self._check_heads(hello) or self._check_windows(hello) or \
                self.data.check_hello(hello)
            if why is not None:
                log.error("decode %s refused: %s", hello.decode_id, why)
                return
            peer = f"{hello.decode_id}#{next(self._conn_ids)}"
            with self._p.lock:
                self._p.conns[peer], self.hellos[peer] = conn, hello
                self.head_maps[peer] = self._head_map(hello)
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

    def _head_map(self, hello: m.DecodeHello) -> list[list[int]]:
        return head_map_of(hello.kv_heads, self.kv.num_kv_heads)

    def _check_heads(self, hello: m.DecodeHello) -> str | None:
        """Why this stage cannot give the decode's TP ranks their KV heads, or None."""
        try:
            check_pairing(self.kv.head_map, self._head_map(hello), self.kv.num_kv_heads,
                          hello.num_kv_heads or None)
        except ValueError as e:
            return str(e)
        return None

    def _check_windows(self, hello: m.DecodeHello) -> str | None:
        """Why the decode's window layers (those whose KV lives in window pages) differ from
        this stage's where their layers meet, or None."""
        lo = max(self.kv.layer_start, hello.layer_start)
        hi = min(self.kv.layer_end, hello.layer_end)
        mine = [i for i in self.kv.window_layers() if lo <= i < hi]
        theirs = [i for i in hello.window_layers if lo <= i < hi]
        if mine == theirs:
            return None
        return (f"its layers {theirs} keep window pages, this stage's {mine} (window paging "
                "must be on or off on both: the same model and pipefill on both)")

    def _serve_refusals(self, conn: ch.Channel, msg) -> None:
        """The prefill HTTP server's connection (rejects.RejectNotifier): RejectRoom messages
        until it closes; it is no decode, so it joins no peer table."""
        while True:
            if isinstance(msg, m.RejectRoom):
                self.reject_room(msg.room, msg.status, msg.reason)
            else:
                conn.drops.drop(f"{type(msg).__name__} on the HTTP server's connection")
            msg = conn.recv()

    def _on_message(self, peer: str, msg) -> None:
        now = self._p.clock()
        with self._p.lock:
            self._p.liveness.seen(peer, now)
            if isinstance(msg, m.RoomBootstrap):
                work, notices = self._on_bootstrap(peer, msg, now)
                self._route(work)
            elif isinstance(msg, m.DropRoom):
                notices = self.rooms.on_drop(peer, msg)
            elif isinstance(msg, m.Heartbeat):
                return
            else:
                self._p.conns[peer].drops.drop(f"{type(msg).__name__} is not for a prefill stage")
                return
        self._p.send(notices)

    def _on_bootstrap(self, peer: str, msg: m.RoomBootstrap, now: float):
        """(work, notices) of a decode's RoomBootstrap (under the lock): one whose pages or
        staging region this data path cannot write is answered with a 400."""
        hello = self.hellos.get(peer)
        if hello is None:  # declared dead meanwhile: its rooms are failing
            return [], []
        shared = (max(self.kv.layer_start, hello.layer_start),
                  min(self.kv.layer_end, hello.layer_end))
        why = self.data.check_bootstrap(hello, msg, shared)
        if why is not None:
            self.rooms.refusals.drop(f"RoomBootstrap of room {msg.room} from {peer}: {why}")
            return [], [(peer, m.RoomFailed(msg.room, msg.nonce, self.rank, why, 400))]
        return self.rooms.on_bootstrap(peer, msg, now, (hello.layer_start, hello.layer_end))

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
            head_map = self.head_maps.get(dest.peer)
        ok, dead = False, False
        try:
            if conn is None:
                raise ch.ConnectionClosed(f"decode {dest.peer} is gone")
            if item.final is not None:
                conn.send(msgspec.structs.replace(item.final, room=item.room, nonce=dest.nonce))
            else:
                self._send_chunk(conn, item, dest, hello, head_map)
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
        self._p.send(notices)

    def _send_chunk(self, conn, item: Item, dest, hello: m.DecodeHello,
                    head_map: list[list[int]]) -> None:
        ls = max(self.kv.layer_start, hello.layer_start)
        le = min(self.kv.layer_end, hello.layer_end)
        n, end = len(item.src_pages), item.page_offset + len(item.src_pages)
        if end > len(dest.dst_pages):
            raise ValueError(f"the request has more pages here ({end}) than the decode "
                             f"allocated ({len(dest.dst_pages)})")
        wanted, window_src = self._window_part(item, dest)
        num_layers = len(self.kv.layers_in(ls, le))
        num_window = len(self.kv.window.layers_in(ls, le)) if wanted else 0
        nbytes = self.data.payload_bytes(n, num_layers, head_map) + \
            self.data.payload_bytes(len(wanted), num_window, head_map)
        header = m.KVChunk(item.room, dest.nonce, self.rank, item.chunk_id, item.page_offset, n,
                           ls, le, nbytes, item.is_last, wanted)
        dst = dest.dst_pages[item.page_offset:end]
        extra = {}
        if dest.staging_addr:  # only a one-sided data path's decode hands out staging
            extra["staging_addr"] = dest.staging_addr
        if wanted:  # the window layers' part ('Window pages'), from and to window pages
            extra.update(window_src=window_src, window_dst=[dest.dst_window[i] for i in wanted])
        self.data.send(conn, header, item.src_pages, dst, hello, head_map, **extra)
        self.bytes_sent += 2 * (n * num_layers + len(wanted) * num_window) * \
            sum(self.kv.rank_page_bytes(head_map))
        self.pages_sent += n
        self.window_pages_sent += len(wanted)

    def _window_part(self, item: Item, dest) -> tuple[list[int], list[int]]:
        """(the request's pages whose window layers cross with this chunk, their window
        pages here): on the last chunk, the pages the decode's window table names, each of
        which must still hold its window page here (ARCHITECTURE.md, 'Window pages')."""
        if not item.is_last or self.kv.window is None:
            return [], []
        wanted = [i for i, p in enumerate(dest.dst_window) if p != -1]
        table = item.window_src or []
        freed = [i for i in wanted if i >= len(table) or table[i] == -1]
        if freed:
            raise ValueError(f"the decode asks for the window layers' KV of pages {freed[:8]}, "
                             "which this prefill no longer holds (the two sides' window tables "
                             "differ)")
        return wanted, [table[i] for i in wanted]

    def _peer_dead(self, peer: str) -> None:
        with self._p.lock:
            conn = self._p.conns.pop(peer, None)
            self.hellos.pop(peer, None)
            self.head_maps.pop(peer, None)
            box = self._outboxes.pop(peer, None)
            if box is not None:
                box.put(None)
            self._p.liveness.forget(peer)
            notices = self.rooms.on_peer_dead(peer)
        if conn is not None:
            conn.close()
        self._p.send(notices)

    def _tick(self, now: float) -> None:
        with self._p.lock:
            notices = self.rooms.tick(now)
            dead = self._p.liveness.dead(now)
            beat = now - self._last_heartbeat >= self._p.timing.heartbeat_interval_s
            if beat:  # each decode hears of its own rooms only
                self._last_heartbeat = now
                rooms = self.rooms.heartbeats()
                notices += [(peer, m.Heartbeat(self.name, rooms.get(peer, [])))
                            for peer in self._p.conns]
        for peer in dead:
            log.warning("decode %s missed its heartbeats: dropping its rooms", peer)
            self._peer_dead(peer)
        self._p.send(notices)
