"""The sliding-window layers' pages (ARCHITECTURE.md, 'Window pages').

A model with sliding-window layers (Gemma 3's local layers) keeps their K/V in a pool of its
own: every stage's window layers share one window page id per page of a sequence, stage 0
hands the ids out (`WindowPages`), and a page's window part is freed once every token in it
is older than the window any later query of its sequence can see. The global layers keep
the whole history in the ordinary pool, so a sequence's KV grows with its global layers only.

A request's window table is aligned with its page table (`r.window_pages[i]` holds the window
layers' K/V of the tokens of `r.pages[i]`), with NO_PAGE where the window part was freed. A
request's window pages form a ring of `ring_pages` pages, a chunk of any length included: a
new page i takes over the window page of page i - ring when the request alone holds it, and
the window layers compute a chunk a piece (`piece_pages`) at a time, in order, so no piece
reads a page that a later page of its chunk has taken over. The chunk's plan carries
the table as its pieces see it (`Slide.table`: page i - ring still names the page until page
i's piece writes it); the request's own table has NO_PAGE there.

The prefix cache: a tree page holds a window page too where the last request through it left
one, and a cached prefix is reused only up to the deepest page boundary whose last window
before it still has its window pages (`covered_pages`). A request keeps, besides its live
window, the window before its prompt's last cacheable page boundary (the same prompt again
matches there) and hands both to the tree when it lets go of its pages.

Pure Python: the scheduler's bookkeeping, no tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipefill.kv.pool import PagePool

NO_PAGE = -1  # a window table's entry whose window part was freed (or never held)


def piece_pages(page_size: int, window: int) -> int:
    """The pages of a piece: the window layers compute a chunk in pieces cut at the multiples
    of this many pages, one after another (model/attention.window_pieces), so the ring a
    request's window pages form need only hold one piece beyond a window. A quarter of the
    window, a page at least: the ring stays within a quarter window and a page of one window,
    and a piece keeps both of a vector kernel's threads busy (Gemma 3: 2 pages of 64 tokens;
    one page left one thread idle on its 64 queries, +15% of the window attention's time)."""
    return max(1, window // 4 // page_size)


def ring_pages(page_size: int, window: int) -> int:
    """How many window pages a request cycles through: a piece starting in page P reads keys
    from its first query's window on, page P - ceil((window - 1) / page_size) at the earliest,
    and writes up to its last page, P + piece_pages - 1, so a ring one page longer than that
    span never hands a page a piece reads to a page it writes."""
    return piece_pages(page_size, window) + -(-(window - 1) // page_size)


def held_window_pages(prompt_len: int, page_size: int, window: int) -> int:
    """The most window pages a request of `prompt_len` tokens holds, whatever its chunks: its
    ring, and the window before its prompt's last cacheable page boundary, which stays for the
    prefix cache (a ring never takes those pages over); never more than its pages."""
    kept = window_before((prompt_len - 1) // page_size, page_size, window)
    return min(-(-prompt_len // page_size), ring_pages(page_size, window) + len(kept))


@dataclass
class Slide:
    """What WindowPages.slide decided for a chunk: the window pages allocated (`new`) and the
    window table as the chunk's pieces read it (`table`: an entry that a later page of the
    chunk took over still names its page, NO_PAGE in the request's own table)."""
    new: list[int]
    table: list[int]


def keep_from(start: int, page_size: int, window: int) -> int:
    """The first token whose window-layer K/V a sequence still needs once it computes from
    token `start` on: the query at `start` sees keys from start - window + 1, and the page
    boundary at or below `start` (where a prefix match may end, as it does when a preempted
    request resumes) needs its own last window, which starts up to a page earlier."""
    return max(0, start // page_size * page_size - window + 1)


def window_before(boundary_pages: int, page_size: int, window: int) -> range:
    """Indices of the pages holding the last window before the page boundary `boundary_pages`
    (tokens [boundary - window + 1, boundary)): what a chunk starting there reads."""
    first = max(0, boundary_pages * page_size - window + 1) // page_size
    return range(first, boundary_pages)


def covered_pages(window_pages: list[int], page_size: int, window: int) -> int:
    """The most pages n <= len(window_pages) of a cached prefix that a request may reuse: the
    window pages of the last window before page n must all be held."""
    return covered_by(len(window_pages), lambda i: window_pages[i] != NO_PAGE, page_size,
                      window)


def covered_by(num_pages: int, held, page_size: int, window: int) -> int:
    """covered_pages over a prefix of num_pages pages whose page i has its window part where
    held(i) says so; held is asked from the top of each window down, and only up to its first
    hole (a stored window part costs a read to know)."""
    n = num_pages
    while n > 0:
        hole = next((i for i in reversed(window_before(n, page_size, window)) if not held(i)),
                    None)
        if hole is None:
            return n
        n = hole  # any boundary above a hole still has it in its window
    return 0


def received_window(num_pages: int, num_tokens: int, page_size: int, window: int) -> list[bool]:
    """Which of a prompt's num_pages pages a request whose num_tokens prompt tokens were
    computed elsewhere (a PD decode) keeps window pages for: the window its decode from
    num_tokens on reads, and the window before the prompt's last cacheable page boundary (kept
    for the tree, as a request that computed its prompt keeps it). A prefill holds both at its
    end (ARCHITECTURE.md, 'Window pages')."""
    first_read = keep_from(num_tokens, page_size, window) // page_size
    prompt_window = window_before((num_tokens - 1) // page_size, page_size, window)
    return [i >= first_read or i in prompt_window for i in range(num_pages)]


def window_pages_for(cache, page_size: int, window: int | None) -> "WindowPages | None":
    """Stage 0's window pool for its stage cache where the window layers keep pages of their
    own (kv.cache.WindowedKVCache), as many pages as the other pool; None otherwise."""
    if cache.window is None:
        return None
    return WindowPages(PagePool(cache.num_pages), page_size, window)


class WindowPages:
    """Stage 0's window pool and the window tables of its requests."""

    def __init__(self, pool: PagePool, page_size: int, window: int):
        self.pool = pool
        self.page_size = page_size
        self.window = window
        self._cached: list[int] = []  # window pages the tree took since the last plan

    def admit(self, r, tree_window: list[int]) -> None:
        """r reuses a cached prefix whose tree pages hold `tree_window` (one entry per page,
        already cut to covered_pages): r takes a reference on the ones of its last window."""
        live = window_before(len(tree_window), self.page_size, self.window)
        r.window_pages = [p if i in live else NO_PAGE for i, p in enumerate(tree_window)]
        self.pool.retain([p for p in r.window_pages if p != NO_PAGE])

    def admit_received(self, r) -> None:
        """r's prompt KV comes from elsewhere into r.pages (PD decode): window pages for the
        pages received_window names, NO_PAGE for the others."""
        keep = received_window(len(r.pages), len(r.prompt_ids), self.page_size, self.window)
        held = iter(self.pool.allocate(sum(keep)))
        r.window_pages = [next(held) if k else NO_PAGE for k in keep]

    def slide(self, r, start: int, end: int, prompt_tokens: int) -> Slide:
        """Before r computes tokens [start, end): its window pages that no query from `start`
        on reads go back, except the window before its prompt's last cacheable boundary (kept
        for the tree); then every new page i gets a window page: the one of page i - ring
        where r alone holds it and it is not kept for the tree (module doc), else a fresh one
        (the pool hands freed ones out again first)."""
        ps, window = self.page_size, self.window
        prompt_window = window_before((prompt_tokens - 1) // ps, ps, window)
        for i in range(min(keep_from(start, ps, window) // ps, len(r.window_pages))):
            p = r.window_pages[i]
            if i in prompt_window or p == NO_PAGE:
                continue
            self.pool.release([p])
            r.window_pages[i] = NO_PAGE
        ring = ring_pages(ps, window)
        table = list(r.window_pages)
        first_new = len(r.window_pages)
        new = []
        for i in range(first_new, len(r.pages)):
            old = i - ring
            p = r.window_pages[old] if old >= 0 else NO_PAGE
            if p != NO_PAGE and old not in prompt_window and self.pool.refcount(p) == 1:
                r.window_pages[old] = NO_PAGE  # page i's now; the chunk's table keeps it
            else:
                p = self.pool.allocate(1)[0]
                new.append(p)
            r.window_pages.append(p)
            table.append(p)
        return Slide(new, table)

    def release(self, r, tree, tokens_upto) -> None:
        """r lets go of its pages: the tree takes the window pages of r's whole pages that it
        lacks (same tokens, same K/V, whoever computed them), then r's references go."""
        full = r.num_inserted
        if tree is not None and full:
            self._cached += tree.attach_window(tokens_upto(full * self.page_size),
                                               r.window_pages[:full])
        self.pool.release([p for p in r.window_pages if p != NO_PAGE])
        r.window_pages = []

    def drain(self) -> tuple[list[int], list[int]]:
        """(window pages freed, window pages the tree took) since the last plan."""
        cached, self._cached = self._cached, []
        return self.pool.drain_freed(), cached

    def borrow_common(self, main: PagePool, n: int) -> list[int] | None:
        """n page ids free in both pools (a scratch prefill writes both tensors at the same
        ids), taken from both; None when there are not n of them."""
        ids = [p for p in reversed(main.free_ids()) if self.pool.refcount(p) == 0][:n]
        if len(ids) < n:
            return None
        main.take(ids)
        self.pool.take(ids)
        return ids

    def give_back(self, pages: list[int]) -> None:
        self.pool.give_back(pages)

    def stats(self, tree=None) -> dict:
        return {"window_pages_total": self.pool.num_pages,
                "window_pages_used": self.pool.num_used,
                "window_pages_peak": self.pool.peak_used,
                "cache_window_pages": tree.num_window_pages if tree is not None else 0}
