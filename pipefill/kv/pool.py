"""PagePool: reference-counted KV pages. Owns only pages, never requests."""
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

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        used = sum(1 for r in self._refs if r > 0)
        assert all(self._refs[p] == 0 for p in free), "a free page has references"
        assert len(free) + used == self.num_pages, (
            f"free ({len(free)}) + used ({used}) != total ({self.num_pages})")
