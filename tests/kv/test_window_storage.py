"""The storage tier (L3) keeps a page's window part (ARCHITECTURE.md, 'Window pages'), without
processes: a stage over a WindowedKVCache whose K values are the token ids, with a real file
store; the scheduler's plans replayed into it as every stage does. A hit from storage on a
fresh server reads, in its window layers, the window keys a cold run computes, and fetches
exactly that window's parts; a window part that is missing ends the hit where it ends the
window, and one that goes after verification fails its page on the stage."""
from __future__ import annotations

import os

import pytest
import torch

from pipefill.base.plan import CacheOp, CopyKind, NewRequest, SamplingParams, SeqResult, \
    StepResult
from pipefill.chunking.policy import ChunkPolicy
from pipefill.config import ServerArgs
from pipefill.kv.cache import WindowedKVCache
from pipefill.kv.pool import CACHE_OWNER, PageOwners, PagePool
from pipefill.kv.radix import RadixCache
from pipefill.kv.storage import chain_page_keys, open_page_store, stage_part_suffixes
from pipefill.kv.storage_tier import StorageTier, storage_director
from pipefill.kv.tiers import StageKV
from pipefill.kv.window import WindowPages, window_before
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig

PAGE, WINDOW, CHUNK = 4, 10, 8
NUM_PAGES = 96
WINDOWED = [True, False, True]  # layers 0 and 2 slide
FP = "f" * 32
PROMPT = list(range(500, 590))  # 9 windows: 22 whole pages and 2 tokens
SUFFIX, WINDOW_SUFFIX = stage_part_suffixes(FP, torch.float32, PAGE, range(3), 2)


class ValueStage:
    """One stage (layers 0-2) whose K values are the token ids: each forward checks that every
    key its chunk reads from the cache holds its token (the global layer: the whole prefix;
    the window layers: the window before the chunk), then writes its tokens' ids."""

    def __init__(self, folder, policy: str):
        self.cache = WindowedKVCache(WINDOWED, NUM_PAGES, PAGE, 1, 2, torch.float32)
        store = open_page_store("file", storage_dir=str(folder), key_suffix=SUFFIX)
        self.kv = StageKV(self.cache, storage=StorageTier(store, self.cache, 0, FP,
                                                          WINDOW_SUFFIX))
        self.args = ServerArgs(page_size=PAGE, hicache_storage_backend="file",
                               hicache_storage_dir=str(folder), hicache_write_policy=policy)
        self.tokens: dict[str, list[int]] = {}

    def scheduler(self) -> Scheduler:
        pool = PagePool(NUM_PAGES)
        window = WindowPages(PagePool(NUM_PAGES), PAGE, WINDOW)
        director = storage_director(self.args, self.kv.storage, [range(3)], [2])
        tree = RadixCache(PAGE, pool, storage=director, window_pool=window.pool)
        return Scheduler(SchedulerConfig(PAGE, CHUNK, 4, 4096, ()), pool, ChunkPolicy(CHUNK),
                         tree, window=window)

    def forward(self, plan) -> None:
        self.kv.before_forward(plan.page_ops, plan.seqs)
        for w in plan.seqs:
            tokens = self.tokens[w.rid]
            tokens[w.start:w.end] = w.input_ids
            self._check(self.cache.k[0], w.page_table, range(w.start), tokens, w.rid)
            first = max(0, w.start - WINDOW + 1)
            for k in self.cache.window.k:
                self._check(k, w.window_table, range(first, w.start), tokens, w.rid)
                self._write(k, w.window_table, w.start, w.end, tokens)
            self._write(self.cache.k[0], w.page_table, w.start, w.end, tokens)
        self.kv.after_forward(plan.page_ops)

    @staticmethod
    def _slot(table: list[int], pos: int) -> int:
        return table[pos // PAGE] * PAGE + pos % PAGE

    def _check(self, k, table, positions, tokens, rid) -> None:
        for pos in positions:
            got = k[self._slot(table, pos), 0, 0].item()
            assert got == tokens[pos], f"{rid} position {pos}: {got} != {tokens[pos]}"

    def _write(self, k, table, start: int, end: int, tokens) -> None:
        for pos in range(start, end):
            k[self._slot(table, pos)] = tokens[pos]


def serve(stage: ValueStage, s: Scheduler, rid: str, prompt: list[int]) -> list:
    """One request to completion, up to 3 plans in flight (retired oldest first, with the
    fetches every stage failed); returns the plans."""
    stage.tokens[rid] = list(prompt)
    s.add(NewRequest(rid, prompt, SamplingParams(max_new_tokens=3, ignore_eos=True)))
    queue, plans = [], []
    for _ in range(1000):
        plan = s.schedule()
        if plan is not None:
            stage.forward(plan)
            plans.append(plan)
            queue.append(plan)
        if plan is None or len(queue) >= 3:
            if not queue:
                stage.kv.without_forward(s.kv.drain_ops())
                return plans
            done = queue.pop(0)
            s.update(done, StepResult(done.step_id,
                                      [SeqResult(w.rid, 7 if w.sample else None)
                                       for w in done.seqs],
                                      failed_fetches=stage.kv.take_failed_fetches()))
    raise AssertionError("did not finish")


def stored_window_parts(folder) -> set[int]:
    """The pages of PROMPT whose window part the folder holds."""
    with open_page_store("file", storage_dir=str(folder), key_suffix=SUFFIX) as store:
        return {i for i, k in enumerate(chain_page_keys(PROMPT, PAGE))
                if store.contains([k], key_suffix=WINDOW_SUFFIX)}


def save_prompt(folder, policy: str) -> None:
    """A first server computes PROMPT and stops cleanly (write_back saves at the stop)."""
    stage = ValueStage(folder, policy)
    s = stage.scheduler()
    serve(stage, s, "a", PROMPT)
    s.kv.on_stop()
    stage.kv.without_forward(s.kv.drain_ops())
    stage.kv.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_storage_hit_restores_the_window_its_first_chunk_reads(tmp_path, policy):
    save_prompt(tmp_path, policy)
    boundary = len(PROMPT) // PAGE
    assert stored_window_parts(tmp_path) >= set(window_before(boundary, PAGE, WINDOW))
    stage = ValueStage(tmp_path, policy)  # a fresh server on the same folder
    s = stage.scheduler()
    plans = serve(stage, s, "b", PROMPT)
    first = next(p.seqs[0] for p in plans if p.seqs)
    assert first.start == len(PROMPT) // PAGE * PAGE  # every whole page from storage
    stats = s.kv.stats()
    assert stats["cache_hit_tokens_storage"] == first.start
    # Exactly the window before the hit's boundary came with its window part.
    assert stats["storage_fetched_window_pages"] == len(window_before(first.start // PAGE,
                                                                      PAGE, WINDOW))
    assert stage.kv.window_owners.num_used == s.kv.window.pool.num_used
    s.kv.cache.reset()
    stage.kv.without_forward(s.kv.drain_ops())
    assert s.kv.window.pool.num_used == 0 == s.pool.num_used
    s.pool.check_integrity()
    s.kv.window.pool.check_integrity()
    stage.kv.close()


def test_a_missing_window_part_ends_the_hit_where_it_ends_the_window(tmp_path):
    """The last window part before the prompt's boundary gone: no boundary below has its window
    stored either (the tree kept windows only near the prompt's end), so the prompt is
    recomputed from 0, and still reads the right keys."""
    save_prompt(tmp_path, "write_through")
    last = chain_page_keys(PROMPT, PAGE)[len(PROMPT) // PAGE - 1]
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=SUFFIX) as store:
        os.remove(store.backend.path(store.full_key(last, WINDOW_SUFFIX)))
    stage = ValueStage(tmp_path, "write_through")
    s = stage.scheduler()
    plans = serve(stage, s, "b", PROMPT)
    assert next(p.seqs[0] for p in plans if p.seqs).start == 0
    assert s.kv.stats()["storage_fetched_window_pages"] == 0
    stage.kv.close()


def test_storage_copies_keep_a_pages_window_part(tmp_path):
    """SAVE_EVICTED and SAVE_WINDOW store a page's window part under its '.w' key, FETCH puts
    it into the window page it names, owned by the cache; a window part that cannot be read
    fails its page."""
    src = WindowedKVCache(WINDOWED, 8, PAGE, 2, 4, torch.float32)
    dst = WindowedKVCache(WINDOWED, 8, PAGE, 2, 4, torch.float32)
    for t in (src.k, src.v, src.window.k, src.window.v):
        t.copy_(torch.randn(t.shape))
    suffix, window_suffix = stage_part_suffixes(FP, torch.float32, PAGE, range(3), 2)
    assert (suffix, window_suffix) == (stage_part_suffixes(FP, torch.float32, PAGE, range(3),
                                                           None)[0] + ".g", suffix[:-2] + ".w")
    keys = [k.hex() for k in chain_page_keys(list(range(3 * PAGE)), PAGE)]
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=suffix) as store:
        StorageTier(store, src, 0, FP, window_suffix).save([
            CacheOp(CopyKind.SAVE_EVICTED, 1, -1, keys[0], window_page=5),
            CacheOp(CopyKind.SAVE_EVICTED, 2, -1, keys[1]),
            CacheOp(CopyKind.SAVE_WINDOW, 3, -1, keys[2], window_page=0)])
        assert store.flush(30)
        assert store.contains([bytes.fromhex(keys[2])]) == 0  # SAVE_WINDOW: the part only
        owners, window_owners = PageOwners(8), PageOwners(8)
        failed = StorageTier(store, dst, 0, FP, window_suffix).fetch([
            CacheOp(CopyKind.FETCH, 6, -1, keys[0], window_page=2),
            CacheOp(CopyKind.FETCH, 7, -1, keys[1], window_page=4)], owners, window_owners)
    assert failed == [7]  # page 1 was saved without its window part
    assert torch.equal(dst.read_pages([6, 7]), src.read_pages([1, 2]))
    assert torch.equal(dst.window.read_pages([2]), src.window.read_pages([5]))
    assert window_owners.owner == {2: CACHE_OWNER, 4: CACHE_OWNER}
    assert window_owners.written == {2, 4}

