"""Large weight buffers on 2 MiB pages (Linux transparent huge pages, asked for per buffer).

A decode step at M = 1 streams each weight once, so a large matrix's GEMV runs at the memory's
read bandwidth, and on 4 KiB pages it also walks a page table entry per 4 KiB: 43,000 for
Gemma 3's 178 MB LM head each step, and the hardware prefetcher stops at every 4 KiB border.
On 2 MiB pages that is 85 (one Zen 4 core streamed that head in 5.3 ms against 8.5 ms on
4 KiB pages, 34 against 21 GB/s, the same kernel). The kernel gives an anonymous private mapping huge pages where
/sys/kernel/mm/transparent_hugepage/enabled is `always`, or `madvise` and the mapping asked
(MADV_HUGEPAGE); torch's allocator does not ask, so a buffer here is its own mapping, 2 MiB
aligned, asked once. The bytes are the same: only where they lie changes (ARCHITECTURE.md,
'GGUF blocks kept quantized').

A model's many small matrices (Gemma 3 270M's layers: 0.3-1.5 MB each) would each be a
mapping of their own, or on torch's 4 KiB pages: `empty(..., shared=True)` packs them one
after another into shared mappings of SHARED_CHUNK bytes on 2 MiB pages instead (a decode
step streams them all, one after another).
"""
from __future__ import annotations

import math
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
# Smaller buffers stay on torch's allocator: a mapping each would cost more than it saves.
MIN_BYTES = 4 << 20
# Small buffers asked for with shared=True: the size of each shared mapping, and where in it
# each buffer starts (a cache line, as a GEMM's rows want).
SHARED_CHUNK = 32 << 20
SHARED_ALIGN = 64


def empty(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8,
          shared: bool = False) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype) (contiguous, uninitialised), on 2 MiB pages where the
    buffer is at least MIN_BYTES and the OS offers them on request; a smaller one in a shared
    mapping on 2 MiB pages where `shared` (meant for buffers that live as long as the model:
    a mapping is freed when none of its buffers is left); else torch.empty. A mapping lives as
    long as the tensors (and views) in it."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not hasattr(mmap, "MADV_HUGEPAGE") or (nbytes < MIN_BYTES and not shared):
        return torch.empty(shape, dtype=dtype)
    raw = _mapped(nbytes) if nbytes >= MIN_BYTES else _SHARED.take(nbytes)
    return raw.view(dtype).view(shape)


def _mapped(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], 2 MiB aligned, in a mapping of its own that asks for huge pages."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, same bytes
        pass
    return whole[start:start + nbytes]


class _SharedChunks:
    """Hands out consecutive pieces of one huge-page mapping of SHARED_CHUNK bytes, and a new
    mapping when the rest is too short (the old one's tail stays unused: untouched, it takes
    no memory). Only the rest of the current mapping is held here."""

    def __init__(self):
        self.rest = torch.empty(0, dtype=torch.uint8)
        self.lock = threading.Lock()  # weights may be loaded on several threads
        self.handed_out = 0  # bytes, each piece to its alignment

    def take(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // SHARED_ALIGN) * SHARED_ALIGN
        with self.lock:
            if self.rest.numel() < size:
                self.rest = _mapped(SHARED_CHUNK)
            piece, self.rest = self.rest[:nbytes], self.rest[size:]
            self.handed_out += size
        return piece


_SHARED = _SharedChunks()


def shared_bytes() -> int:
    """Bytes handed out in shared mappings so far, each piece to SHARED_ALIGN: what their
    buffers make resident once written, alive or not, since a dropped piece's pages go only
    with its whole mapping (so a buffer meant to be dropped does not belong there)."""
    return _SHARED.handed_out


def shared_piece_bytes(t: torch.Tensor) -> int:
    """What a buffer of t's size takes of a shared mapping (shared_bytes' unit)."""
    return -(-t.nbytes // SHARED_ALIGN) * SHARED_ALIGN


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping that holds t's first byte that lie on huge pages, as
    /proc/self/smaps says (0 where it cannot be read): what the OS actually gave."""
    at, inside = t.data_ptr(), False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and len(head) > 4:  # a mapping's first line: "lo-hi perms ..."
                    lo, hi = (int(v, 16) for v in head[0].split("-"))
                    inside = lo <= at < hi
                elif inside and head[0] == "AnonHugePages:":
                    return int(head[1]) * 1024
    except OSError:
        pass
    return 0
