"""KVManager: the scheduler's page bookkeeping — pool, prefix cache, reservations, and the page
operations the next plan carries to every stage.

A request holds one pool reference per page of its page table and a lock on the deepest
prefix-cache node it uses; with sliding-window layers also one window-pool reference per live
entry of its window table (kv/window.py). Pages it has not allocated yet but was promised at
admission (the rest of its prompt) count against what later admissions and decode growth may
take, so a prompt admitted is a prompt whose prefill never runs out of pages.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipefill.kv.pool import PagePool
from pipefill.kv.storage import chain_page_keys
from pipefill.base.plan import PageOps
from pipefill.kv.radix import Node, RadixCache
from pipefill.kv.window import NO_PAGE, Slide, WindowPages, covered_by, covered_pages, \
    window_before

HOST_WINDOW = 0  # stands for a host copy's window part in a coverage check (any held page)


@dataclass
class CacheCounters:
    hit_tokens: int = 0  # prompt tokens served from the cache (all tiers) at admission
    hit_tokens_host: int = 0  # ... of which loaded from the host tier
    hit_tokens_storage: int = 0  # ... of which fetched from the storage tier
    preemptions: int = 0


@dataclass(eq=False)
class StorageFetch:
    """Stored pages on their way into pool pages for a request that waits: every stage loads
    them with the next plan, and they join the tree only once the plan's result says which
    ones every stage read."""
    tokens: list[int]  # the request's tokens up to the end of the fetched pages
    node: Node  # deepest memory-tier node the fetched pages extend (locked by the fetch)
    cached: list[int]  # pool pages of the path to `node`
    pages: list[int] = field(default_factory=list)  # pool pages being filled (held by us)
    # A windowed model's window pages (held by us) filled with the pages' stored window
    # parts, NO_PAGE where none is fetched; [] without windows.
    window: list[int] = field(default_factory=list)
    request: object = None  # the scheduler's Request that waits for them
    cancelled: bool = False  # the request was aborted meanwhile


class KVManager:
    def __init__(self, pool: PagePool, page_size: int, cache: RadixCache | None = None,
                 window: WindowPages | None = None):
        self.pool = pool
        self.page_size = page_size
        self.cache = cache
        self.window = window  # the sliding-window layers' pages (kv/window.py), or None
        # The tree's lower tiers (pipefill.kv.tiers.build_prefix_cache gives it them).
        self.host = cache.host if cache is not None else None  # HostDirector (L2), or None
        self.storage = cache.storage if cache is not None else None  # StorageDirector (L3)
        self.promised = 0  # pages promised to admitted requests, not yet allocated
        self.counters = CacheCounters()
        self._cached: list[int] = []  # pages the tree adopted since the last plan
        self._new_fetches: list[StorageFetch] = []  # started since the last plan
        self._fetches: dict[int, list[StorageFetch]] = {}  # by the step that carries them

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def available(self) -> int:
        """Pages that can still be handed out: free, or held only by the cache."""
        evictable = self.cache.num_evictable if self.cache is not None else 0
        return self.pool.num_free + evictable - self.promised

    # ---- admission ---------------------------------------------------------------------------

    def cached_prefix_tokens(self, tokens: list[int]) -> int:
        """Tokens of `tokens` the cache could serve (L1 and host tiers), without locking."""
        if self.cache is None or not tokens:
            return 0
        m = self.cache.match(tokens)
        if self.window is not None:
            return self._covered(m) * self.page_size
        return (len(m.pages) + m.num_host_pages) * self.page_size

    def _covered(self, m) -> int:
        """Pages of a match that a windowed model may reuse (kv/window.covered_pages): its
        window pages in the pool, then its host copies that hold a window part."""
        held = m.window + [HOST_WINDOW if h else NO_PAGE for h in m.host_window]
        return covered_pages(held, self.page_size, self.window.window)

    def _match(self, tokens: list[int]):
        """The cache's match of `tokens`, cut where a windowed model's window pages end."""
        m = self.cache.match(tokens)
        if self.window is not None and self._covered(m) < len(m.pages) + m.num_host_pages:
            m = self.cache.match(tokens[:self._covered(m) * self.page_size])
        return m

    def admit(self, r, tokens: list[int], headroom: int) -> bool:
        """Locks the cached prefix of `tokens` (the part r may reuse) and promises the pages of
        the rest of r plus `headroom`; False (and nothing held) when they do not fit. Also
        False while r's prefix is being fetched from storage (r.storage_fetch set: the fetch
        holds its pages and lock until finish_fetches)."""
        if r.storage_fetch is not None:
            return False
        m = self._match(tokens) if self.cache is not None and tokens else None
        node = m.node if m is not None else None
        cached = list(m.pages) if m is not None else []
        if node is not None:
            self.cache.lock(node)
        need = self.pages_for(r.num_tokens) - len(cached)
        if self.available() < need + headroom:
            if node is not None:
                self.cache.unlock(node)
            return False
        if m is not None and m.host_nodes:
            # Only what the match may reuse: a windowed model's is cut where its windows end.
            matched = tokens[:(len(m.pages) + m.num_host_pages) * self.page_size]
            node = self._load_from_host(matched, node)
            m = self.cache.match(matched)
            loaded = m.pages[len(cached):]
            self.counters.hit_tokens_host += len(loaded) * self.page_size
            cached += loaded
            need -= len(loaded)
        if self.storage is not None and node is not None and not r.storage_tried:
            fetch = self._fetch_from_storage(tokens, node, cached, m.window)
            if fetch is not None:
                fetch.request, r.storage_fetch = r, fetch
                return False  # admitted once every stage has the pages (or said it has not)
        r.storage_tried = False  # a later admission (after a preemption) may look again
        self.pool.retain(cached)
        if self.window is not None:
            self.window.admit(r, m.window if m is not None else [])
        r.pages, r.lock_node, r.num_inserted = cached, node, len(cached)
        r.pages_reserved = need
        self.promised += need
        r.num_scheduled = len(cached) * self.page_size
        return True

    def _load_from_host(self, tokens: list[int], locked: Node) -> Node:
        """Brings the host-only part of the match of `tokens` back into pool pages (copies in
        the next plan, before its forward); returns the new deepest locked node. The caller
        checked that the pages fit."""
        m = self.cache.match(tokens)
        need = m.num_host_pages
        if self.pool.num_free < need:
            self.cache.evict(need - self.pool.num_free)  # may drop host leaves: match again
            m = self.cache.match(tokens)
        for host_node in m.host_nodes:
            pages = self.pool.allocate(host_node.num_pages)  # the tree's reference
            window = self._window_for_load(host_node)
            self.host.load(host_node, pages, window)
            self.cache.load(host_node, pages, window)
        node = m.host_nodes[-1] if m.host_nodes else m.node
        if node is not locked:
            self.cache.lock(node)
            self.cache.unlock(locked)
        return node

    def _window_for_load(self, node) -> list[int] | None:
        """A windowed model's window pages (the tree's references) for the slots of a host
        node that hold a window part, NO_PAGE for the others; None without windows."""
        if self.window is None:
            return None
        held = node.host_window or [False] * node.num_pages
        fresh = iter(self.window.pool.allocate(sum(held)))
        return [next(fresh) if h else NO_PAGE for h in held]

    def _fetch_from_storage(self, tokens: list[int], locked: Node, cached: list[int],
                            cached_window: list[int]) -> StorageFetch | None:
        """Starts fetching the pages past the memory tiers that every stage has in storage
        (verified by stage 0) into new pool pages, and a windowed model's window parts of
        the window its hit reads (`cached_window`: the window pages of `cached`); None when
        there are none. The fetch takes over the lock on `locked`."""
        ps, num_cached = self.page_size, len(cached)
        full = len(tokens) // ps
        if full <= num_cached or not self._storage_extends(tokens, num_cached):
            return None
        keys = chain_page_keys(tokens[num_cached * ps:full * ps], ps,
                               self.cache.last_key(locked))
        deadline = self.storage.deadline()
        n = self.storage.verified_prefix(keys, deadline)
        parts: list[bool] = []
        if self.window is not None and n:
            n, parts = self._stored_windows(cached_window, keys[:n], deadline)
        if n == 0:
            return None
        if self.pool.num_free < n:
            self.cache.evict(n - self.pool.num_free)
        if self.pool.num_free < n:
            return None  # the lock on this path keeps what would make room
        fetch = StorageFetch(list(tokens[:(num_cached + n) * ps]), locked, list(cached),
                             self.pool.allocate(n))
        if parts:  # the fetch's references, as a host load's (_window_for_load)
            held = iter(self.window.pool.allocate(sum(parts)))
            fetch.window = [next(held) if p else NO_PAGE for p in parts]
        self.storage.fetch(fetch.pages, keys[:n], fetch.window)
        self._new_fetches.append(fetch)
        return fetch

    def _storage_extends(self, tokens: list[int], num_cached: int) -> bool:
        """Whether the memory tiers hold none of `tokens` past the `num_cached` pages a
        request reuses: a windowed model's match stops where its windows do, and storage
        fills no window part into pages the tree already holds (they are recomputed)."""
        if self.window is None:
            return True
        m = self.cache.match(tokens)
        return len(m.pages) + m.num_host_pages == num_cached

    def _stored_windows(self, cached_window: list[int], keys: list[bytes], deadline: float
                        ) -> tuple[int, list[bool]]:
        """Of the stored pages `keys` past the cached pages (whose window pages are
        `cached_window`), how many a windowed model may reuse, and which of them to fetch
        their window part for: up to the deepest page boundary whose last window is held, in
        the pool or by every stage's storage, and exactly that window's parts (coverage as
        the host tier's: kv/window.covered_pages)."""
        num_cached, known = len(cached_window), {}

        def held(i: int) -> bool:
            if i < num_cached:
                return cached_window[i] != NO_PAGE
            if i not in known:
                known[i] = self.storage.has_window_part(keys[i - num_cached], deadline)
            return known[i]

        ps, window = self.page_size, self.window.window
        n = covered_by(num_cached + len(keys), held, ps, window) - num_cached
        if n <= 0:
            return 0, []
        last = window_before(num_cached + n, ps, window)
        return n, [i in last for i in range(num_cached, num_cached + n)]

    def plan_sent(self, step_id: int) -> None:
        """The fetches started since the previous plan travel with plan `step_id`."""
        if self._new_fetches:
            self._fetches[step_id], self._new_fetches = self._new_fetches, []

    @property
    def has_new_fetches(self) -> bool:
        return bool(self._new_fetches)

    def finish_fetches(self, step_id: int, failed: list[int]) -> None:
        """The plan that carried fetches is back: the pages every stage read, up to the first
        one some stage could not, join the tree (then the request admits them as cached);
        the rest go back to the pool unused on every stage and their tokens are recomputed."""
        bad = set(failed)
        for fetch in self._fetches.pop(step_id, []):
            if not fetch.cancelled:
                self._finish_fetch(fetch, bad)

    def _finish_fetch(self, fetch: StorageFetch, bad: set[int]) -> None:
        good = next((i for i, p in enumerate(fetch.pages) if p in bad), len(fetch.pages))
        if good:
            tokens = fetch.tokens[:(len(fetch.cached) + good) * self.page_size]
            self.cache.insert(tokens, fetch.cached + fetch.pages[:good], from_storage=True)
            if fetch.window:  # the stages own them as the cache's since the fetch
                self.cache.attach_window(tokens, [NO_PAGE] * len(fetch.cached) +
                                         fetch.window[:good], from_storage=True)
            self._cached += self.cache.adopted
            self.cache.adopted = []
            self.counters.hit_tokens_storage += good * self.page_size
        self._drop_fetch(fetch)
        # The next admission takes what the tree now holds and does not look at storage
        # again: a page that failed now would likely fail again.
        fetch.request.storage_fetch, fetch.request.storage_tried = None, True

    def cancel_fetch(self, r) -> None:
        """r left the queue while its pages were being fetched: nobody will use them."""
        if r.storage_fetch is not None:
            r.storage_fetch.cancelled = True
            self._drop_fetch(r.storage_fetch)
            r.storage_fetch = None

    def _drop_fetch(self, fetch: StorageFetch) -> None:
        """Our references go (the tree keeps what it adopted) and so does the lock. Freed pages
        reach the stages with the next plan, after the one that filled them."""
        self.pool.release(fetch.pages)
        if fetch.window:
            self.window.pool.release([p for p in fetch.window if p != NO_PAGE])
        self.cache.unlock(fetch.node)

    # ---- growth ------------------------------------------------------------------------------

    def can_grow(self, r, end: int) -> bool:
        missing = self.pages_for(end) - len(r.pages)
        return missing <= r.pages_reserved or \
            missing - r.pages_reserved <= self.available()

    def grow(self, r, end: int) -> list[int]:
        """Allocates the pages r needs to cover tokens [0, end), evicting cache leaves first;
        the caller made sure they fit (can_grow)."""
        missing = self.pages_for(end) - len(r.pages)
        if missing <= 0:
            return []
        short = missing - self.pool.num_free
        if short > 0:
            self.cache.evict(short)
        new = self.pool.allocate(missing)
        from_promise = min(missing, r.pages_reserved)
        r.pages_reserved -= from_promise
        self.promised -= from_promise
        r.pages += new
        return new

    def slide(self, r, start: int, end: int) -> Slide | None:
        """A windowed model's window pages for r's tokens [start, end), and its window pages
        no query from `start` on reads freed (kv/window.py); None without windows."""
        if self.window is None:
            return None
        return self.window.slide(r, start, end, len(r.prompt_ids))

    def admit_received(self, r) -> None:
        """A windowed model's window pages for a prompt whose KV comes from elsewhere (PD
        decode; kv/window.py)."""
        if self.window is not None:
            self.window.admit_received(r)

    def insert(self, r, tokens_upto, end: int) -> None:
        """Puts r's whole pages of tokens [0, end) into the cache as soon as their chunk is
        scheduled (see RadixCache.insert for why that is safe) and moves r's lock down."""
        full = end // self.page_size
        if self.cache is None or full <= r.num_inserted:
            return
        node = self.cache.insert(tokens_upto(full * self.page_size), r.pages[:full])
        self._cached += self.cache.adopted
        self.cache.adopted = []
        if node is not r.lock_node:
            self.cache.lock(node)
            if r.lock_node is not None:
                self.cache.unlock(r.lock_node)
            r.lock_node = node
        r.num_inserted = full

    def release(self, r) -> None:
        """Drops r's references and lock (its cached pages stay in the tree, unlocked)."""
        if self.window is not None:
            self.window.release(r, self.cache, r.tokens_upto)
        if r.lock_node is not None:
            self.cache.unlock(r.lock_node)
        self.pool.release(r.pages)
        self.promised -= r.pages_reserved
        r.pages, r.pages_reserved, r.lock_node, r.num_inserted = [], 0, None, 0

    # ---- pages lent to scratch work outside any plan (chunking.policy.PageLender) -----------

    def borrow(self, n: int) -> list[int] | None:
        """n free pages that no admitted request was promised, or None. Also None while a copy
        to the host or storage tier queued for the next plan may still read a free page
        (evicted ones): the borrower writes its pages before that plan runs."""
        tier_ops = any(t is not None and t.ops for t in (self.host, self.storage))
        if tier_ops or self.pool.num_free - self.promised < n:
            return None
        if self.window is not None:
            return self.window.borrow_common(self.pool, n)
        return self.pool.borrow(n)

    def give_back(self, pages: list[int]) -> None:
        self.pool.give_back(pages)
        if self.window is not None:
            self.window.give_back(pages)

    def on_stop(self) -> None:
        """A clean stop: under write_back the cache's pages in the pool were never saved."""
        if self.storage is not None:
            self.storage.on_stop(self.cache.nodes())

    # ---- what the next plan carries ----------------------------------------------------------

    def drain_ops(self) -> PageOps:
        ops = PageOps(freed=self.pool.drain_freed(), cached=self._cached)
        self._cached = []
        if self.window is not None:
            ops.window_freed, ops.window_cached = self.window.drain()
        if self.host is not None:
            ops.cache_ops += self.host.drain_ops()
        if self.storage is not None:
            ops.cache_ops += self.storage.drain_ops()
        return ops

    def stats(self) -> dict:
        c = self.counters
        out = {"cache_hit_tokens": c.hit_tokens, "cache_hit_tokens_host": c.hit_tokens_host,
               "cache_hit_tokens_storage": c.hit_tokens_storage,
               "preemptions": c.preemptions,
               "cache_pages": self.cache.num_pages if self.cache is not None else 0,
               "cache_evictable_pages": self.cache.num_evictable if self.cache else 0,
               "cache_evicted_pages": self.cache.num_evicted_pages if self.cache else 0}
        if self.host is not None:
            out.update(self.host.stats())
        if self.storage is not None:
            out.update(self.storage.stats())
        if self.window is not None:
            out.update(self.window.stats(self.cache))
        return out
