"""KVCache: one stage's K and V tensors, addressed by slot = page_id * page_size + offset.

A quantized cache (int8, fp8_e4m3) keeps each row's float32 scale after its codes, so its
rows are head_dim + 4 wide (pipefill/kernels/kv_quant.py); whatever copies pages copies them.

WindowedKVCache: a stage of a model with sliding-window layers, whose window layers keep their
K/V in a second KVCache addressed by window page ids (ARCHITECTURE.md, 'Window pages');
WindowedPackedCache: the same split over the vector kernels' packed layout (AmxKVCache)."""
from __future__ import annotations

import torch

from pipefill.kernels.amx_attention import AmxKVCache
from pipefill.kernels.kv_quant import copyable, stored_dim


class KVCache:
    window = None  # the window layers' own cache (WindowedKVCache); None: one for all layers

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device=None, empty=torch.empty):
        """empty: torch.empty, or kv/shared.SharedEmpty (a TP rank of a PD stage)."""
        shape = (num_layers, num_pages * page_size, num_kv_heads, stored_dim(head_dim, dtype))
        # torch.empty does not touch memory: pages become resident only when written.
        self.k = empty(shape, dtype=dtype, device=device)
        self.v = empty(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * stored_dim(head_dim, dtype) * dtype.itemsize

    def per_layer(self):
        """(K, V) indexable by the stage's layer: [i] is layer i's cache."""
        return self.k, self.v

    def page_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as [num_layers, num_pages, page_size, num_kv_heads, head_dim] views: one
        page of one layer is one block (what the host tier copies)."""
        shape = (self.k.shape[0], self.num_pages, self.page_size, *self.k.shape[2:])
        return self.k.view(shape), self.v.view(shape)

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """[2, num_layers, len(pages), page_size, num_kv_heads, head_dim], token-major."""
        return read_page_blocks(self, pages)

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        write_page_blocks(self, pages, data)


class WindowedKVCache(KVCache):
    """The global layers of a stage in this KVCache (k, v, pages: what the page pool's ids
    address), its sliding-window layers in `window`, a KVCache addressed by the window pool's
    ids (kv/window.py), as many as the other pool's. Pages of the window tensor become
    resident only when written, and the window pool hands freed ids out again first, so its
    memory is its peak use."""

    def __init__(self, windowed: list[bool], num_pages: int, page_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device=None,
                 empty=torch.empty):
        """empty: as KVCache's; a TP rank of a PD stage keeps both caches in shared files
        (K, V, then the window layers' K and V)."""
        num_window = sum(windowed)
        super().__init__(len(windowed) - num_window, num_pages, page_size, num_kv_heads,
                         head_dim, dtype, device, empty)
        self.window = KVCache(num_window, num_pages, page_size, num_kv_heads, head_dim,
                              dtype, device, empty)
        self.windowed = tuple(windowed)
        self._k, self._v = _layer_views(self, self.window, windowed)

    def per_layer(self):
        return self._k, self._v


class WindowedPackedCache(AmxKVCache):
    """WindowedKVCache's split for the vector kernels' packed layout: the global layers in
    this AmxKVCache, the window layers in `window`, an AmxKVCache of the window pool's pages;
    the kernels read a window layer's table only from its window's first page on."""

    def __init__(self, windowed: list[bool], num_pages: int, page_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, empty=torch.empty):
        num_window = sum(windowed)
        super().__init__(len(windowed) - num_window, num_pages, page_size, num_kv_heads,
                         head_dim, dtype, empty)
        self.window = AmxKVCache(num_window, num_pages, page_size, num_kv_heads, head_dim,
                                 dtype, empty)
        self.windowed = tuple(windowed)
        self._k, self._v = _layer_views(self, self.window, windowed)

    def per_layer(self):
        return self._k, self._v


def _layer_views(whole, window, windowed: list[bool]) -> tuple[list, list]:
    """Each stage layer's K and V: a window layer's from `window`, the rest from `whole`, each
    at its index in its own stacked tensor."""
    index = {True: iter(range(sum(windowed))), False: iter(range(windowed.count(False)))}
    at = [next(index[w]) for w in windowed]
    k = [(window.k if w else whole.k)[i] for w, i in zip(windowed, at)]
    v = [(window.v if w else whole.v)[i] for w, i in zip(windowed, at)]
    return k, v


def frees_window_pages(args, has_windows: bool) -> bool:
    """Whether the stages' window layers keep pages of their own, freed outside the window
    (ARCHITECTURE.md, 'Window pages'): for a model with sliding-window layers, every stage
    alike, whether or not its own slice has any. The host and storage tiers keep a page's
    window part with it; PD (tcp or mooncake, any TP sizes) sends the window pages a decode
    needs."""
    return has_windows


def stacked_kv_shape(specs) -> tuple[int, int, torch.dtype]:
    """(num_kv_heads, head_dim, dtype) of a stage's layers from their KV specs
    (model.family.KVSpec, one per layer). The caches stack a stage's layers in one tensor (two
    where window layers keep their own), so every layer must keep the same K/V per token."""
    shapes = sorted({(s.num_kv_heads, s.head_dim, str(s.dtype)) for s in specs})
    if len(shapes) != 1:
        raise ValueError(f"this stage's layers keep K/V of {len(shapes)} shapes ((kv heads, "
                         f"head dim, dtype): {shapes}); the KV cache holds one shape per stage")
    return specs[0].num_kv_heads, specs[0].head_dim, specs[0].dtype


def read_page_blocks(cache, pages: list[int]) -> torch.Tensor:
    """A copy of `pages` of every layer: [2, num_layers, len(pages), *page block]."""
    index = torch.tensor(pages, dtype=torch.long, device=cache.k.device)
    k, v = cache.page_blocks()
    return torch.stack([k.index_select(1, index), v.index_select(1, index)])


def write_page_blocks(cache, pages: list[int], data: torch.Tensor) -> None:
    index = torch.tensor(pages, dtype=torch.long, device=cache.k.device)
    k, v = cache.page_blocks()
    copyable(k).index_copy_(1, index, copyable(data[0].to(k.dtype)))
    copyable(v).index_copy_(1, index, copyable(data[1].to(v.dtype)))


def token_slots(page_table: list[int], start: int, end: int, page_size: int):
    """Cache slots of tokens [start, end): a slice when they are consecutive, else a tensor."""
    if end <= start:
        return slice(0, 0)
    first, last = start // page_size, (end - 1) // page_size
    pages = page_table[first:last + 1]
    if pages[-1] - pages[0] == len(pages) - 1 and _consecutive(pages):
        base = pages[0] * page_size + start % page_size
        return slice(base, base + end - start)
    positions = torch.arange(start, end)
    table = torch.tensor(page_table, dtype=torch.long)
    return table[positions // page_size] * page_size + positions % page_size


def _consecutive(pages: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(pages, pages[1:]))
