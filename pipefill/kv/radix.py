"""RadixCache: the prefix cache on stage 0, a radix tree over runs of whole KV pages.

A node holds a run of whole pages keyed by their token ids (len(key) == len(pages) * page_size);
children are keyed by the token ids of their first page, so two children never share a first
page and a longest-prefix match is one walk from the root. The partial last page of a sequence
is never in the tree (it is still being written).

Pages live in up to two tiers: `pages` are pool (L1) page ids, `host` are host-tier (L2) slots.
L1 pages along any root path form a prefix (eviction takes L1 leaves only), so a match is an
L1 part followed by a host-only part that must be loaded before use.

References: the tree holds one pool reference on each of its L1 pages; a request holds its own
reference on every page of its page table and a lock on the deepest tree node it uses, which
pins the whole path to the root. Unlocked nodes are evictable, least recently used first.

A model with sliding-window layers gives the tree its window pool: a node's `window` lists the
window layers' page of each of its pages, or NO_PAGE where none is held (kv/window.py); the
tree holds one window-pool reference on each, and an evicted page's window page goes with it.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from pipefill.kv.host import HostDirector
from pipefill.kv.pool import PagePool
from pipefill.kv.storage import chain_page_keys
from pipefill.kv.storage_tier import StorageDirector
from pipefill.kv.window import NO_PAGE


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]  # token ids, a whole number of pages
    pages: list[int] | None  # L1 page ids, one per page; None when only on the host
    parent: "Node | None" = None
    host: list[int] | None = None  # L2 slots, one per page, when a host copy exists
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    lock: int = 0  # requests whose path goes through this node
    last_used: int = 0
    keys: list[bytes] | None = None  # chained storage keys, one per page (with a storage tier)
    window: list[int] | None = None  # window-pool pages, one per page (with a window pool)
    # Per host slot: whether its copy holds the window layers' part too (with a window pool).
    host_window: list[bool] | None = None

    @property
    def num_pages(self) -> int:
        return len(self.pages) if self.pages is not None else len(self.host or ())


@dataclass
class Match:
    node: Node  # deepest node whose pages are all in L1 (the root when nothing matched)
    pages: list[int]  # L1 pages of the matched prefix, in order
    host_nodes: list[Node] = field(default_factory=list)  # after `node`: on the host only
    window: list[int] = field(default_factory=list)  # window pages of `pages` (window pool)
    host_window: list[bool] = field(default_factory=list)  # of host_nodes' pages, in order

    @property
    def num_host_pages(self) -> int:
        return sum(n.num_pages for n in self.host_nodes)


class RadixCache:
    def __init__(self, page_size: int, pool: PagePool, host: HostDirector | None = None,
                 storage: StorageDirector | None = None, window_pool: PagePool | None = None):
        self.page_size = page_size
        self.pool = pool
        self.window_pool = window_pool  # the window layers' pages (kv/window.py), or None
        # The lower tiers' directors, owned by the tree (ARCHITECTURE.md, 'The KV room'): the
        # host tier (L2) keeps an evicted node's copy instead of dropping it and frees its
        # slots when the node leaves the tree; the storage tier (L3) gives every node its
        # chained keys and saves pages on adopt (write_through) or evict (write_back).
        self.host = host
        self.storage = storage
        self.root = Node((), [])
        self.root.lock = 1  # never evicted
        self.num_pages = 0  # L1 pages held by the tree
        self.num_locked_pages = 0  # L1 pages on locked paths
        self.num_evicted_pages = 0
        self.adopted: list[int] = []  # pages the tree took a reference on (drained by the owner)
        self._clock = itertools.count(1)

    @property
    def num_evictable(self) -> int:
        return self.num_pages - self.num_locked_pages

    @property
    def num_window_pages(self) -> int:
        """Window-pool pages the tree holds (a walk: for stats)."""
        return sum(1 for n in self._nodes() for p in n.window or () if p != NO_PAGE)

    # ---- lookups -----------------------------------------------------------------------------

    def _page_keys(self, tokens, num_pages: int):
        ps = self.page_size
        return [tuple(tokens[i * ps:(i + 1) * ps]) for i in range(num_pages)]

    def match(self, tokens: list[int]) -> Match:
        """Longest cached prefix of `tokens` in whole pages. Splits a node where the match ends
        inside it, so that the match always ends on a node boundary."""
        pages_left = len(tokens) // self.page_size
        keys = self._page_keys(tokens, pages_left)
        node, at, now = self.root, 0, next(self._clock)
        result = Match(self.root, [])
        while at < pages_left:
            child = node.children.get(keys[at])
            if child is None:
                break
            n = self._common_pages(child, keys, at)
            if n < child.num_pages:
                child = self._split(child, n)
            child.last_used = now
            at += n
            node = child
            if child.pages is not None and not result.host_nodes:
                result.node = child
                result.pages += child.pages
                result.window += child.window or ()
            else:
                result.host_nodes.append(child)
                result.host_window += child.host_window or [False] * child.num_pages
        return result

    def _common_pages(self, node: Node, keys, at: int) -> int:
        n = 0
        while n < node.num_pages and at + n < len(keys) and \
                node.key[n * self.page_size:(n + 1) * self.page_size] == keys[at + n]:
            n += 1
        return n

    def _split(self, node: Node, n: int) -> Node:
        """Cuts `node` after n pages: a new parent takes the first n pages, `node` keeps the rest
        (so requests holding `node` keep holding the deepest part). Returns the new parent."""
        cut = n * self.page_size
        parent = Node(node.key[:cut], None if node.pages is None else node.pages[:n],
                      node.parent, None if node.host is None else node.host[:n],
                      lock=node.lock, last_used=node.last_used,
                      keys=None if node.keys is None else node.keys[:n],
                      window=None if node.window is None else node.window[:n],
                      host_window=None if node.host_window is None else node.host_window[:n])
        node.keys = None if node.keys is None else node.keys[n:]
        node.window = None if node.window is None else node.window[n:]
        node.host_window = None if node.host_window is None else node.host_window[n:]
        parent.children[self._first_key(node.key[cut:])] = node
        node.parent.children[self._first_key(parent.key)] = parent
        node.key = node.key[cut:]
        node.pages = None if node.pages is None else node.pages[n:]
        node.host = None if node.host is None else node.host[n:]
        node.parent = parent
        return parent

    def _first_key(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return key[:self.page_size]

    # ---- insert ------------------------------------------------------------------------------

    def insert(self, tokens: list[int], pages: list[int], from_storage: bool = False) -> Node:
        """Adds the whole pages of `tokens` (pages[i] holds tokens of page i) and returns the
        deepest node of the path that holds the caller's pages. Where the tree already holds
        other pages for the same tokens it keeps them and the insert stops there (the caller's
        duplicates remain the caller's); new pages get a tree reference.

        Pages may be inserted as soon as the chunk that writes them is scheduled: every stage
        runs micro-batches in arrival order, so any later micro-batch that reads them (another
        request's matched prefix) runs after the one that writes them, on every stage."""
        num = min(len(tokens) // self.page_size, len(pages))
        keys = self._page_keys(tokens, num)
        node, at, now = self.root, 0, next(self._clock)
        while at < num:
            child = node.children.get(keys[at])
            if child is None:
                child = Node(tuple(tokens[at * self.page_size:num * self.page_size]),
                             list(pages[at:num]), node, last_used=now,
                             window=self._no_window(num - at))
                if self.storage is not None:
                    child.keys = self._chain_keys(node, child.key)
                node.children[keys[at]] = child
                self._adopt(child.pages, child.keys, from_storage)
                return child
            n = self._common_pages(child, keys, at)
            if n < child.num_pages:
                child = self._split(child, n)
            if child.pages is not None and child.pages != list(pages[at:at + n]):
                # The tree got these tokens from someone else (a recomputed last page after a
                # full hit, or two requests computing one prefix at once): keep the tree's and
                # stop, so that the caller locks only pages it uses.
                break
            if child.pages is None:  # host-only: the caller's fresh L1 copy becomes the tree's
                child.pages = list(pages[at:at + n])
                child.window = self._no_window(n)
                self._adopt(child.pages, child.keys, from_storage)
                if child.lock:
                    self.num_locked_pages += n
            child.last_used = now
            node, at = child, at + n
        return node

    def load(self, node: Node, pages: list[int], window: list[int] | None = None) -> None:
        """A host-only node is back in L1 in `pages` (allocated for the tree; its host copy
        stays, so a later eviction needs no copy), with the window pages its host copy's
        window parts go to (`window`, NO_PAGE where none; allocated for the tree)."""
        assert node.pages is None and len(pages) == len(node.host) and not node.lock
        node.pages = list(pages)
        node.window = list(window) if window is not None else self._no_window(len(pages))
        self.num_pages += len(pages)

    def _no_window(self, num_pages: int) -> list[int] | None:
        return None if self.window_pool is None else [NO_PAGE] * num_pages

    def attach_window(self, tokens: list[int], window: list[int],
                      from_storage: bool = False) -> list[int]:
        """Along the tree's path of the whole pages of `tokens`, holds window[i] as the window
        page of page i where the tree holds none (a request letting go of its pages: its window
        layers' K/V of the same tokens; or window parts fetched from storage, which are not
        saved again). Returns the window pages it took a reference on."""
        num = min(len(tokens) // self.page_size, len(window))
        keys = self._page_keys(tokens, num)
        node, at, taken, pages, stored = self.root, 0, [], [], []
        while at < num:
            child = node.children.get(keys[at])
            if child is None or child.pages is None:
                break
            n = self._common_pages(child, keys, at)
            for j in range(n):
                if child.window[j] == NO_PAGE and window[at + j] != NO_PAGE:
                    child.window[j] = window[at + j]
                    taken.append(window[at + j])
                    pages.append(child.pages[j])
                    stored.append(child.keys[j] if child.keys else b"")  # keys: with storage
            if n < child.num_pages:
                break
            node, at = child, at + n
        self.window_pool.retain(taken)
        if self.storage is not None and not from_storage:
            self.storage.on_window(pages, stored, taken)
        return taken

    def _adopt(self, pages: list[int], keys, from_storage: bool = False) -> None:
        self.pool.retain(pages)
        self.num_pages += len(pages)
        self.adopted += pages
        if self.storage is not None and keys and not from_storage:
            self.storage.on_adopt(pages, keys)

    def _chain_keys(self, parent: Node, key: tuple[int, ...]) -> list[bytes]:
        return chain_page_keys(key, self.page_size, self.last_key(parent))

    def last_key(self, node: Node) -> bytes:
        """The chained key of a node's last page (b"" for the root)."""
        return node.keys[-1] if node is not self.root and node.keys else b""

    # ---- locks -------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        while node is not None:
            if node.lock == 0:
                assert node.pages is not None, "locking a path that is not in L1"
                self.num_locked_pages += len(node.pages)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            assert node.lock > 0, "unlock without lock"
            node.lock -= 1
            if node.lock == 0:
                self.num_locked_pages -= len(node.pages)
            node = node.parent

    # ---- eviction ----------------------------------------------------------------------------

    def _l1_leaf(self, node: Node) -> bool:
        return node.pages is not None and node.lock == 0 and \
            not any(c.pages is not None for c in node.children.values())

    def evict(self, num_pages: int) -> int:
        """Evicts unlocked L1 leaves, least recently used first, until num_pages pages are out of
        L1 (or nothing is left to evict). Returns the pages evicted."""
        heap = [(n.last_used, id(n), n) for n in self._nodes() if self._l1_leaf(n)]
        heapq.heapify(heap)
        done = 0
        while done < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            if not self._l1_leaf(node):
                continue
            done += self._evict_node(node)
            parent = node.parent
            if parent is not None and parent is not self.root and self._l1_leaf(parent):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return done

    def _evict_node(self, node: Node) -> int:
        n = len(node.pages)
        if self.storage is not None:
            self.storage.on_evict(node)
        kept = self.host is not None and self.host.on_evict(node, self)
        self.pool.release(node.pages)
        if node.window is not None:
            self.window_pool.release([p for p in node.window if p != NO_PAGE])
        node.pages = None
        node.window = None
        self.num_pages -= n
        self.num_evicted_pages += n
        if not kept:
            self.drop(node)
        return n

    def evict_host(self, num_slots: int) -> int:
        """Drops host-only leaves, least recently used first, until num_slots host slots are
        free again (or none is left). Returns the slots freed."""
        heap = [(n.last_used, id(n), n) for n in self._nodes() if self._host_leaf(n)]
        heapq.heapify(heap)
        done = 0
        while done < num_slots and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            done += len(node.host)
            self.drop(node)
            if parent is not self.root and self._host_leaf(parent):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return done

    @staticmethod
    def _host_leaf(node: Node) -> bool:
        return node.pages is None and node.host is not None and not node.children

    def drop(self, node: Node) -> None:
        """Removes a node that is out of L1, with its (host-only) subtree."""
        del node.parent.children[self._first_key(node.key)]
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.pages is None and n.lock == 0, "dropping a node still in L1"
            if n.host is not None and self.host is not None:
                self.host.on_drop(n)
            n.host = n.host_window = None
            stack.extend(n.children.values())

    def nodes(self):
        return self._nodes()

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def reset(self) -> None:
        """Drops every unlocked page (tests; a flush)."""
        self.evict(self.num_pages)
