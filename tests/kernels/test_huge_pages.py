"""kernels.huge_pages: large buffers in a 2 MiB aligned mapping that asks for huge pages, small
ones on torch's allocator; the 16-row layout of a large matrix lands there with the same bytes."""
import gc

import numpy as np
import torch

from pipefill.kernels import huge_pages
from pipefill.kernels.gguf_blocks import from_rows16, random_blocks, to_rows16

Q8_0 = 8


def thp_on_request() -> bool:
    """Whether this kernel gives transparent huge pages to a mapping that asks."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def test_large_buffers_are_aligned_mappings_that_outlive_their_maker():
    t = huge_pages.empty((3, huge_pages.MIN_BYTES // 4), torch.float32)
    gc.collect()  # nothing but the tensor holds the mapping now
    assert t.shape == (3, huge_pages.MIN_BYTES // 4) and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.fill_(2.5)
    assert t.sum().item() == 2.5 * t.numel()
    if thp_on_request():
        assert huge_pages.huge_page_bytes(t) >= huge_pages.HUGE_PAGE
    small = huge_pages.empty((1000,))
    assert small.untyped_storage().nbytes() == 1000  # torch's own allocation


def test_rows16_of_a_large_matrix_keeps_the_files_bytes():
    """Q8_0 rows of 640 weights, enough rows for a buffer past MIN_BYTES (and rows not a
    multiple of 16): the layout puts back to the file's bytes."""
    rows = huge_pages.MIN_BYTES // 680 + 7
    raw = torch.from_numpy(random_blocks(Q8_0, rows, 640, np.random.default_rng(0)))
    packed = to_rows16(raw, Q8_0)
    assert packed.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert torch.equal(from_rows16(packed, Q8_0, rows), raw)
    if thp_on_request():
        assert huge_pages.huge_page_bytes(packed) >= huge_pages.HUGE_PAGE



def test_small_shared_buffers_are_packed_into_one_huge_page_mapping():
    """Small buffers asked for with shared=True: consecutive, cache-line aligned, apart from
    each other, alive after their maker's references are gone, and on huge pages."""
    sizes = [1000, 4096, 12345, 64]
    bufs = [huge_pages.empty((n,), shared=True) for n in sizes]
    gc.collect()
    starts = [b.data_ptr() for b in bufs]
    assert all(s % huge_pages.SHARED_ALIGN == 0 for s in starts)
    ends = sorted((s, s + n) for s, n in zip(starts, sizes))
    assert all(hi <= lo for (_, hi), (lo, _) in zip(ends, ends[1:]))  # no two overlap
    for i, b in enumerate(bufs):
        b.fill_(i + 1)
    assert [int(b.sum()) for b in bufs] == [(i + 1) * n for i, n in enumerate(sizes)]
    if thp_on_request():
        assert huge_pages.huge_page_bytes(bufs[0]) >= huge_pages.HUGE_PAGE
    floats = huge_pages.empty((7, 9), torch.float32, shared=True)
    assert floats.shape == (7, 9) and floats.is_contiguous()
    unshared = huge_pages.empty((1000,))
    assert unshared.untyped_storage().nbytes() == 1000  # torch's own allocation


def test_shared_buffers_start_a_new_mapping_when_the_chunk_is_full():
    first = huge_pages.empty((huge_pages.SHARED_CHUNK // 2 + 1,), shared=True)
    second = huge_pages.empty((huge_pages.SHARED_CHUNK // 2 + 1,), shared=True)
    assert abs(second.data_ptr() - first.data_ptr()) >= huge_pages.SHARED_CHUNK // 2
    assert second.data_ptr() % huge_pages.HUGE_PAGE == 0  # a fresh mapping's start
    first.fill_(1)
    second.fill_(2)
    assert int(first.sum()) == first.numel() and int(second.sum()) == 2 * second.numel()


def test_rows16_of_a_small_matrix_keeps_the_files_bytes_on_huge_pages():
    """A layer-sized Q4_K matrix (Gemma 3 270M's o_proj: 640 rows of 1024 weights, 0.37 MB)
    goes to the shared mapping and reads back as the file's bytes."""
    q4_k = 12
    raw = torch.from_numpy(random_blocks(q4_k, 640, 1024, np.random.default_rng(1)))
    packed = to_rows16(raw, q4_k)
    assert packed.nbytes < huge_pages.MIN_BYTES
    assert torch.equal(from_rows16(packed, q4_k, 640), raw)
    if thp_on_request():
        assert huge_pages.huge_page_bytes(packed) >= huge_pages.HUGE_PAGE
