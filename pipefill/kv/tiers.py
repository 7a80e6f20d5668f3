"""One stage's KV beyond its tensors, built in one place (ARCHITECTURE.md, 'The KV room').

Every stage has a StageKV: the page owners it replays from the plans, and its host tier (L2)
and storage tier (L3) when they are on. The executor calls it before and after each forward
and at stop; the kinds of copies (pipefill.base.plan.CopyKind) are known here only.

Stage 0 also builds the prefix cache (build_prefix_cache): the radix tree with the directors
of the same tiers, which decide the copies that the plans carry to every stage.

The builders take the layer ranges from the caller (the stage's own, the largest stage's
size, every stage's for stage 0's storage keys), so that all stages size their tiers alike
without asking each other.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from pipefill.base.plan import CopyKind, PageOps
from pipefill.config import ServerArgs
from pipefill.kv.host import HostDirector, HostTier, host_slots
from pipefill.kv.pool import PagePool, PageOwners
from pipefill.kv.radix import RadixCache
from pipefill.kv.storage_tier import StorageTier, open_stage_storage, page_dims, \
    storage_director

log = logging.getLogger(__name__)

_HOST_KINDS = {CopyKind.STORE, CopyKind.LOAD}
_STORAGE_KINDS = {CopyKind.SAVE, CopyKind.SAVE_EVICTED, CopyKind.SAVE_WINDOW, CopyKind.FETCH}


class StageKV:
    """A stage's page ownership replay and its cache tiers, driven by stage 0's page ops."""

    def __init__(self, cache, host: HostTier | None = None, storage: StorageTier | None = None):
        self.cache = cache
        self.host = host
        self.storage = storage
        # Every stage replays stage 0's page decisions and checks each micro-batch against them.
        self.owners = PageOwners(cache.num_pages)
        # The window layers' own pool, where they keep pages of their own (kv/window.py).
        # Its ids are the other pool's (kv/window.py).
        window = getattr(cache, "window", None)
        self.window_owners = PageOwners(cache.num_pages) if window is not None else None
        self._failed_fetches: list[int] = []  # since the last take_failed_fetches()

    def before_forward(self, ops: PageOps, seqs=()) -> None:
        """Tier copies, frees, allocations, the ownership check of every sequence (writes by
        the owner only, reads of written pages only), then a wait for the host copies that
        touch the sequences' pages. Copies that read a page this plan may free and hand out
        again go first (saves of evicted pages and of window parts, host stores), copies that
        fill pages it allocates go after the frees (host loads, storage fetches); the host copy
        thread keeps that order for the data."""
        by_kind = self._by_kind(ops)
        if self.storage is not None:
            self.storage.save(by_kind.get(CopyKind.SAVE_EVICTED, []) +
                              by_kind.get(CopyKind.SAVE_WINDOW, []))
        if self.host is not None:
            self.host.store(by_kind.get(CopyKind.STORE, []), self.owners, self.window_owners)
        self.owners.free(ops.freed)
        if self.window_owners is not None:
            self.window_owners.to_cache(ops.window_cached)
            self.window_owners.free(ops.window_freed)
        if self.host is not None:
            self.host.load(by_kind.get(CopyKind.LOAD, []), self.owners, self.window_owners)
        if self.storage is not None:
            self._failed_fetches += self.storage.fetch(by_kind.get(CopyKind.FETCH, []),
                                                       self.owners, self.window_owners)
        self.owners.replay([], seqs, self.cache.page_size)
        if self.window_owners is not None:
            self.window_owners.replay_window(seqs, self.cache.page_size)
        if seqs:  # the forward overlaps the copies of other pages
            self.wait_for({p for w in seqs for p in w.page_table},
                          {p for w in seqs for p in w.window_table or ()})

    def wait_for(self, pages, window_pages=()) -> None:
        """Until every host-tier copy issued so far that touches these pool pages (or window
        pages) is done."""
        if self.host is not None:
            self.host.wait_for(set(pages), set(window_pages))

    def after_forward(self, ops: PageOps) -> None:
        """Pages the cache took over, and write-through saves of them."""
        if self.storage is not None:
            self.storage.save([op for op in ops.cache_ops if op.kind is CopyKind.SAVE])
        self.owners.to_cache(ops.cached)

    def without_forward(self, ops: PageOps) -> None:
        """Page ops that travel without a forward (control messages, storage fetches for a
        request that waits)."""
        self.before_forward(ops)
        self.after_forward(ops)

    def _by_kind(self, ops: PageOps) -> dict[CopyKind, list]:
        by_kind: dict[CopyKind, list] = {}
        for op in ops.cache_ops:
            by_kind.setdefault(op.kind, []).append(op)
        if (by_kind.keys() & _HOST_KINDS and self.host is None) or \
                (by_kind.keys() & _STORAGE_KINDS and self.storage is None):
            raise RuntimeError(f"a plan carries {sorted(k.value for k in by_kind)} copies but "
                               "this stage has no such cache tier")
        return by_kind

    def take_failed_fetches(self) -> list[int]:
        """Pages whose storage fetch failed here since the last call (for the plan's result)."""
        failed, self._failed_fetches = self._failed_fetches, []
        return failed

    def close(self) -> None:
        """At stop: pending storage writes reach the storage before the process ends."""
        if self.storage is not None:
            self.storage.store.close()

    def stats(self) -> dict:
        out = {}
        for tier in (self.host, self.storage):
            if tier is not None:
                out.update(tier.stats())
        return out


def stage_host_slots(args: ServerArgs, cache, max_stage_layers: int) -> int:
    """Host pages per stage, the same number on every stage (sized for the largest stage)."""
    if args.disable_radix_cache:
        return 0
    num_kv_heads, head_dim = page_dims(cache)
    return host_slots(args.enable_hierarchical_cache, args.hicache_size, args.hicache_ratio,
                      cache.num_pages, args.page_size, max_stage_layers, num_kv_heads, head_dim,
                      cache.k.dtype.itemsize)


def build_stage_kv(args: ServerArgs, cache, model_file: str, rank: int, layers: range,
                   max_stage_layers: int) -> StageKV:
    """The StageKV of stage `rank` (its `layers`) over its cache, with the tiers the arguments
    turn on (the host tier sized for a stage of max_stage_layers); logs which cache tiers it
    runs and their sizes."""
    slots = stage_host_slots(args, cache, max_stage_layers)
    host = HostTier(cache, slots) if slots else None
    storage = None
    if args.hicache_storage_backend and not args.disable_radix_cache:
        storage = open_stage_storage(args, model_file, cache, layers, rank)
    _log_tiers(args, cache, rank, slots)
    return StageKV(cache, host, storage)


def build_prefix_cache(args: ServerArgs, pool: PagePool, kv: StageKV,
                       partition: Sequence[range], window_pool: PagePool | None = None,
                       window_layers: Sequence[int] | None = None) -> RadixCache | None:
    """Stage 0's radix tree over `pool` (and the window layers' `window_pool`, where they keep
    pages of their own: `window_layers` counts them on each stage) with the directors of
    stage 0's tiers (`kv`), or None when the prefix cache is off."""
    if args.disable_radix_cache:
        return None
    host = HostDirector(kv.host.num_slots) if kv.host is not None else None
    storage = None
    if kv.storage is not None:
        storage = storage_director(args, kv.storage, partition,
                                   window_layers if window_pool is not None else None)
    return RadixCache(args.page_size, pool, host, storage, window_pool)


def _log_tiers(args: ServerArgs, cache, rank: int, slots: int) -> None:
    l3 = "off"
    if args.hicache_storage_backend and not args.disable_radix_cache:
        l3 = (f"{args.hicache_storage_backend} ({args.hicache_write_policy}, "
              f"{args.hicache_storage_dir or args.hicache_mooncake_master})")
    k, _ = cache.page_blocks()
    page_bytes = 2 * k[:, 0].numel() * k.dtype.itemsize  # every layer's (none: 0)
    if getattr(cache, "window", None) is not None:  # a slot keeps the window part too
        wk, _ = cache.window.page_blocks()
        page_bytes += 2 * wk[:, 0].numel() * wk.dtype.itemsize
    l1 = "off" if args.disable_radix_cache else f"on ({cache.num_pages} pool pages)"
    l2 = f"{slots} host pages, {slots * page_bytes / 2**30:.2f} GiB" if slots else "off"
    log.info("stage %d: prefix cache L1 %s, L2 %s, L3 %s", rank, l1, l2, l3)
