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

