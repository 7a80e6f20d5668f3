"""`mooncake` L3 backend: pages as objects in a Mooncake Store, so several pipefill servers (and
every stage of each) share one L3.

Set-up without etcd or RDMA: the client joins the master given by host:port over TCP, and
finds the other clients' transfer engines by P2P handshake (metadata server "P2PHANDSHAKE").
Every client lends `segment_bytes` of its own memory to the shared pool, where the master
places objects; an object lives as long as the client holding it (run Mooncake's standalone
`mooncake_client` next to the master for a pool that outlives the servers).

Objects use the same header as the file backend (key, shape, dtype, CRC-32s), so a read is
checked the same way. The Mooncake client library is imported lazily (an optional extra).
A master that is unreachable at start is a RuntimeError naming it, after a bounded TCP probe
(the library itself retries for ~90 s); a master lost later turns reads into misses and drops
writes, and the client backs off for a few seconds after each failure instead of waiting ~4 s
per call on a dead connection.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
import zlib

import torch

from pipefill.kv.storage_format import _FIXED, byte_view, check_header

log = logging.getLogger("pipefill.storage")

_NOT_FOUND = -704        # Mooncake's OBJECT_NOT_FOUND: a plain miss, not trouble
_BACKOFF_S = 5.0
_LOCAL_BUFFER_BYTES = 64 << 20


def parse_address(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"the Mooncake master address must be host:port, got {addr!r}")
    return host, int(port)


class MooncakeBackend:
    def __init__(self, master: str, *, local_hostname: str = "127.0.0.1",
                 segment_bytes: int = 256 << 20, connect_timeout_s: float = 5.0):
        host, port = parse_address(master)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RuntimeError(
                "the mooncake storage backend needs the Mooncake client library: "
                "pip install 'pipefill[mooncake]' (mooncake-transfer-engine-non-cuda)") from e
        self.master = master
        _probe(host, port, connect_timeout_s)
        self.store = MooncakeDistributedStore()
        rc = _bounded(lambda: self.store.setup(
            local_hostname, "P2PHANDSHAKE", segment_bytes, _LOCAL_BUFFER_BYTES, "tcp", "",
            master), timeout_s=max(10.0, 3 * connect_timeout_s))
        if rc != 0:
            raise RuntimeError(f"could not join the Mooncake master at {master} "
                               f"({'timed out' if rc is None else f'error {rc}'}): is a "
                               f"mooncake_master listening there?")
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._warned = False
        self._bytes_put = 0

    def count_leading(self, keys: list[str]) -> int:
        if self._down():
            return 0
        n = 0
        for flag in self.store.batch_is_exist(keys):
            if flag < 0:
                self._trouble(f"is_exist error {flag}")
            if flag != 1:
                break
            n += 1
        return n

    def write(self, key: str, header: bytes, payload: memoryview) -> bool:
        if self._down():
            return False
        if self.store.is_exist(key) == 1:
            return False
        rc = self.store.put_parts(key, header, payload)
        if rc != 0:
            self._trouble(f"put error {rc}")
            return False
        with self._lock:
            self._bytes_put += len(header) + payload.nbytes
        return True

    def read_into(self, key: str, out: torch.Tensor) -> bool:
        if self._down():
            return False
        header_len = _FIXED.size + 8 * out.dim() + len(key.encode()) + 4
        buf = torch.empty(header_len + out.nbytes, dtype=torch.uint8)
        rc = self.store.get_into(key, buf.data_ptr(), buf.numel())
        if rc != buf.numel():  # missing, or an object of another size: a miss
            if rc < 0 and rc != _NOT_FOUND and rc != -600:  # -600: our buffer is the wrong size
                self._trouble(f"get error {rc}")
            return False
        raw = buf.numpy()
        crc = check_header(memoryview(raw[:header_len]), key, out)
        if crc is None or zlib.crc32(memoryview(raw[header_len:])) != crc:
            self.discard(key)
            return False
        byte_view(out)[:] = memoryview(raw[header_len:])
        return True

    def discard(self, key: str) -> None:
        if not self._down():
            self.store.remove(key)

    def usage(self) -> dict:
        with self._lock:
            return {"usage_bytes": self._bytes_put, "mooncake_master": self.master,
                    "master_down": self._down()}

    def close(self) -> None:
        # With the master gone this waits on the library's RPC retries (~7-15 s, holding the
        # GIL, so a helper thread would not help); it only happens at shutdown.
        self.store.close()

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

    def _trouble(self, what: str) -> None:
        with self._lock:
            self._down_until = time.monotonic() + _BACKOFF_S
            first, self._warned = not self._warned, True
        if first:
            log.warning("Mooncake master %s: %s; L3 reads are misses and writes are dropped "
                        "while it does not answer (retried every %.0f s)", self.master, what,
                        _BACKOFF_S)


def _probe(host: str, port: int, timeout_s: float) -> None:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise RuntimeError(f"cannot reach the Mooncake master at {host}:{port} within "
                           f"{timeout_s:g} s ({e}): start mooncake_master there or fix the "
                           f"address") from None


def _bounded(fn, timeout_s: float):
    """fn() on a daemon thread; None if it has not returned within timeout_s."""
    result = []
    t = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    return result[0] if result else None
