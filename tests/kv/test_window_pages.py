"""The sliding-window layers' own pages (ARCHITECTURE.md, 'Window pages'), without processes:
the scheduler's plans for a prompt 20 windows long and its decode, replayed into a stage's
page owners (kv.tiers.StageKV over a WindowedKVCache) as every stage does, with the window
pool's own counters measured at every plan; the prefix cache's rule for windows."""
import pytest
import torch

from pipefill.base.plan import CacheOp, CopyKind, NewRequest, SamplingParams, SeqResult, \
    StepResult
from pipefill.chunking.policy import ChunkPolicy
from pipefill.kv.cache import WindowedKVCache
from pipefill.kv.host import HostDirector, HostTier
from pipefill.kv.pool import CACHE_OWNER, PageOwners, PagePool
from pipefill.kv.radix import RadixCache
from pipefill.kv.tiers import StageKV
from pipefill.kv.window import (NO_PAGE, WindowPages, covered_pages, held_window_pages,
                                 keep_from, piece_pages, received_window, ring_pages,
                                 window_before)
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig

PAGE, WINDOW, CHUNK = 4, 10, 8
NUM_PAGES = 256


def make(cache: bool = True, inflight: int = 3, chunk: int = CHUNK):
    pool = PagePool(NUM_PAGES)
    window = WindowPages(PagePool(NUM_PAGES), PAGE, WINDOW)
    tree = RadixCache(PAGE, pool, window_pool=window.pool) if cache else None
    s = Scheduler(SchedulerConfig(PAGE, chunk, 4, 4096, ()), pool, ChunkPolicy(chunk), tree,
                  window=window)
    # A stage's replay of the plans: its page owners for both pools, checked per plan.
    stage = StageKV(WindowedKVCache([True, False, True], NUM_PAGES, PAGE, 1, 4,
                                    torch.float32))
    return s, stage, inflight


def run(s, stage, inflight: int, on_plan=None, limit: int = 10_000):
    """Plans to completion with up to `inflight` in flight (retired oldest first, as the
    pipeline does), each replayed into `stage` before its 'forward'; on_plan(plan) sees the
    pools right after each plan is made."""
    queue = []
    for _ in range(limit):
        plan = s.schedule()
        if plan is not None:
            stage.before_forward(plan.page_ops, plan.seqs)
            stage.after_forward(plan.page_ops)
            if on_plan is not None:
                on_plan(plan)
            queue.append(plan)
        if plan is None or len(queue) >= inflight:
            if not queue:  # the last frees reach the stage as the loop's control messages do
                stage.without_forward(s.kv.drain_ops())
                return
            done = queue.pop(0)
            s.update(done, StepResult(done.step_id, [SeqResult(w.rid, 7 if w.sample else None)
                                                     for w in done.seqs]))
    raise AssertionError("did not finish")


RING = ring_pages(PAGE, WINDOW)


def live_bound(prompt_len: int) -> int:
    """Window pages a sequence may hold, whatever its chunks: its ring (a window and a piece)
    and the window before its prompt's last cacheable boundary."""
    prompt_window = window_before((prompt_len - 1) // PAGE, PAGE, WINDOW)
    return RING + len(prompt_window)


def test_held_window_pages_is_the_live_bound_or_the_prompt():
    """What the memory estimate counts (bench/memory.py): the bound these tests hold the pool
    to, or the prompt's own pages where it has fewer."""
    for prompt_len in (1, PAGE, PAGE + 1, WINDOW, 3 * WINDOW + 1, 6 * WINDOW, 200):
        pages = -(-prompt_len // PAGE)
        assert held_window_pages(prompt_len, PAGE, WINDOW) == min(pages, live_bound(prompt_len))
    assert held_window_pages(6 * WINDOW, PAGE, WINDOW) < 6 * WINDOW // PAGE


def test_the_ring_is_a_window_and_a_piece():
    assert piece_pages(PAGE, WINDOW) == 1  # a page at least
    assert RING == 1 + 3  # a query's window of 10 keys spans at most 4 pages of 4
    # Gemma 3: one window spans 9 pages of 64, and a piece is a quarter window (2 pages).
    assert (piece_pages(64, 512), ring_pages(64, 512)) == (2, 10)
    assert (piece_pages(16, 3), ring_pages(16, 3)) == (1, 2)


def test_keep_from_and_the_window_before_a_boundary():
    assert keep_from(5, PAGE, WINDOW) == 0
    assert keep_from(27, PAGE, WINDOW) == 24 - WINDOW + 1  # the boundary below 27 is 24
    assert list(window_before(6, PAGE, WINDOW)) == [3, 4, 5]  # tokens 15..23
    assert list(window_before(2, PAGE, WINDOW)) == [0, 1]


@pytest.mark.parametrize("pages,expect", [
    ([], 0), ([1, 2, 3], 3), ([NO_PAGE, NO_PAGE, 5, 6, 7], 5),
    ([NO_PAGE, NO_PAGE, NO_PAGE, 5, 6], 0),  # a hole in every boundary's window
    ([1, 2, NO_PAGE, 4, 5, 6, 7], 7),  # the hole is older than the last window
    ([1, 2, 3, 4, NO_PAGE, 6, 7], 4),  # the deepest boundary below the hole
    ([1, NO_PAGE], 1), ([NO_PAGE], 0)])
def test_covered_pages(pages, expect):
    assert covered_pages(pages, PAGE, WINDOW) == expect


def test_a_prompt_twenty_windows_long_holds_a_window_and_a_chunk_of_window_pages():
    s, stage, inflight = make()
    prompt = list(range(100, 100 + 20 * WINDOW))
    s.add(NewRequest("a", prompt, SamplingParams(max_new_tokens=1)))
    seen = {"window_peak": 0, "global_peak": 0, "freed": 0}

    def on_plan(plan):
        seen["window_peak"] = max(seen["window_peak"], s.kv.window.pool.num_used)
        seen["global_peak"] = max(seen["global_peak"], s.pool.num_used)
        seen["freed"] += len(plan.page_ops.window_freed)
        # Every stage's replay holds exactly stage 0's window pages.
        assert stage.window_owners.num_used == s.kv.window.pool.num_used
        for w in plan.seqs:  # what the chunk reads is live: the window before its start
            first = max(0, w.start - WINDOW + 1) // PAGE
            assert NO_PAGE not in w.window_table[first:]

    run(s, stage, inflight, on_plan)
    assert seen["global_peak"] == len(prompt) // PAGE  # the global layers keep every token
    assert seen["window_peak"] <= live_bound(len(prompt)) < len(prompt) // PAGE / 4
    assert s.kv.window.pool.peak_used == seen["window_peak"]  # the pool's own counter
    assert seen["freed"] > 0
    s.pool.check_integrity()
    s.kv.window.pool.check_integrity()


def test_a_chunk_longer_than_the_window_cycles_through_a_ring_of_window_pages():
    """A chunk six windows long holds a window and a piece of window pages, not the chunk: its
    page i takes over page i - RING's window page, and its plan's table names that page at both
    entries (the window layers compute the chunk piece after piece: a piece reads page i - RING
    before the piece of page i overwrites it); the request's own table has let go of the older
    entry, so the prefix cache and PD never see it."""
    chunk = 6 * WINDOW
    s, stage, inflight = make(chunk=chunk)
    prompt = list(range(20 * WINDOW))
    s.add(NewRequest("a", prompt, SamplingParams(max_new_tokens=1)))
    plans, held, own = [], [], []
    run(s, stage, inflight, lambda plan: (plans.append(plan),
                                          held.append(s.kv.window.pool.num_used),
                                          own.append(list(s.running["a"].window_pages))))
    prompt_window = window_before((len(prompt) - 1) // PAGE, PAGE, WINDOW)
    for plan, table in zip(plans, own):
        w = plan.seqs[0]
        first_read = max(0, w.start - WINDOW + 1) // PAGE
        last = (w.end - 1) // PAGE
        assert NO_PAGE not in w.window_table[first_read:last + 1]
        for i in range(first_read, last + 1):
            ring = w.window_table[max(first_read, i - RING + 1):i + 1]
            assert len(set(ring)) == len(ring)  # RING pages in a row: each its own page
            if i - RING >= first_read and i - RING not in prompt_window:
                assert w.window_table[i - RING] == w.window_table[i]  # taken over
        live = [i for i, p in enumerate(table) if p != NO_PAGE]
        assert len(live) <= live_bound(len(prompt))
        assert set(live) - set(prompt_window) <= set(range(last + 1 - RING, last + 1))
    assert max(held) <= live_bound(len(prompt)) < chunk // PAGE
    assert s.kv.window.pool.peak_used <= live_bound(len(prompt))
    assert s.kv.window.pool.num_used == s.kv.cache.num_window_pages  # the rest went back


def test_decode_frees_window_pages_too():
    s, stage, inflight = make(cache=False, inflight=1)
    prompt = list(range(3 * WINDOW))
    s.add(NewRequest("a", prompt, SamplingParams(max_new_tokens=15 * WINDOW,
                                                 ignore_eos=True)))
    used = []
    run(s, stage, inflight, lambda plan: used.append(s.kv.window.pool.num_used))
    decode = used[-14 * WINDOW:]
    assert max(decode) <= live_bound(len(prompt))
    assert s.pool.peak_used == -(-(len(prompt) + 15 * WINDOW - 1) // PAGE)
    # Nothing is held once the request is done (no prefix cache here).
    assert s.kv.window.pool.num_used == 0 and stage.window_owners.num_used == 0


def test_the_same_prompt_again_matches_at_its_boundary_and_reads_a_held_window():
    s, stage, inflight = make()
    prompt = list(range(500, 500 + 9 * WINDOW + 3))
    s.add(NewRequest("a", prompt, SamplingParams(max_new_tokens=4 * WINDOW, ignore_eos=True)))
    run(s, stage, inflight)
    assert s.kv.window.pool.num_used == s.kv.cache.num_window_pages > 0
    # The same prompt: whole pages of all but its last token, their last window held.
    s.add(NewRequest("b", prompt, SamplingParams(max_new_tokens=2)))
    plans = []
    run(s, stage, inflight, plans.append)
    first = plans[0].seqs[0]
    assert first.start == (len(prompt) - 1) // PAGE * PAGE
    assert NO_PAGE not in first.window_table[max(0, first.start - WINDOW + 1) // PAGE:]
    # A prompt that parts from it mid-prompt, where the window pages were freed: its match
    # stops at the deepest boundary whose window is held (here none: recomputed from 0).
    s.add(NewRequest("c", prompt[:5 * WINDOW] + [9] * 30, SamplingParams(max_new_tokens=1)))
    plans = []
    run(s, stage, inflight, plans.append)
    assert plans[0].seqs[0].start == 0
    s.kv.cache.reset()  # eviction lets the tree's window pages go with its pages
    assert s.kv.window.pool.num_used == 0 == s.pool.num_used


def test_a_preempted_request_resumes_from_its_held_window():
    s, stage, inflight = make(inflight=1)
    prompt = list(range(2 * WINDOW + 1))
    s.add(NewRequest("a", prompt, SamplingParams(max_new_tokens=3 * WINDOW, ignore_eos=True)))
    for _ in range(12):  # the prompt and a few decode steps
        plan = s.schedule()
        stage.before_forward(plan.page_ops, plan.seqs)
        stage.after_forward(plan.page_ops)
        s.update(plan, StepResult(plan.step_id, [SeqResult("a", 7 if plan.seqs[0].sample
                                                           else None)]))
    r = s.running["a"]
    done = r.num_scheduled
    s._preempt(r)
    plans = []
    run(s, stage, inflight, plans.append)
    resumed = plans[0].seqs[0]
    assert 0 < resumed.start <= done and resumed.start % PAGE == 0
    s.pool.check_integrity()
    s.kv.window.pool.check_integrity()


def test_scratch_pages_are_free_in_both_pools():
    s, _, _ = make()
    taken = s.kv.window.pool.allocate(3)  # window pages 0-2 in use, free in the main pool
    pages = s.kv.borrow(4)
    assert len(pages) == 4 and not set(pages) & set(taken)
    s.kv.give_back(pages)
    s.kv.window.pool.release(taken)
    assert s.pool.num_used == 0 == s.kv.window.pool.num_used


@pytest.mark.parametrize("prompt_len,chunk", [(3, CHUNK), (9, CHUNK), (37, CHUNK), (40, CHUNK),
                                              (41, 3), (90, 6 * WINDOW), (61, 16)])
def test_a_prefill_ends_holding_every_window_page_a_pd_decode_asks_for(prompt_len, chunk):
    """PD sends a window page only where the decode's table (received_window, from the prompt
    length alone) has one; at its last chunk the prefill holds each of them, whatever its
    chunks, and again after a prefix-cache hit on the same prompt."""
    s, stage, inflight = make(chunk=chunk)
    prompt = list(range(500, 500 + prompt_len))
    tables = []

    def on_plan(plan):
        tables.extend(w.window_table for w in plan.seqs if w.sample is not None)

    for rid in ("a", "b"):
        s.add(NewRequest(rid, prompt, SamplingParams(max_new_tokens=1)))
        run(s, stage, inflight, on_plan)
    wanted = received_window(-(-prompt_len // PAGE), prompt_len, PAGE, WINDOW)
    for table in tables:
        assert len(table) == len(wanted)
        assert all(table[i] != NO_PAGE for i, w in enumerate(wanted) if w)
    assert sum(wanted) < len(wanted) or prompt_len <= WINDOW + PAGE  # some pages stay home


def test_a_pd_decode_admits_a_prompt_with_the_window_pages_it_reads():
    s, _, _ = make(cache=False)
    s.add(NewRequest("a", list(range(41)), SamplingParams(max_new_tokens=4)))
    r = s.waiting.popleft()
    assert s.admit_for_kv(r)
    keep = received_window(len(r.pages), 41, PAGE, WINDOW)
    assert [p != NO_PAGE for p in r.window_pages] == keep
    # The decode from token 41 reads keys from 32 on, and the page boundary at 40 its window
    # from 31 (page 7 on): the same window the prompt keeps for the tree.
    assert [i for i, k in enumerate(keep) if k] == [7, 8, 9, 10]
    assert s.kv.window.pool.num_used == 4


def test_host_copies_keep_a_pages_window_part():
    """The host tier's copy thread over a WindowedKVCache: a slot keeps its page's window
    part where the STORE names one, and a LOAD puts it into the window page it names."""
    cache = WindowedKVCache([True, False, True], 8, PAGE, 2, 16, torch.float32)
    tier = HostTier(cache, 6)
    owners, window_owners = PageOwners(8), PageOwners(8)
    data, window = torch.randn(2, 1, 3, PAGE, 2, 16), torch.randn(2, 2, 2, PAGE, 2, 16)
    owners.allocate("r", [1, 2, 3])
    owners.check("r", [], [1, 2, 3])
    window_owners.allocate("r", [5, 0])
    window_owners.check("r", [], [5, 0])
    cache.write_pages([1, 2, 3], data)
    cache.window.write_pages([5, 0], window)
    tier.store([CacheOp(CopyKind.STORE, 1, 4, window_page=5),
                CacheOp(CopyKind.STORE, 2, 0, window_page=0),
                CacheOp(CopyKind.STORE, 3, 2)], owners, window_owners)
    owners.free([1, 2, 3])
    window_owners.free([5, 0])
    tier.load([CacheOp(CopyKind.LOAD, 6, 4, window_page=2),
               CacheOp(CopyKind.LOAD, 7, 0, window_page=7),
               CacheOp(CopyKind.LOAD, 0, 2)], owners, window_owners)
    tier.wait_for([], [2, 7])
    assert torch.equal(cache.read_pages([6, 7, 0]), data)
    assert torch.equal(cache.window.read_pages([2, 7]), window)
    assert window_owners.owner == {2: CACHE_OWNER, 7: CACHE_OWNER}
    assert window_owners.written == {2, 7}


def test_a_host_hit_restores_the_window_its_first_chunk_reads():
    """A pool too small for three prompts: the first one's pages go to the host with their
    window parts, and the same prompt again loads its prefix back, window pages included, up
    to a boundary whose last window is whole; every stage's replay (window pages read only
    once written) passes, and the window layers keep pages of their own all along."""
    pool = PagePool(40)
    window = WindowPages(PagePool(40), PAGE, WINDOW)
    host = HostDirector(64)
    tree = RadixCache(PAGE, pool, host=host, window_pool=window.pool)
    s = Scheduler(SchedulerConfig(PAGE, CHUNK, 4, 4096, ()), pool, ChunkPolicy(CHUNK), tree,
                  window=window)
    cache = WindowedKVCache([True, False, True], 40, PAGE, 1, 4, torch.float32)
    stage = StageKV(cache, HostTier(cache, 64))
    prompts = [list(range(d * 1000, d * 1000 + 90)) for d in range(3)]
    for rid, prompt in zip("abcA", prompts + prompts[:1]):
        s.add(NewRequest(rid, prompt, SamplingParams(max_new_tokens=1)))
        run(s, stage, 3)
    stats = s.kv.stats()
    assert stats["host_stored_window_pages"] > 0 and stats["host_loaded_window_pages"] > 0
    assert stats["cache_hit_tokens_host"] >= 80  # the prompt's whole pages but its last
    assert stage.window_owners.num_used == window.pool.num_used
    pool.check_integrity()
    window.pool.check_integrity()


def test_a_host_copy_made_without_a_window_part_gets_it_when_the_page_leaves_again():
    """A node stored to the host before the tree held window pages for it comes back without
    them; a request then attaches window pages, and evicting the node again (its host copy
    kept) stores the window parts the slots lacked and marks them, so the next match covers
    its window. Before, the slots stayed unmarked: counted as not covering (no wrong hit),
    the attached window pages lost."""
    pool, window_pool = PagePool(16), PagePool(16)
    host = HostDirector(8)
    tree = RadixCache(PAGE, pool, host=host, window_pool=window_pool)
    tokens = list(range(2 * PAGE))
    pages = pool.allocate(2)
    node = tree.insert(tokens, pages)
    pool.release(pages)  # the request lets go: the tree's reference is left
    assert tree.evict(2) == 2
    assert [op.window_page for op in host.drain_ops()] == [-1, -1]
    assert tree.match(tokens).host_window == [False, False]
    back = pool.allocate(2)  # loaded back as KVManager does: pages for the tree, no window
    host.load(node, back)
    tree.load(node, back)
    host.drain_ops()
    window = window_pool.allocate(2)
    assert tree.attach_window(tokens, window) == window
    window_pool.release(window)
    assert tree.evict(2) == 2
    ops = host.drain_ops()
    assert [(op.kind, op.page, op.slot, op.window_page) for op in ops] == \
        [(CopyKind.STORE, p, s, w) for p, s, w in zip(back, node.host, window)]
    assert tree.match(tokens).host_window == [True, True]
    assert window_pool.num_used == 0 and host.stats()["host_stored_window_pages"] == 2
    pool.check_integrity()
    window_pool.check_integrity()
