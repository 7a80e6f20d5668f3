"""KV transfer between a prefill stage (KVSender, transfer_sender.py) and a decode stage
(KVReceiver, transfer_receiver.py): what both share is here.

One TCP control connection per (decode stage, prefill stage) pair, opened by the decode,
carries every message of both directions (messages.py) and, with the `tcp` data path, the page
bytes after each KVChunk header. The sender's work runs on background threads: `send_pages`
only queues. The receiver writes straight into pre-allocated pages of its KV tensors, tracks
each room (rooms.py), and `wait_room` returns when the room is ready or failed. A dead peer is
found by a socket error at once, or by missing heartbeats within interval * max_misses. Control
messages are posted to each connection's writer thread (channel.py), so a peer that stops
reading delays nothing but itself, and is dropped after the send timeout.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from pipefill.disagg import channel as ch
from pipefill.disagg.heads import pieces, whole_source
from pipefill.disagg.rooms import Liveness

BACKENDS = ("tcp", "mooncake")
MAX_CUTS = 1024  # decode ranks' head sets a sender remembers how to cut


@dataclass
class KVTensors:
    """One TP rank's KV cache of a stage, global layers [layer_start, layer_start +
    num_layers): k and v are [num_layers_here, ...] with one page of one layer contiguous:
    token-major [layers, num_pages * page_size, kv_heads, head_dim] (KVCache) or AMX-packed
    [layers, num_pages, kv_heads, page_size, head_dim] (AmxKVCache). `heads`: the global KV
    head ids the rank holds, in its order (empty: every head of the tensors, 0..kv_heads-1).
    Pages move as bytes, so both ends must use the same layout (checked at bootstrap)."""
    k: torch.Tensor
    v: torch.Tensor
    page_size: int
    layer_start: int = 0
    num_pages: int = 0  # 0: k.shape[1] // page_size (token-major)
    layout: str = "token-major"
    heads: tuple[int, ...] = ()
    # The model's layer ids of k's rows, where they are not layer_start on one by one (a
    # windowed cache's global or window layers, 'Window pages'), and the stage's end then.
    layers: tuple[int, ...] = ()
    stage_end: int = 0

    def __post_init__(self):
        assert self.k.shape == self.v.shape and self.k.is_contiguous() and self.v.is_contiguous()
        if not self.num_pages:
            self.num_pages = self.k.shape[1] // self.page_size
        self.heads = tuple(self.heads) or tuple(range(self.k.shape[2]))
        assert len(self.heads) == self.k.shape[2], "one head id per KV head of the tensors"
        self.layers = tuple(self.layers) or tuple(range(self.layer_start,
                                                        self.layer_start + self.k.shape[0]))
        assert len(self.layers) == self.k.shape[0], "one layer id per row of the tensors"
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        self._bytes = {}

    @staticmethod
    def from_cache(cache, layer_start: int, heads=()) -> "KVTensors":
        """A stage's KVCache or AmxKVCache (of a WindowedKVCache: its global layers)."""
        layout = "amx-packed" if cache.k.dim() == 5 else "token-major"
        windowed = getattr(cache, "windowed", None)
        if windowed is None:
            return KVTensors(cache.k, cache.v, cache.page_size, layer_start, cache.num_pages,
                             layout, tuple(heads))
        return KVTensors(cache.k, cache.v, cache.page_size, layer_start, cache.num_pages, layout,
                         tuple(heads), _layers_where(windowed, layer_start, False),
                         layer_start + len(windowed))

    @staticmethod
    def window_of(cache, layer_start: int) -> "KVTensors | None":
        """A WindowedKVCache's window layers, addressed by the window pool's ids; None for
        any other cache."""
        windowed = getattr(cache, "windowed", None)
        if windowed is None:
            return None
        w = cache.window  # packed where the stage's cache is (kv.cache.WindowedPackedCache)
        layout = "amx-packed" if w.k.dim() == 5 else "token-major"
        return KVTensors(w.k, w.v, w.page_size, layer_start, w.num_pages, layout, (),
                         _layers_where(windowed, layer_start, True),
                         layer_start + len(windowed))

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def layer_end(self) -> int:
        return self.stage_end or self.layer_start + self.num_layers

    def layers_in(self, start: int, end: int) -> list[int]:
        """The layers of [start, end) that these tensors hold, in order."""
        return [layer for layer in self.layers if start <= layer < end]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def page_elems(self) -> int:
        return math.prod(self.k.shape[1:]) // self.num_pages  # (a stage may hold no layer)

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.k.element_size()

    @property
    def head_axis(self) -> int:
        """The heads' axis inside one page (page_shape)."""
        return 0 if self.layout == "amx-packed" else 1

    def page_shape(self, num_heads: int) -> tuple[int, ...]:
        """One page of one layer with num_heads heads: [page_size, heads, row] token-major,
        [heads, page_size, row] packed (row: the head's stored width)."""
        row = self.k.shape[-1]
        if self.layout == "amx-packed":
            return (num_heads, self.page_size, row)
        return (self.page_size, num_heads, row)

    def local(self, t: torch.Tensor, layer: int) -> torch.Tensor:
        return t[self._row[layer]]

    def pages(self, t: torch.Tensor, layer: int) -> torch.Tensor:
        """[num_pages, page_elems] view of one layer of k or v."""
        return self.local(t, layer).view(self.num_pages, self.page_elems)

    def byte_view(self, t: torch.Tensor, layer: int) -> memoryview:
        key = (t is self.k, layer)
        if key not in self._bytes:
            flat = self.local(t, layer).reshape(-1).view(torch.uint8)
            self._bytes[key] = memoryview(flat.numpy())
        return self._bytes[key]


def _rank_tensors(own: KVTensors, tensors, head_map: list[list[int]]) -> list[KVTensors]:
    """Each rank's (k, v) with the geometry and layers of `own` (the leader's) and its heads."""
    return [KVTensors(k, v, own.page_size, own.layer_start, own.num_pages, own.layout,
                      tuple(heads), own.layers, own.stage_end)
            for (k, v), heads in zip(tensors, head_map, strict=True)]


def _layers_where(windowed, layer_start: int, window: bool) -> tuple[int, ...]:
    return tuple(layer_start + i for i, w in enumerate(windowed) if w == window)


class StageTensors:
    """One stage's KV over its TP ranks (ARCHITECTURE.md, 'KV heads across TP sizes'): ranks[r]
    is rank r's KVTensors (the leader's own cache, and its peers' mapped from shared memory).
    What crosses for a decode stage is, per layer, K then V, then per decode rank its pages
    with exactly its heads (`gather`); a decode writes each rank's into that rank's pages.

    page_bytes is a page of one layer of K with every KV head of the model, the same on both
    sides whatever their TP sizes (the handshake compares it)."""

    def __init__(self, ranks: list[KVTensors]):
        first = ranks[0]
        for r in ranks:
            assert (r.layer_start, r.num_layers, r.page_size, r.num_pages, r.dtype, r.layout,
                    r.k.shape[-1]) == (first.layer_start, first.num_layers, first.page_size,
                                       first.num_pages, first.dtype, first.layout,
                                       first.k.shape[-1]), "a stage's ranks differ"
        self.ranks = ranks
        self.head_map = [list(r.heads) for r in ranks]
        self.num_kv_heads = len(set().union(*map(set, self.head_map)))
        self.head_page_bytes = first.page_bytes // len(first.heads)
        self.k, self.v = first.k, first.v  # the leader's own (device, dtype)
        for name in ("page_size", "layer_start", "layer_end", "num_layers", "num_pages",
                     "dtype", "layout", "layers", "layers_in"):
            setattr(self, name, getattr(first, name))
        self._cuts: dict[tuple[int, ...], int | list] = {}
        # A windowed cache's window layers, addressed by window page ids ('Window pages'):
        # they cross only for the pages the decode's window table names.
        self.window: StageTensors | None = None

    @staticmethod
    def of_cache(cache, layer_start: int) -> "StageTensors":
        """One process's stage cache; a WindowedKVCache's window layers as `window`."""
        stage = StageTensors([KVTensors.from_cache(cache, layer_start)])
        window = KVTensors.window_of(cache, layer_start)
        if window is not None:
            stage.window = StageTensors([window])
        return stage

    def window_layers(self) -> list[int]:
        """The model's layer ids whose pages are window pages here ([] without)."""
        return list(self.window.layers) if self.window is not None else []

    @staticmethod
    def of_ranks(cache, layer_start: int, tensors, head_map: list[list[int]]) -> "StageTensors":
        """A TP stage's: `cache` the leader's own, tensors[r] rank r's (k, v), with the
        cache's layout and geometry, head_map[r] its heads (heads.tp_head_map); of a
        WindowedKVCache (k, v, window k, window v), its window layers as `window`."""
        stage = StageTensors(_rank_tensors(KVTensors.from_cache(cache, layer_start),
                                           [t[:2] for t in tensors], head_map))
        window = KVTensors.window_of(cache, layer_start)
        if window is not None:  # each rank's window pages, with its heads ('Window pages')
            stage.window = StageTensors(_rank_tensors(window, [t[2:] for t in tensors],
                                                      head_map))
        return stage

    @staticmethod
    def of(kv) -> "StageTensors":
        """kv as a stage's tensors (a lone KVTensors: one rank)."""
        return kv if isinstance(kv, StageTensors) else StageTensors([kv])

    @property
    def page_bytes(self) -> int:
        return self.head_page_bytes * self.num_kv_heads

    def rank_page_bytes(self, head_map: list[list[int]]) -> list[int]:
        """Bytes of one page of one layer of K of each rank of a stage with head_map."""
        return [self.head_page_bytes * len(hs) for hs in head_map]

    def gather(self, dst_map: list[list[int]], which: str, layer: int, idx: torch.Tensor,
               out: torch.Tensor) -> None:
        """Pages idx of one layer's K or V (which: "k" or "v") for every rank of a decode
        stage with head map dst_map, rank after rank, each page with that rank's heads: into
        `out`, uint8 of n * sum(rank_page_bytes(dst_map)) bytes."""
        n, at = len(idx), 0
        for dst_heads in dst_map:
            nbytes = n * self.head_page_bytes * len(dst_heads)
            block = out[at:at + nbytes].view(self.dtype)
            at += nbytes
            cut = self._cut(dst_heads)
            if isinstance(cut, int):  # one rank's pages as they are
                r = self.ranks[cut]
                torch.index_select(r.pages(getattr(r, which), layer), 0, idx,
                                   out=block.view(n, r.page_elems))
                continue
            dst = block.view(n, *self.ranks[0].page_shape(len(dst_heads)))
            axis = 1 + self.ranks[0].head_axis
            for p in cut:
                r = self.ranks[p.src]
                src = r.pages(getattr(r, which), layer).view(r.num_pages,
                                                             *r.page_shape(len(r.heads)))
                dst.narrow(axis, p.dst_at, p.count).copy_(
                    src.narrow(axis, p.src_at, p.count).index_select(0, idx))

    def _cut(self, dst_heads: list[int]):
        """The prefill rank whose pages a decode rank takes whole (an int), or the pieces its
        heads are cut from (heads.pieces)."""
        key = tuple(dst_heads)
        if key not in self._cuts:
            if len(self._cuts) >= MAX_CUTS:  # decodes of ever new head maps: start over
                self._cuts.clear()
            src = whole_source(self.head_map, dst_heads)
            self._cuts[key] = src if src is not None else pieces(self.head_map, dst_heads)
        return self._cuts[key]

    def scatter(self, which: str, layer: int, idx: torch.Tensor, block: torch.Tensor) -> None:
        """The inverse on the decode: `block` (uint8) holds pages idx of one layer's K or V for
        each of this stage's ranks in turn; each rank's go into its own pages."""
        n, at = len(idx), 0
        for r in self.ranks:
            nbytes = n * r.page_bytes
            part = block[at:at + nbytes].view(self.dtype).view(n, r.page_elems)
            r.pages(getattr(r, which), layer).index_copy_(0, idx, part)
            at += nbytes


def make_data_path(backend: str, kv: KVTensors, host: str, staging_bytes: int | None = None):
    """staging_bytes: the decode's staging arena of one-sided transports (None: their default)."""
    if backend == "tcp":
        from pipefill.disagg.transfer_tcp import TcpDataPath
        return TcpDataPath(kv)
    if backend == "mooncake":
        from pipefill.disagg.transfer_mooncake import MooncakeDataPath
        return MooncakeDataPath(kv, host, staging_bytes)
    raise ValueError(f"--disaggregation-transfer-backend {backend!r}: one of {BACKENDS}")


@dataclass(frozen=True)
class Timing:
    bootstrap_timeout_s: float = 120.0
    waiting_timeout_s: float = 300.0
    heartbeat_interval_s: float = 2.0
    heartbeat_max_misses: int = 3
    send_timeout_s: float = ch.SEND_TIMEOUT_S  # a peer that takes no byte for this is dropped
    claim_timeout_s: float = 30.0  # prefill: a running request's room waits this for a decode

    @staticmethod
    def of(disagg) -> "Timing":
        """From the --disaggregation-* timeouts (the config's Disaggregation section)."""
        return Timing(disagg.bootstrap_timeout, disagg.waiting_timeout,
                      disagg.heartbeat_interval, disagg.heartbeat_max_misses,
                      claim_timeout_s=disagg.room_claim_timeout)


class Peers:
    """Channels by peer name, a Liveness for them, and the loop that reads each."""

    def __init__(self, timing: Timing, clock):
        self.timing, self.clock = timing, clock
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.conns: dict[str, ch.Channel] = {}
        self.liveness = Liveness(timing.heartbeat_interval_s, timing.heartbeat_max_misses)
        self.stopped = threading.Event()

    def send(self, notices) -> None:
        """Posts each (peer, message): never blocks, on the network or on another sender. A
        send that fails closes the peer's connection, and its reader thread declares it dead."""
        for peer, msg in notices:
            conn = self.conns.get(peer)
            if conn is not None:
                conn.post(msg)

    def flush(self, timeout_s: float) -> None:
        """Waits, up to timeout_s in all, until every connection sent what was posted."""
        deadline = time.monotonic() + timeout_s
        for conn in list(self.conns.values()):
            conn.flush(max(0.0, deadline - time.monotonic()))

    def run_ticker(self, tick: Callable[[float], None]) -> None:
        period = min(0.5, self.timing.heartbeat_interval_s / 2)
        while not self.stopped.wait(period):
            tick(self.clock())
