"""PagePool: reference-counted KV pages (owns only pages, never requests), and PageOwners:
the page -> owner map every stage replays from the plans to check each micro-batch."""
from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError("the KV cache must hold at least one page")
        self.num_pages = num_pages
        # Popping from the end hands out low ids first, so a fresh request's pages are
        # consecutive and attention can read its prefix as one slice.
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self.freed: list[int] = []  # pages freed since the last drain (the next plan carries them)
        # The most pages in use at once; freed pages go out again first, so this is also
        # about how many pages were ever written (became resident).
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"retain of free page {p}"
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"double free of page {p}"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                self.freed.append(p)

    def borrow(self, n: int) -> list[int]:
        """n free pages for scratch work that no plan carries (the chunking room's background
        profile); give_back returns them."""
        return self.allocate(n)

    def free_ids(self) -> list[int]:
        """The free list as it is (the last entry goes out first)."""
        return list(self._free)

    def take(self, pages: list[int]) -> None:
        """Borrows these free pages in particular (give_back returns them)."""
        taken = set(pages)
        assert all(self._refs[p] == 0 for p in taken), "taking a page in use"
        self._free = [p for p in self._free if p not in taken]
        for p in pages:
            self._refs[p] = 1

    def give_back(self, pages: list[int]) -> None:
        """Borrowed pages, free again as if never lent: the free list as before the borrow,
        and nothing in `freed`, since no stage ever heard of them."""
        for p in reversed(pages):
            assert self._refs[p] == 1, f"page {p} given back with {self._refs[p]} references"
            self._refs[p] = 0
            self._free.append(p)

    def drain_freed(self) -> list[int]:
        freed, self.freed = self.freed, []
        return freed

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        used = sum(1 for r in self._refs if r > 0)
        assert all(self._refs[p] == 0 for p in free), "a free page has references"
        assert len(free) + used == self.num_pages, (
            f"free ({len(free)}) + used ({used}) != total ({self.num_pages})")


class PageIntegrityError(RuntimeError):
    pass


CACHE_OWNER = "<prefix cache>"


class PageOwners:
    """One stage's view of who owns each page, rebuilt from the plans it executes (so every
    stage checks on its own, in plan order): a page is owned by the request it was allocated
    to, then by the prefix cache once inserted, until stage 0 frees it. A write must come from
    the page's owner; a read must hit a page that was written. Shared pages are read by many."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.owner: dict[int, str] = {}
        self.written: set[int] = set()

    @property
    def num_used(self) -> int:
        return len(self.owner)

    def free(self, pages) -> None:
        for p in pages:
            if self.owner.pop(p, None) is None:
                raise PageIntegrityError(f"page {p} freed but it was not in use")
            self.written.discard(p)

    def allocate(self, rid: str, pages) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise PageIntegrityError(f"{rid}: page {p} is outside the pool of "
                                         f"{self.num_pages} pages")
            if p in self.owner:
                raise PageIntegrityError(f"{rid}: page {p} allocated while "
                                         f"{self.owner[p]} still owns it")
            self.owner[p] = rid

    def check(self, rid: str, read, write) -> None:
        for p in write:
            if self.owner.get(p) != rid:
                raise PageIntegrityError(f"{rid} writes page {p}, which is owned by "
                                         f"{self.owner.get(p, 'nobody (free)')}")
        for p in read:
            if p not in self.written:
                raise PageIntegrityError(f"{rid} reads page {p}, which was never written")
        self.written.update(write)

    def replay(self, freed, seqs, page_size: int) -> None:
        """A plan's page decisions before its forward: frees, then each sequence's allocations
        and its check (writes by the owner only, reads of written pages only)."""
        self.free(freed)
        for w in seqs:
            self.allocate(w.rid, w.new_pages)
            self.check(w.rid, w.page_table[:w.start // page_size], w.write_pages(page_size))

    def replay_window(self, seqs, page_size: int) -> None:
        """The window pool's replay (ARCHITECTURE.md, 'Window pages'): each sequence's new
        window pages, its writes by their owner, and reads of written pages only, over the
        window table's pages (a freed entry, -1, is nobody's and not checked)."""
        def pages(entries):
            return [p for p in entries if p != -1]
        for w in seqs:
            if w.window_table is None:
                raise PageIntegrityError(f"{w.rid}: a plan without window pages for a model "
                                         "whose window layers keep pages of their own")
            first = w.start // page_size
            writes = (w.window_table[first:(w.end - 1) // page_size + 1]
                      if w.end > w.start else [])
            self.allocate(w.rid, w.new_window_pages)
            self.check(w.rid, pages(w.window_table[:first]), pages(writes))

    def to_cache(self, pages) -> None:
        for p in pages:
            if p not in self.owner:
                raise PageIntegrityError(f"page {p} inserted into the prefix cache while free")
            self.owner[p] = CACHE_OWNER

    def mark_written(self, pages) -> None:
        """Pages filled by a copy from another tier (a load)."""
        self.written.update(pages)
