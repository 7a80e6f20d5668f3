"""The host tier (L2) of the prefix cache: a second page buffer per stage, separate from the KV
pool (on a GPU the pool is device memory and this is pinned host memory; on a CPU both are DRAM,
kept apart anyway so that the design is the GPU design).

Stage 0 decides every copy (HostDirector): an L1 page evicted from the radix tree is stored to a
host slot instead of being dropped, and a host hit is loaded back into a fresh pool page before
the request's first computed chunk. The decisions travel in the plan (PageOps.cache_ops), so
every stage copies its own layers, in the same order, into slots of the same numbers; all stages
size the tier with host_slots() from the arguments and the partition, never from local memory.
Each stage runs its copies on a background thread (HostTier) and a forward waits only for the
copies that touch its pages.
"""
from __future__ import annotations

import queue
import threading

import torch

from pipefill.kernels.kv_quant import copyable
from pipefill.kv.pool import CACHE_OWNER, PageIntegrityError, PageOwners
from pipefill.kv.window import NO_PAGE
from pipefill.base.plan import CacheOp, CopyKind


def host_slots(enabled: bool, size_gb: float | None, ratio: float, num_pages: int,
               page_size: int, max_stage_layers: int, num_kv_heads: int, head_dim: int,
               itemsize: int) -> int:
    """Host pages per stage, the same number on every stage: --hicache-size GB holds that many
    pages of the largest stage; else --hicache-ratio x the pool's pages."""
    if not enabled:
        return 0
    if size_gb is not None:
        page_bytes = 2 * max_stage_layers * page_size * num_kv_heads * head_dim * itemsize
        return int(size_gb * 2**30) // page_bytes
    return int(ratio * num_pages)


class HostDirector:
    """Stage 0's side: the host slots' free list and the copies the next plan carries. The
    radix tree calls on_evict / on_drop and passes itself (it owns this director)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.ops: list[CacheOp] = []
        self.stored_pages = self.loaded_pages = self.dropped_pages = 0
        self.stored_window_pages = self.loaded_window_pages = 0  # window parts among them

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def on_evict(self, node, tree) -> bool:
        """An L1 node leaves the pool: keep it on the host (copying it unless a copy exists)."""
        if node.host is not None:
            self._store_window_parts(node)
            return True
        n = len(node.pages)
        if len(self._free) < n:
            tree.evict_host(n - len(self._free))
        if len(self._free) < n:
            self._drop_copies_of_pool_pages(n - len(self._free), tree)
        if len(self._free) < n:
            return False
        slots = [self._free.pop() for _ in range(n)]
        # A windowed model's slot keeps the page's window part too, where the tree holds one
        # (ARCHITECTURE.md, 'Window pages'): a hit restored from here reads its window keys.
        window = [-1 if w == NO_PAGE else w for w in node.window or [NO_PAGE] * n]
        self.ops += [CacheOp(CopyKind.STORE, p, s, window_page=w)
                     for p, s, w in zip(node.pages, slots, window)]
        self.stored_pages += n
        self.stored_window_pages += sum(w != -1 for w in window)
        node.host = slots
        node.host_window = [w != -1 for w in window] if node.window is not None else None
        return True

    def _store_window_parts(self, node) -> None:
        """A host copy made before the tree held a window page for its page (the node came
        back from the host without one and a request attached one since) has no window part,
        and its slot is unmarked (node.host_window), so a match counts it as not covering its
        window (KVManager._covered): never a wrong hit, only a recompute. The node leaving
        the pool stores the parts its slots lack now, with the page again (the same tokens'
        K/V: the same bytes), so a later hit reads them (ARCHITECTURE.md, 'Window pages')."""
        if node.window is None:
            return
        marks = node.host_window or [False] * len(node.host)
        ops = [CacheOp(CopyKind.STORE, p, s, window_page=w)
               for p, s, w, held in zip(node.pages, node.host, node.window, marks)
               if not held and w != NO_PAGE]
        self.ops += ops
        self.stored_pages += len(ops)
        self.stored_window_pages += len(ops)
        node.host_window = [held or w != NO_PAGE for held, w in zip(marks, node.window)]

    def _drop_copies_of_pool_pages(self, num_slots: int, tree) -> None:
        """Frees host copies of nodes that are in the pool anyway (nothing is lost; they are
        stored again if evicted later), least recently used first. Not a copy that a load of
        this plan still reads: stages run a plan's stores before its loads."""
        loading = {op.slot for op in self.ops if op.kind is CopyKind.LOAD}
        nodes = sorted((nd for nd in tree.nodes() if nd.pages is not None and nd.host
                        and loading.isdisjoint(nd.host)), key=lambda nd: nd.last_used)
        for nd in nodes:
            if num_slots <= 0:
                break
            self._free += nd.host
            num_slots -= len(nd.host)
            nd.host = nd.host_window = None

    def on_drop(self, node) -> None:
        self._free += node.host
        self.dropped_pages += len(node.host)

    def load(self, node, pages: list[int], window: list[int] | None = None) -> None:
        """Host-only `node` comes back into L1 pool `pages` (already allocated), and its
        slots' window parts into the window pages `window` (NO_PAGE where none)."""
        window = [-1 if w == NO_PAGE else w for w in window or [NO_PAGE] * len(pages)]
        self.ops += [CacheOp(CopyKind.LOAD, p, s, window_page=w)
                     for p, s, w in zip(pages, node.host, window)]
        self.loaded_pages += len(pages)
        self.loaded_window_pages += sum(w != -1 for w in window)

    def drain_ops(self) -> list[CacheOp]:
        ops, self.ops = self.ops, []
        return ops

    def stats(self) -> dict:
        return {"host_slots_total": self.num_slots, "host_slots_used": self.num_used,
                "host_stored_pages": self.stored_pages, "host_loaded_pages": self.loaded_pages,
                "host_dropped_pages": self.dropped_pages,
                "host_stored_window_pages": self.stored_window_pages,
                "host_loaded_window_pages": self.loaded_window_pages}


class HostTier:
    """A stage's host buffer and its copy thread. Copies run in plan order (one FIFO thread);
    `wait_for(pages)` blocks until every copy issued so far that touches those pool pages is
    done, so the forward of other micro-batches overlaps the copies."""

    def __init__(self, cache, num_slots: int):
        self.cache = cache
        k, _ = cache.page_blocks()  # [layers, num_pages, *page]
        # torch.empty: host pages become resident only when something is stored in them.
        self.buf = torch.empty((2, k.shape[0], num_slots, *k.shape[2:]), dtype=k.dtype)
        # A WindowedKVCache's window layers: each slot's window part, by the same slot number.
        self.window_buf = None
        if getattr(cache, "window", None) is not None:  # (AmxKVCache has none)
            wk, _ = cache.window.page_blocks()
            self.window_buf = torch.empty((2, wk.shape[0], num_slots, *wk.shape[2:]),
                                          dtype=wk.dtype)
        self.num_slots = num_slots
        self._queue: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._issued = self._done = 0
        self._latest: dict[int, int] = {}  # pool page -> number of its latest copy
        self._latest_window: dict[int, int] = {}  # window page -> number of its latest copy
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name="host-tier copies", daemon=True).start()

    def store(self, ops: list[CacheOp], owners: PageOwners,
              window_owners: PageOwners | None = None) -> None:
        for op in ops:
            if op.page not in owners.written:
                raise PageIntegrityError(f"host store of page {op.page}, never written")
            if op.window_page != -1 and (window_owners is None or
                                         op.window_page not in window_owners.written):
                raise PageIntegrityError(f"host store of window page {op.window_page}, "
                                         "never written")
        self._issue(CopyKind.STORE, ops)

    def load(self, ops: list[CacheOp], owners: PageOwners,
             window_owners: PageOwners | None = None) -> None:
        for op in ops:
            owners.allocate(CACHE_OWNER, [op.page])
        owners.mark_written([op.page for op in ops])
        window = [op.window_page for op in ops if op.window_page != -1]
        if window:
            if window_owners is None:
                raise PageIntegrityError("a host load of window pages on a stage without them")
            window_owners.allocate(CACHE_OWNER, window)
            window_owners.mark_written(window)
        self._issue(CopyKind.LOAD, ops)

    def _issue(self, kind: CopyKind, ops: list[CacheOp]) -> None:
        if not ops:
            return
        with_window = [op for op in ops if op.window_page != -1]
        with self._cond:
            self._issued += 1
            for op in ops:
                self._latest[op.page] = self._issued
            for op in with_window:
                self._latest_window[op.window_page] = self._issued
        self._queue.put((kind, torch.tensor([op.page for op in ops]),
                         torch.tensor([op.slot for op in ops]),
                         torch.tensor([op.window_page for op in with_window], dtype=torch.long),
                         torch.tensor([op.slot for op in with_window], dtype=torch.long)))

    def _run(self) -> None:
        while True:
            kind, pages, slots, window_pages, window_slots = self._queue.get()
            try:
                _copy(kind, self.cache, self.buf, pages, slots)
                if len(window_pages) and self.window_buf is not None:
                    _copy(kind, self.cache.window, self.window_buf, window_pages, window_slots)
            except BaseException as e:  # noqa: BLE001 - raised in the stage's thread by wait_for
                self.error = e
            with self._cond:
                self._done += 1
                self._cond.notify_all()

    def wait_for(self, pages, window_pages=()) -> None:
        """Until every copy issued so far that touches these pool pages (or window pages) is
        done."""
        with self._cond:
            need = max([self._latest.get(p, 0) for p in pages] +
                       [self._latest_window.get(p, 0) for p in window_pages], default=0)
            self._cond.wait_for(lambda: self._done >= need)
        if self.error is not None:
            raise RuntimeError(f"a host-tier copy failed: {self.error}")

    def stats(self) -> dict:
        return {"host_slots_total": self.num_slots}


def _copy(kind: CopyKind, cache, buf: torch.Tensor, pages: torch.Tensor,
          slots: torch.Tensor) -> None:
    """One batch of copies between a cache's pages and host slots of `buf`."""
    k, v = cache.page_blocks()
    for pool_blocks, host in ((copyable(k), copyable(buf[0])), (copyable(v), copyable(buf[1]))):
        if kind is CopyKind.STORE:
            host.index_copy_(1, slots, pool_blocks.index_select(1, pages))
        else:
            pool_blocks.index_copy_(1, pages, host.index_select(1, slots))
