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

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from pipefill.disagg import channel as ch
from pipefill.disagg.rooms import Liveness

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
