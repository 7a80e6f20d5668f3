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
"""
from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
# Smaller buffers stay on torch's allocator: a mapping each would cost more than it saves.
MIN_BYTES = 4 << 20


def empty(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype) (contiguous, uninitialised), on 2 MiB pages where the
    buffer is at least MIN_BYTES and the OS offers them on request; else torch.empty. The
    mapping lives as long as the tensor (and its views)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, same bytes
        pass
    return whole[start:start + nbytes].view(dtype).view(shape)


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
