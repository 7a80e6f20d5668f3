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
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from pipefill.kv.pool import CACHE_OWNER
from pipefill.base.plan import CacheOp, CopyKind
from pipefill.kv.storage import model_fingerprint, open_page_store, stage_key_suffix

log = logging.getLogger(__name__)

_FETCH_BATCH = 64  # pages packed per write_pages call: ~100 MB of buffer for a 1.5 MB page


class StorageTier:
    """A stage's PageStore and the copies between it and the pool."""

    def __init__(self, store, cache, rank: int, fingerprint: str):
        self.store = store
        self.cache = cache
        self.rank = rank
        self.fingerprint = fingerprint

    def save(self, ops: list[CacheOp]) -> None:
        """Pool pages -> storage (asynchronous: the store copies and writes in the background)."""
        if ops:
            pages = self.cache.read_pages([op.page for op in ops])  # [2, L, n, ps, H, D]
            for i, op in enumerate(ops):
                self.store.put(bytes.fromhex(op.key), pages[:, :, i])

    def fetch(self, ops: list[CacheOp], owners) -> list[int]:
        """Storage -> pool pages; returns the pages that could not be read or failed their
        checksum. Stage 0 verified every stage's copy, but a page can still go in between
        (evicted by another server sharing the folder, damaged): such a page is reported back
        to stage 0 with the plan's result and freed unused, on every stage. Pages are read
        into one buffer and packed with one write_pages per _FETCH_BATCH pages (per-page
        packing was most of an L3 hit's load time)."""
        if not ops:
            return []
        owners.allocate(CACHE_OWNER, [op.page for op in ops])
        L, ps, H, D = self.cache.k.shape[0], self.cache.page_size, *page_dims(self.cache)
        failed = []
        for start in range(0, len(ops), _FETCH_BATCH):
            batch = ops[start:start + _FETCH_BATCH]
            # [n, 2, L, ps, H, D]: each page is a contiguous block the store reads straight in.
            buf = torch.empty((len(batch), 2, L, ps, H, D), dtype=self.cache.k.dtype)
            for i, op in enumerate(batch):
                if not self.store.get(bytes.fromhex(op.key), buf[i]):
                    failed.append(op.page)
                    buf[i].zero_()  # never read (freed unused), but no stale bytes either
            self.cache.write_pages([op.page for op in batch], buf.permute(1, 2, 0, 3, 4, 5))
        owners.mark_written([op.page for op in ops])
        if failed:
            log.warning("stage %d: %d stored page(s) could not be read after stage 0 verified "
                        "them (removed or damaged since); their tokens are recomputed",
                        self.rank, len(failed))
        return failed

    def stats(self) -> dict:
        st = self.store.stats()
        return {"storage_" + k: v for k, v in st.items() if isinstance(v, (int, float))}


class StorageDirector:
    """Stage 0's side: which pages to save and which stored pages a request may use."""

    def __init__(self, tier: StorageTier, suffixes: list[str], shapes: list[tuple[int, ...]],
                 dtype: torch.dtype, write_policy: str, prefetch_timeout_s: float):
        self.tier = tier
        self.suffixes = suffixes  # every stage's key suffix, by rank
        self.shapes = shapes  # every stage's page shape [2, L_s, ps, H, D]
        self.dtype = dtype
        self.write_through = write_policy == "write_through"
        self.prefetch_timeout_s = prefetch_timeout_s
        self.ops: list[CacheOp] = []
        self.saved_pages = self.fetched_pages = 0

    # ---- writes ------------------------------------------------------------------------------

    def on_adopt(self, pages: list[int], keys: list[bytes]) -> None:
        if self.write_through:
            self._save(CopyKind.SAVE, pages, keys)

    def on_evict(self, node) -> None:
        """A node leaves the pool (write_back saves it now, before its pages are freed)."""
        if not self.write_through and node.keys:
            self._save(CopyKind.SAVE_EVICTED, node.pages, node.keys)

    def on_stop(self, nodes) -> None:
        """write_back at a clean stop: every page still in the pool is saved now, as if it were
        evicted, so that a restart on the same storage finds it (pages stored before are
        skipped by the store)."""
        if self.write_through:
            return
        for node in nodes:
            if node.pages is not None:
                self.on_evict(node)

    def _save(self, kind: CopyKind, pages: list[int], keys: list[bytes]) -> None:
        self.ops += [CacheOp(kind, p, -1, k.hex()) for p, k in zip(pages, keys)]
        self.saved_pages += len(pages)

    # ---- reads -------------------------------------------------------------------------------

    def verified_prefix(self, keys: list[bytes]) -> int:
        """Leading keys whose page every stage can read (each verified by a full, checksummed
        read), within the prefetch timeout. Through PageStore.contains/get only: they never
        raise (an unreadable file of any stage is a miss, stage 0's scheduler goes on) and
        they see pages still queued for writing."""
        deadline = time.monotonic() + self.prefetch_timeout_s
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

    def fetch(self, pages: list[int], keys: list[bytes]) -> None:
        self.ops += [CacheOp(CopyKind.FETCH, p, -1, k.hex()) for p, k in zip(pages, keys)]
        self.fetched_pages += len(pages)

    def drain_ops(self) -> list[CacheOp]:
        ops, self.ops = self.ops, []
        return ops

    def stats(self) -> dict:
        return {"storage_saved_pages": self.saved_pages,
                "storage_fetched_pages": self.fetched_pages, **self.tier.stats()}


def page_dims(cache) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of a stage's cache, whichever layout it has (the packed
    AmxKVCache names them; KVCache's k is [L, slots, H, D])."""
    if hasattr(cache, "num_kv_heads"):
        return cache.num_kv_heads, cache.head_dim
    return cache.k.shape[2], cache.k.shape[3]


def open_stage_storage(args, model_file: str, cache, layers: range, rank: int) -> StorageTier:
    """This stage's PageStore, keyed by the model, KV dtype, page size and its layers."""
    fingerprint = model_fingerprint(model_file)
    suffix = stage_key_suffix(fingerprint, cache.k.dtype, args.page_size, layers)
    cap = args.hicache_storage_max_gb
    store = open_page_store(args.hicache_storage_backend, key_suffix=suffix,
                            storage_dir=args.hicache_storage_dir,
                            storage_max_bytes=None if cap is None else int(cap * 2**30),
                            mooncake_master=args.hicache_mooncake_master)
    return StorageTier(store, cache, rank, fingerprint)


def storage_director(args, tier: StorageTier, partition: Sequence[range]) -> StorageDirector:
    """Stage 0's director, with every stage's key suffix and page shape (from the partition:
    all stages' keys are known without asking them; every stage has stage 0's heads)."""
    dtype = tier.cache.k.dtype
    suffixes = [stage_key_suffix(tier.fingerprint, dtype, args.page_size, r) for r in partition]
    shapes = [(2, len(r), args.page_size, *page_dims(tier.cache)) for r in partition]
    return StorageDirector(tier, suffixes, shapes, dtype, args.hicache_write_policy,
                           args.hicache_prefetch_timeout)
