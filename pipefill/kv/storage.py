"""L3 KV storage tier: page keys, model fingerprints and `PageStore` (the page format is in
storage_format.py).

A page of one stage is the tensor [2, num_stage_layers, page_size, num_kv_heads, head_dim]
(K then V) in the KV dtype. Its key is a chained SHA-256 over the token ids of every page up to
and including it (so a key names a whole prefix, not one page), suffixed with the model
fingerprint, dtype, page size and the stage's layer range, so a key never matches another
model or partition. Each stage process opens one `PageStore`; puts are asynchronous (a
background thread writes), gets are synchronous and return False on anything but a verified
page: missing, truncated, corrupt or foreign data is a miss, never a different answer.

Backends (one small class each, composed into `PageStore`): `file` (storage_file.py, one file
per page under a directory) and `mooncake` (storage_mooncake.py, Mooncake Store shared by
several servers).
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import struct
import threading
import time
import zlib

import numpy as np
import torch

from pipefill.kv.storage_format import DTYPE_CODES, byte_view, encode_header

log = logging.getLogger("pipefill.storage")

# ---------------------------------------------------------------------------------------------
# Keys

def chain_page_keys(token_ids, page_size: int, parent: bytes = b"") -> list[bytes]:
    """One 32-byte key per WHOLE page: key_i = SHA-256(key_{i-1} + page i's ids as little-endian
    int32); key_{-1} = `parent` (b"" at the start of a sequence). The partial last page gets no
    key: its contents are not final."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**31):
        raise ValueError("token ids must be in [0, 2**31) to be hashed as int32")
    raw = ids.astype("<i4").tobytes()
    page_bytes = 4 * page_size
    keys, prev = [], parent
    for i in range(len(ids) // page_size):
        prev = hashlib.sha256(prev + raw[i * page_bytes:(i + 1) * page_bytes]).digest()
        keys.append(prev)
    return keys


_WHOLE_FILE_LIMIT = 32 << 20   # files up to this size are hashed whole
_SAMPLE_BLOCK = 64 << 10
_NUM_SAMPLES = 32


def model_fingerprint(model_file: str) -> str:
    """128-bit hex id of the weights in `model_file` (a .gguf/.safetensors file, or a Hugging
    Face folder: its config.json and weight files). Small files are hashed whole; large ones by
    size + the first MiB (headers and metadata, the whole safetensors header) + 32 evenly spaced
    64 KiB blocks + the last block: about 3 MiB read, cheap at start-up for multi-GB files."""
    if os.path.isdir(model_file):
        names = sorted(n for n in os.listdir(model_file)
                       if n == "config.json" or n.endswith((".safetensors", ".gguf", ".bin")))
        paths = [os.path.join(model_file, n) for n in names]
    else:
        paths = [model_file]
    if not paths or not all(os.path.isfile(p) for p in paths):
        raise ValueError(f"cannot fingerprint the model at {model_file}: no weight files")
    h = hashlib.sha256()
    for path in paths:
        h.update(os.path.basename(path).encode() + b"\0")
        _hash_file(h, path)
    return h.hexdigest()[:32]


def _hash_file(h, path: str) -> None:
    size = os.path.getsize(path)
    h.update(struct.pack("<Q", size))
    with open(path, "rb") as f:
        if size <= _WHOLE_FILE_LIMIT:
            h.update(f.read())
            return
        head = f.read(1 << 20)
        if path.endswith(".safetensors"):  # u64 header length, then the JSON header
            head_len = 8 + struct.unpack("<Q", head[:8])[0]
            head += f.read(max(0, min(head_len, size) - len(head)))
        h.update(head)
        for i in range(_NUM_SAMPLES + 1):
            f.seek((size - _SAMPLE_BLOCK) * i // _NUM_SAMPLES)
            h.update(f.read(_SAMPLE_BLOCK))


def stage_key_suffix(model_fingerprint: str, dtype, page_size: int, layers: range) -> str:
    """The part of every key of one stage that pins model, KV dtype, page size and layers."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_CODES:
        raise ValueError(f"unsupported KV dtype for storage: {dtype}")
    if page_size <= 0 or layers.step != 1 or len(layers) == 0:
        raise ValueError(f"bad page size {page_size} or layer range {layers}")
    return f"{model_fingerprint}.{name}.p{page_size}.l{layers.start}-{layers.stop}"


def stage_part_suffixes(model_fingerprint: str, dtype, page_size: int, layers: range,
                        num_window_layers: int | None) -> tuple[str, str | None]:
    """(suffix of a stage's page, suffix of its window part or None). Where the window layers
    keep pages of their own (num_window_layers not None; ARCHITECTURE.md, 'Window pages'), a
    stage with some stores a page's global layers ('.g') and its window layers ('.w') under
    keys of their own, apart from a page of every layer stored by a server without window
    pages; a stage with none stores its page as any stage does."""
    base = stage_key_suffix(model_fingerprint, dtype, page_size, layers)
    if not num_window_layers:
        return base, None
    return base + ".g", base + ".w"


# ---------------------------------------------------------------------------------------------
# The store

_MAX_PENDING_BYTES = 512 << 20
_MAX_SPARE_BYTES = 64 << 20


class PageStore:
    """One per stage process. `backend` does the I/O (`count_leading`, `write`, `read_into`,
    `discard`, `usage`, `close`); this class adds the write-behind queue, statistics, and the
    rule that a caller never sees an exception or a wrong page."""

    def __init__(self, backend, key_suffix: str, max_pending_bytes: int = _MAX_PENDING_BYTES):
        self.backend = backend
        self.key_suffix = key_suffix
        self.max_pending_bytes = max_pending_bytes
        # Pages waiting to be written: gets and contains see them, so a page is readable from
        # the moment put() returns (a later request may match it before the disk write ends).
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        # Written pages' buffers, reused by later puts: a fresh 1-2 MB tensor per put costs
        # page faults (ms under load) on the caller's thread; a warm one costs one memcpy.
        self._spare: list[torch.Tensor] = []
        self._queue: collections.deque[str] = collections.deque()
        self._cv = threading.Condition()
        self._busy = 0          # pages taken off the queue and not yet written
        self._closed = False
        self._stats = collections.Counter()
        self._writer = threading.Thread(target=self._write_loop, name="pipefill-l3-writer",
                                        daemon=True)
        self._writer.start()

    def full_key(self, key, key_suffix: str | None = None) -> str:
        """The stored name: '<chain key hex>.<stage suffix>'."""
        return f"{key.hex() if isinstance(key, bytes) else key}.{key_suffix or self.key_suffix}"

    def contains(self, keys: list, key_suffix: str | None = None) -> int:
        """How many LEADING keys are stored (pending writes count). `key_suffix` looks up
        another stage's pages (stage 0 checking that every stage can load a prefix)."""
        full = [self.full_key(k, key_suffix) for k in keys]
        n = 0
        # Alternate: a run of pending keys, then a run of stored ones. A key leaves _pending
        # only once written, so checking pending before storage never loses one in between.
        while n < len(full):
            with self._cv:
                while n < len(full) and full[n] in self._pending:
                    n += 1
            if n == len(full):
                break
            try:
                m = self.backend.count_leading(full[n:])
            except Exception as e:  # noqa: BLE001 - storage trouble is a miss
                self._error("contains", e)
                break
            if m == 0:
                break
            n += m
        return n

    def put(self, key, page: torch.Tensor, key_suffix: str | None = None) -> None:
        """Copy `page` and return; the writer thread stores it. Dropped (counted) when the
        queue holds more than max_pending_bytes. Never raises. `key_suffix`: stored under
        another suffix than the store's (a page's window part)."""
        try:
            full = self.full_key(key, key_suffix)
            with self._cv:
                if self._closed or full in self._pending:
                    return
                if self._pending_bytes + page.nbytes > self.max_pending_bytes:
                    self._stats["puts_dropped"] += 1
                    return
            copy = self._buffer_like(page)
            copy.copy_(page.detach())
            with self._cv:
                self._pending[full] = copy
                self._pending_bytes += copy.nbytes
                self._queue.append(full)
                self._cv.notify_all()
        except Exception as e:  # noqa: BLE001 - the caller's step must go on
            self._error("put", e)

    def get(self, key, out: torch.Tensor, key_suffix: str | None = None) -> bool:
        """Read the page into `out` (preallocated, the page's shape and dtype). False on a miss
        or any bad data; `out` may then hold garbage and must not be used. `key_suffix` reads
        another stage's page (same backend), e.g. to verify it before planning a fetch."""
        full = self.full_key(key, key_suffix)
        try:
            if self._get_pending(full, out):
                ok = True
            elif out.is_contiguous() and out.device.type == "cpu":
                ok = self.backend.read_into(full, out)
            else:
                tmp = torch.empty(out.shape, dtype=out.dtype)
                ok = self.backend.read_into(full, tmp)
                if ok:
                    out.copy_(tmp)
        except Exception as e:  # noqa: BLE001 - a read that fails is a miss
            self._error("get", e)
            ok = False
        with self._cv:
            self._stats["hits" if ok else "misses"] += 1
            if ok:
                self._stats["bytes_read"] += out.nbytes
        return ok

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every put so far is written (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stats(self) -> dict:
        with self._cv:
            out = {k: self._stats[k] for k in ("hits", "misses", "bytes_written", "bytes_read",
                                                "pages_written", "puts_dropped", "errors")}
            out["pending_pages"] = len(self._pending)
            out["pending_bytes"] = self._pending_bytes
        out.update(self.backend.usage())
        return out

    def close(self, timeout_s: float = 30.0) -> None:
        self.flush(timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._writer.join(timeout_s)
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- writer thread --------------------------------------------------------------------

    def _buffer_like(self, page: torch.Tensor) -> torch.Tensor:
        with self._cv:
            for i, t in enumerate(self._spare):
                if t.shape == page.shape and t.dtype == page.dtype:
                    return self._spare.pop(i)
        return torch.empty(page.shape, dtype=page.dtype)

    def _get_pending(self, full: str, out: torch.Tensor) -> bool:
        # Copied under the lock: once written, the buffer goes back to the spares and a put
        # may overwrite it.
        with self._cv:
            held = self._pending.get(full)
            if held is None or held.shape != out.shape or held.dtype != out.dtype:
                return False
            out.copy_(held)
            return True

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                key = self._queue.popleft()
                page = self._pending[key]
                self._busy += 1
            wrote = self._write_one(key, page)
            with self._cv:
                self._busy -= 1
                del self._pending[key]
                self._pending_bytes -= page.nbytes
                if (len(self._spare) + 1) * page.nbytes <= _MAX_SPARE_BYTES:
                    self._spare.append(page)
                if wrote:
                    self._stats["pages_written"] += 1
                    self._stats["bytes_written"] += page.nbytes
                self._cv.notify_all()

    def _write_one(self, key: str, page: torch.Tensor) -> bool:
        try:
            payload = byte_view(page)
            header = encode_header(key, page, zlib.crc32(payload))
            return self.backend.write(key, header, payload)
        except Exception as e:  # noqa: BLE001 - the backend warns once; serving goes on
            self._error("write", e)
            return False

    def _error(self, what: str, e: Exception) -> None:
        with self._cv:
            self._stats["errors"] += 1
            first = self._stats["errors"] == 1
        (log.warning if first else log.debug)(
            "L3 storage %s failed (%s: %s); treated as a miss%s", what, type(e).__name__, e,
            "; further errors are counted in stats, not logged" if first else "")


def open_page_store(backend: str, *, key_suffix: str, storage_dir: str | None = None,
                    storage_max_bytes: int | None = None, mooncake_master: str | None = None,
                    mooncake_local_hostname: str = "127.0.0.1",
                    mooncake_segment_bytes: int = 256 << 20,
                    mooncake_connect_timeout_s: float = 5.0,
                    max_pending_bytes: int = _MAX_PENDING_BYTES) -> PageStore:
    """A `PageStore` on `backend` ('file' or 'mooncake'; `storage_max_bytes` caps a file
    store's folder); ValueError / RuntimeError with a sentence for bad settings (an
    unreachable Mooncake master names its address)."""
    if not key_suffix:
        raise ValueError("open_page_store needs the stage's key_suffix (see stage_key_suffix)")
    if backend == "file":
        from pipefill.kv.storage_file import FileBackend
        if not storage_dir:
            raise ValueError("--hicache-storage-backend file needs --hicache-storage-dir")
        impl = FileBackend(storage_dir, storage_max_bytes)
    elif backend == "mooncake":
        from pipefill.kv.storage_mooncake import MooncakeBackend
        if not mooncake_master:
            raise ValueError("--hicache-storage-backend mooncake needs the Mooncake master "
                             "address (host:port of a running mooncake_master)")
        impl = MooncakeBackend(mooncake_master, local_hostname=mooncake_local_hostname,
                               segment_bytes=mooncake_segment_bytes,
                               connect_timeout_s=mooncake_connect_timeout_s)
    else:
        raise ValueError(f"--hicache-storage-backend must be 'file' or 'mooncake', "
                         f"got {backend!r}")
    return PageStore(impl, key_suffix, max_pending_bytes=max_pending_bytes)
