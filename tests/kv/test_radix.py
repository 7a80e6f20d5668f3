"""The radix prefix cache against a brute-force model: random insert / match / lock / finish /
evict sequences (hypothesis), with a pool whose references must always add up."""
from hypothesis import given, settings
from hypothesis import strategies as st

from pipefill.kv.pool import PagePool
from pipefill.kv.radix import RadixCache

PS = 2  # tokens per page: small, so random sequences share and split prefixes often


def tree_contents(cache: RadixCache) -> dict[tuple, int]:
    """Brute-force view of the tree: every whole-page prefix -> its L1 page."""
    out = {}
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            key = prefix + child.key
            for i, page in enumerate(child.pages or []):
                out[prefix + child.key[:(i + 1) * PS]] = page
            stack.append((child, key))
    return out


def model_match(present: dict[tuple, int], seq: list[int]) -> list[int]:
    pages = []
    for i in range(len(seq) // PS):
        page = present.get(tuple(seq[:(i + 1) * PS]))
        if page is None:
            break
        pages.append(page)
    return pages


class Harness:
    """Requests as the scheduler uses the tree: match + lock, allocate the rest, insert, move
    the lock down; finishing unlocks and drops the request's own references."""

    def __init__(self, num_pages: int):
        self.pool = PagePool(num_pages)
        self.cache = RadixCache(PS, self.pool)
        self.present: dict[tuple, int] = {}
        self.active: list[tuple[list[int], list[int], object]] = []  # (seq, pages, node)

    def add(self, seq: list[int]) -> None:
        m = self.cache.match(seq)
        assert m.pages == model_match(self.present, seq)
        self.cache.lock(m.node)
        self.pool.retain(m.pages)
        missing = len(seq) // PS - len(m.pages)
        if missing > self.pool.num_free:
            self.evict(missing - self.pool.num_free)
        if missing > self.pool.num_free:  # everything else is locked: give up
            self.cache.unlock(m.node)
            self.pool.release(m.pages)
            return
        pages = m.pages + self.pool.allocate(missing)
        node = self.cache.insert(seq, pages)
        for i, page in enumerate(pages):  # the model: new prefixes take this request's page
            key = tuple(seq[:(i + 1) * PS])
            if self.present.setdefault(key, page) != page:
                break
        self.cache.lock(node)
        self.cache.unlock(m.node)
        self.active.append((seq, pages, node))

    def finish(self, i: int) -> None:
        seq, pages, node = self.active.pop(i % len(self.active))
        self.cache.unlock(node)
        self.pool.release(pages)

    def evict(self, n: int) -> None:
        free_before = self.pool.num_free
        evictable = self.cache.num_evictable
        done = self.cache.evict(n)
        assert done >= min(n, evictable)
        assert self.pool.num_free - free_before == done  # unlocked pages are the tree's alone
        after = tree_contents(self.cache)
        assert after.items() <= self.present.items()
        self.present = after

    def check(self) -> None:
        self.pool.check_integrity()
        contents = tree_contents(self.cache)
        assert contents == self.present
        # Prefix-closed: every cached page's shorter prefixes are cached too.
        for key in contents:
            assert all(key[:k] in contents for k in range(PS, len(key), PS))
        locked = set()
        for seq, pages, node in self.active:  # a request's path is in the tree, locked
            for i in range(len(seq) // PS):
                key = tuple(seq[:(i + 1) * PS])
                if contents.get(key) == pages[i]:
                    locked.add(key)
            n = node
            while n is not self.cache.root:
                assert n.lock > 0 and n.pages is not None
                n = n.parent
        assert self.cache.num_pages == len(contents)
        locked_pages = self._locked_pages()
        assert self.cache.num_evictable == len(contents) - locked_pages
        owned = {p for _, pages, _ in self.active for p in pages}
        assert self.pool.num_used == len(set(contents.values()) | owned)

    def _locked_pages(self) -> int:
        count, stack = 0, list(self.cache.root.children.values())
        while stack:
            node = stack.pop()
            if node.lock:
                count += len(node.pages)
            stack.extend(node.children.values())
        return count


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 2), min_size=0, max_size=12)),
    st.tuples(st.just("finish"), st.integers(0, 100)),
    st.tuples(st.just("evict"), st.integers(1, 6)),
), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(4, 24))
def test_random_operations_agree_with_the_model(operations, num_pages):
    h = Harness(num_pages)
    for op, arg in operations:
        if op == "add":
            h.add(arg)
        elif op == "finish" and h.active:
            h.finish(arg)
        elif op == "evict":
            h.evict(arg)
        h.check()
    while h.active:
        h.finish(0)
    h.cache.reset()
    assert h.pool.num_free == num_pages and h.cache.num_pages == 0


def test_match_splits_and_keeps_locks_on_the_deep_part():
    pool = PagePool(16)
    cache = RadixCache(PS, pool)
    pages = pool.allocate(3)
    node = cache.insert([1, 1, 2, 2, 3, 3], pages)
    cache.lock(node)
    m = cache.match([1, 1, 2, 2, 9, 9])  # ends inside the node: split after two pages
    assert m.pages == pages[:2] and m.node is node.parent and node.pages == pages[2:]
    assert m.node.lock == 1  # the new parent inherits the lock of the path through it
    cache.unlock(node)
    assert cache.num_evictable == 3


def test_lru_evicts_the_least_recently_used_leaf_first():
    pool = PagePool(8)
    cache = RadixCache(PS, pool)
    a = cache.insert([1, 1], pool.allocate(1))
    b = cache.insert([2, 2], pool.allocate(1))
    pool.release(a.pages + b.pages)  # only the tree holds them now
    cache.match([1, 1])  # a is used again: b is the older one
    assert cache.evict(1) == 1
    assert cache.match([2, 2]).pages == [] and cache.match([1, 1]).pages == a.pages


def test_insert_keeps_the_tree_pages_for_tokens_it_has():
    pool = PagePool(8)
    cache = RadixCache(PS, pool)
    first = pool.allocate(2)
    cache.insert([1, 1, 2, 2], first)
    dup = pool.allocate(2)
    node = cache.insert([1, 1, 2, 2], dup)
    assert node is cache.root  # none of the caller's pages is the tree's: nothing to lock
    assert cache.match([1, 1, 2, 2]).pages == first and cache.num_pages == 2
    assert [pool.refcount(p) for p in dup] == [1, 1]  # the duplicates stay the caller's
