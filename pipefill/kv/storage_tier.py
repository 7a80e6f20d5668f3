"""The storage tier (L3) of the prefix cache in the pipeline: pipefill.kv.storage's PageStore on
every stage, driven by stage 0's plans like the host tier.

Keys are chained per page (pipefill.kv.storage.chain_page_keys) and kept on the radix nodes;
each stage adds its own suffix (model fingerprint, dtype, page size, its layers), so each stage
stores and loads only its layers. Stage 0 decides every write and every read:

* writes: `write_through` saves a page when the tree takes it (after the forward that writes
  it); `write_back` saves it when it is evicted from the pool (L1), whether or not the host
  tier keeps a copy (the pool page is read before it is freed), and at a clean stop.
* reads: at admission, the pages past the L1/L2 match are looked up. A page is used only when
  stage 0 has read and verified it for EVERY stage (each stage's file/object, checksummed), so
  that a missing, corrupt or truncated page on any stage is a miss for all, never a different
  answer; the lookup stops at the first miss or when --hicache-prefetch-timeout runs out (the
  rest is recomputed). The plan then carries one fetch per page and every stage loads its own.
* a page can still go between stage 0's verification and a stage's fetch (another server's
  eviction, damage). So a fetch is a round trip before use: the request waits while the plan
  with the fetches goes through every stage, each stage reports the pages it could not read
  in the plan's result, and only then does stage 0 put the pages every stage read into the
  tree (up to the first failed one) and admit the request, which recomputes the rest. No
  forward ever reads a fetched page before every stage has it, so the stages cannot disagree.
* window parts (ARCHITECTURE.md, 'Window pages'): where the window layers keep pages of their
  own, a stage with window layers stores a page's window part under a key of its own (its
  suffix's '.w'), saved when the tree holds it (an evicted node's window pages with it under
  write_back; under write_through when the tree takes them, which is after the page itself).
  A stored prefix is used up to the deepest page boundary whose last window every stage can
  read, in the tree or in storage, and its fetch brings exactly that window's parts.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from pipefill.kv.pool import CACHE_OWNER, PageIntegrityError
from pipefill.base.plan import CacheOp, CopyKind
from pipefill.kv.storage import model_fingerprint, open_page_store, stage_part_suffixes
from pipefill.kv.window import NO_PAGE

log = logging.getLogger(__name__)

_FETCH_BATCH = 64  # pages packed per write_pages call: ~100 MB of buffer for a 1.5 MB page


class StorageTier:
    """A stage's PageStore and the copies between it and the pool (and the window pool)."""

    def __init__(self, store, cache, rank: int, fingerprint: str,
                 window_suffix: str | None = None):
        self.store = store
        self.cache = cache
        self.rank = rank
        self.fingerprint = fingerprint
        # The suffix of this stage's window parts; None where it keeps none (module doc).
        self.window_suffix = window_suffix

    def save(self, ops: list[CacheOp]) -> None:
        """Pool pages -> storage, and the window parts the ops name (asynchronous: the store
        copies and writes in the background). SAVE_WINDOW saves the window part only."""
        whole = [op for op in ops if op.kind is not CopyKind.SAVE_WINDOW]
        if whole:
            pages = self.cache.read_pages([op.page for op in whole])  # [2, L, n, ps, H, D]
            for i, op in enumerate(whole):
                self.store.put(bytes.fromhex(op.key), pages[:, :, i])
        parts = [op for op in ops if op.window_page != -1]
        if parts and self.window_suffix is not None:
            window = self.cache.window.read_pages([op.window_page for op in parts])
            for i, op in enumerate(parts):
                self.store.put(bytes.fromhex(op.key), window[:, :, i], self.window_suffix)

    def fetch(self, ops: list[CacheOp], owners, window_owners=None) -> list[int]:
        """Storage -> pool pages (and window parts -> the window pages the ops name); returns
        the pages that could not be read or failed their checksum, a page whose window part
        failed among them. Stage 0 verified every stage's copy, but a page can still go in
        between (evicted by another server sharing the folder, damaged): such a page is
        reported back to stage 0 with the plan's result and freed unused, on every stage."""
        if not ops:
            return []
        owners.allocate(CACHE_OWNER, [op.page for op in ops])
        failed = [ops[i].page for i in self._read(self.cache, ops, [op.page for op in ops])]
        owners.mark_written([op.page for op in ops])
        parts = [op for op in ops if op.window_page != -1]
        if parts:
            if window_owners is None:
                raise PageIntegrityError("a storage fetch of window parts on a stage without "
                                         "window pages")
            window = [op.window_page for op in parts]
            window_owners.allocate(CACHE_OWNER, window)
            if self.window_suffix is not None:  # a stage without window layers reads none
                failed += [parts[i].page for i in
                           self._read(self.cache.window, parts, window, self.window_suffix)]
            window_owners.mark_written(window)
        if failed:
            log.warning("stage %d: %d stored page(s) could not be read after stage 0 verified "
                        "them (removed or damaged since); their tokens are recomputed",
                        self.rank, len(set(failed)))
        return failed

    def _read(self, cache, ops: list[CacheOp], pages: list[int],
              suffix: str | None = None) -> list[int]:
        """Reads the stored pages of `ops` (under `suffix`; None: the store's own) into
        `pages` of `cache`; returns the indices of the ops that failed. Pages are read into
        one buffer and packed with one write_pages per _FETCH_BATCH pages (per-page packing
        was most of an L3 hit's load time)."""
        L, ps, H, D = cache.k.shape[0], cache.page_size, *page_dims(cache)
        failed = []
        for start in range(0, len(ops), _FETCH_BATCH):
            batch = ops[start:start + _FETCH_BATCH]
            # [n, 2, L, ps, H, D]: each page is a contiguous block the store reads straight in.
            buf = torch.empty((len(batch), 2, L, ps, H, D), dtype=cache.k.dtype)
            for i, op in enumerate(batch):
                if not self.store.get(bytes.fromhex(op.key), buf[i], key_suffix=suffix):
                    failed.append(start + i)
                    buf[i].zero_()  # never read (freed unused), but no stale bytes either
            cache.write_pages(pages[start:start + len(batch)], buf.permute(1, 2, 0, 3, 4, 5))
        return failed

    def stats(self) -> dict:
        st = self.store.stats()
        return {"storage_" + k: v for k, v in st.items() if isinstance(v, (int, float))}


class StorageDirector:
    """Stage 0's side: which pages to save and which stored pages a request may use."""

    def __init__(self, tier: StorageTier, suffixes: list[str], shapes: list[tuple[int, ...]],
                 dtype: torch.dtype, write_policy: str, prefetch_timeout_s: float,
                 window_parts: Sequence[tuple[str, tuple[int, ...]]] = ()):
        self.tier = tier
        self.suffixes = suffixes  # every stage's key suffix, by rank
        self.shapes = shapes  # every stage's page shape [2, L_s, ps, H, D]
        # (suffix, shape) of the window part of every stage that stores one (module doc).
        self.window_parts = list(window_parts)
        self.dtype = dtype
        self.write_through = write_policy == "write_through"
        self.prefetch_timeout_s = prefetch_timeout_s
        self.ops: list[CacheOp] = []
        self.saved_pages = self.fetched_pages = 0
        self.saved_window_pages = self.fetched_window_pages = 0  # window parts

    # ---- writes ------------------------------------------------------------------------------

    def on_adopt(self, pages: list[int], keys: list[bytes]) -> None:
        if self.write_through:
            self._save(CopyKind.SAVE, pages, keys)

    def on_evict(self, node) -> None:
        """A node leaves the pool (write_back saves it now, before its pages are freed, with
        the window parts it holds)."""
        if not self.write_through and node.keys:
            self._save(CopyKind.SAVE_EVICTED, node.pages, node.keys, node.window)

    def on_window(self, pages: list[int], keys: list[bytes], window: list[int]) -> None:
        """The tree took window pages for its `pages` (write_through saves them now; write_back
        with their node)."""
        if self.write_through and self.window_parts:
            self.ops += [CacheOp(CopyKind.SAVE_WINDOW, p, -1, k.hex(), window_page=w)
                         for p, k, w in zip(pages, keys, window)]
            self.saved_window_pages += len(window)

    def on_stop(self, nodes) -> None:
        """write_back at a clean stop: every page still in the pool is saved now, as if it were
        evicted, so that a restart on the same storage finds it (pages stored before are
        skipped by the store)."""
        if self.write_through:
            return
        for node in nodes:
            if node.pages is not None:
                self.on_evict(node)

    def _save(self, kind: CopyKind, pages: list[int], keys: list[bytes],
              window: list[int] | None = None) -> None:
        window = _window_pages(window if self.window_parts else None, len(pages))
        self.ops += [CacheOp(kind, p, -1, k.hex(), window_page=w)
                     for p, k, w in zip(pages, keys, window)]
        self.saved_pages += len(pages)
        self.saved_window_pages += sum(w != -1 for w in window)

    # ---- reads -------------------------------------------------------------------------------

    def deadline(self) -> float:
        """When a lookup that starts now must stop reading (--hicache-prefetch-timeout)."""
        return time.monotonic() + self.prefetch_timeout_s

    def verified_prefix(self, keys: list[bytes], deadline: float | None = None) -> int:
        """Leading keys whose page every stage can read (each verified by a full, checksummed
        read), within the prefetch timeout. Through PageStore.contains/get only: they never
        raise (an unreadable file of any stage is a miss, stage 0's scheduler goes on) and
        they see pages still queued for writing."""
        deadline = self.deadline() if deadline is None else deadline
        scratch = [torch.empty(s, dtype=self.dtype) for s in self.shapes]
        store = self.tier.store
        # Existence first for every stage (cheap): verification reads stop at the first gap.
        limit = len(keys)
        for suffix in self.suffixes:
            limit = min(limit, store.contains(keys[:limit], key_suffix=suffix))
        n = 0
        for key in keys[:limit]:
            if time.monotonic() > deadline:
                break
            if not all(store.get(key, out, key_suffix=suffix)
                       for suffix, out in zip(self.suffixes, scratch)):
                break
            n += 1
        return n

    def has_window_part(self, key: bytes, deadline: float) -> bool:
        """Whether every stage that stores window parts can read this page's (verified by a
        full, checksummed read) before `deadline`; never raises."""
        if time.monotonic() > deadline:
            return False
        return all(self.tier.store.get(key, torch.empty(shape, dtype=self.dtype),
                                       key_suffix=suffix)
                   for suffix, shape in self.window_parts)

    def fetch(self, pages: list[int], keys: list[bytes], window: list[int] | None = None) -> None:
        """Every stage reads these pages, and the window parts into the window pages `window`
        names (NO_PAGE where none)."""
        window = _window_pages(window, len(pages))
        self.ops += [CacheOp(CopyKind.FETCH, p, -1, k.hex(), window_page=w)
                     for p, k, w in zip(pages, keys, window)]
        self.fetched_pages += len(pages)
        self.fetched_window_pages += sum(w != -1 for w in window)

    def drain_ops(self) -> list[CacheOp]:
        ops, self.ops = self.ops, []
        return ops

    def stats(self) -> dict:
        return {"storage_saved_pages": self.saved_pages,
                "storage_fetched_pages": self.fetched_pages,
                "storage_saved_window_pages": self.saved_window_pages,
                "storage_fetched_window_pages": self.fetched_window_pages, **self.tier.stats()}


def _window_pages(window: list[int] | None, n: int) -> list[int]:
    """A CacheOp's window_page for each of n pages: -1 where none (or no window list)."""
    return [-1 if w == NO_PAGE else w for w in window or [NO_PAGE] * n]


def page_dims(cache) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of a stage's cache, whichever layout it has (the packed
    AmxKVCache names them; KVCache's k is [L, slots, H, D])."""
    if hasattr(cache, "num_kv_heads"):
        return cache.num_kv_heads, cache.head_dim
    return cache.k.shape[2], cache.k.shape[3]


def open_stage_storage(args, model_file: str, cache, layers: range, rank: int) -> StorageTier:
    """This stage's PageStore, keyed by the model, KV dtype, page size and its layers (and
    whether they are its window layers: module doc)."""
    fingerprint = model_fingerprint(model_file)
    suffix, window_suffix = stage_part_suffixes(fingerprint, cache.k.dtype, args.page_size,
                                                layers, num_window_layers(cache))
    cap = args.hicache_storage_max_gb
    store = open_page_store(args.hicache_storage_backend, key_suffix=suffix,
                            storage_dir=args.hicache_storage_dir,
                            storage_max_bytes=None if cap is None else int(cap * 2**30),
                            mooncake_master=args.hicache_mooncake_master)
    return StorageTier(store, cache, rank, fingerprint, window_suffix)


def num_window_layers(cache) -> int | None:
    """The layers of a stage's cache that keep window pages (kv.cache.WindowedKVCache); None
    where every layer keeps every token."""
    return sum(cache.windowed) if getattr(cache, "window", None) is not None else None


def storage_director(args, tier: StorageTier, partition: Sequence[range],
                     window_layers: Sequence[int] | None = None) -> StorageDirector:
    """Stage 0's director, with every stage's key suffix and page shape (from the partition:
    all stages' keys are known without asking them; every stage has stage 0's heads), and
    where the window layers keep pages of their own, each stage's number of them
    (`window_layers`) for the window parts' suffixes and shapes."""
    dtype = tier.cache.k.dtype
    dims = page_dims(tier.cache)
    suffixes, shapes, window_parts = [], [], []
    for i, r in enumerate(partition):
        num_window = None if window_layers is None else window_layers[i]
        suffix, window_suffix = stage_part_suffixes(tier.fingerprint, dtype, args.page_size, r,
                                                    num_window)
        suffixes.append(suffix)
        shapes.append((2, len(r) - (num_window or 0), args.page_size, *dims))
        if window_suffix is not None:
            window_parts.append((window_suffix, (2, num_window, args.page_size, *dims)))
    return StorageDirector(tier, suffixes, shapes, dtype, args.hicache_write_policy,
                           args.hicache_prefetch_timeout, window_parts)
