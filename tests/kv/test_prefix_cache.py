"""The prefix cache in the scheduler (no processes: fabricated results, every plan replayed
through a stage's page-ownership check) and in real engines (cache on == cache off)."""
import time

import pytest
import torch

from conftest import assert_pages_free, save_tiny_model, track
from pipefill import Engine
from pipefill.chunking.policy import ChunkPolicy
from pipefill.kv.pool import PageOwners, PagePool
from pipefill.base.plan import NewRequest, SamplingParams, SeqResult, StepResult
from pipefill.kv.radix import RadixCache
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig

PAGE = 16


def make(num_pages=64, chunk=32, budget=64, next_chunk_size=None, max_running=8):
    pool = PagePool(num_pages)
    cfg = SchedulerConfig(PAGE, budget, max_running, 4096, ())
    return Scheduler(cfg, pool, ChunkPolicy(chunk, next_chunk_size), RadixCache(PAGE, pool))


class Stage:
    """What a later stage does with plans: replay the page decisions and check every one."""

    def __init__(self, num_pages):
        self.owners = PageOwners(num_pages)

    def run(self, plan):
        self.owners.replay(plan.page_ops.freed, plan.seqs, PAGE)
        self.owners.to_cache(plan.page_ops.cached)


def result_for(plan):
    # The token depends only on (rid, step): a resumed request must draw the same ones.
    return StepResult(plan.step_id, [
        SeqResult(w.rid, 100 + w.sample.step + 7 * int(w.rid[1:]) if w.sample else None)
        for w in plan.seqs])


def drain(s, stage, limit=5000):
    outs = []
    for _ in range(limit):
        plan = s.schedule()
        if plan is None:  # frees since the last plan reach the stages with the next message
            stage.owners.free(s.kv.drain_ops().freed)
            return outs
        stage.run(plan)
        outs += s.update(plan, result_for(plan))
    raise AssertionError("did not finish")


def req(i, ids, n=4):
    return NewRequest(f"r{i}", list(ids), SamplingParams(max_new_tokens=n))


DOC = [(7 * i + 3) % 500 for i in range(100)]


def test_second_request_reuses_pages_scheduled_mid_prefill():
    """Pages go into the tree when their chunk is scheduled: a request that arrives while the
    first is still in prefill (no result back yet) skips them."""
    s, stage = make(), Stage(64)
    s.add(req(0, DOC))
    plans = [s.schedule(), s.schedule()]  # two chunks in flight: tokens [0, 64)
    s.add(req(1, DOC[:64] + [1, 2, 3]))
    third = s.schedule()
    b = next(w for w in third.seqs if w.rid == "r1")
    a_pages = plans[1].seqs[0].page_table
    assert b.start == 64 and b.page_table[:4] == a_pages[:4]
    for p in plans + [third]:
        stage.run(p)
    outs = sum((s.update(p, result_for(p)) for p in plans + [third]), []) + drain(s, stage)
    assert {o.rid: o.cached_tokens for o in outs if o.cached_tokens} == {"r1": 64}
    assert s.kv.counters.hit_tokens == 64
    assert s.pool.num_used == s.kv.cache.num_pages == stage.owners.num_used


def test_full_hit_recomputes_the_last_page():
    s, stage = make(), Stage(64)
    s.add(req(0, DOC[:64]))
    drain(s, stage)
    s.add(req(1, DOC[:64]))
    plan = s.schedule()
    assert (plan.seqs[0].start, plan.seqs[0].end) == (48, 64)
    stage.run(plan)
    s.update(plan, result_for(plan))
    drain(s, stage)


def test_first_chunk_after_a_hit_is_the_size_predicted_for_L():
    seen = []

    def predict(L):
        seen.append(L)
        return 16
    s, stage = make(next_chunk_size=predict), Stage(64)
    s.add(req(0, DOC))
    drain(s, stage)
    seen.clear()
    s.add(req(1, DOC[:80] + [9] * 40))
    plan = s.schedule()
    assert seen[0] == 80 and plan.seqs[0].num_tokens == 16


def test_prompt_logprobs_are_computed_not_cached():
    s, stage = make(), Stage(64)
    s.add(req(0, DOC))
    drain(s, stage)
    s.add(NewRequest("r1", DOC, SamplingParams(2, return_prompt_logprobs=True)))
    plan = s.schedule()
    assert plan.seqs[0].start == 0


def test_preemption_resumes_with_the_same_tokens():
    """A pool far smaller than the work: decode runs out, the newest request goes back to the
    queue with its pages cached, resumes, and draws the same tokens; nothing leaks."""
    s, stage = make(num_pages=12, chunk=32, budget=64), Stage(12)
    for i in range(3):
        s.add(req(i, [i * 50 + t for t in range(40)], n=60))
    outs = drain(s, stage)
    tokens = {}
    for o in outs:
        tokens.setdefault(o.rid, []).extend(o.new_token_ids)
    for i in range(3):
        assert tokens[f"r{i}"] == [100 + k + 7 * i for k in range(60)]
    assert s.kv.counters.preemptions > 0
    s.pool.check_integrity()
    assert s.pool.num_used == s.kv.cache.num_pages == stage.owners.num_used
    assert s.kv.promised == 0


def test_ownership_check_catches_foreign_writes_and_unwritten_reads():
    s = make()
    s.add(req(0, DOC[:20]))  # page 0 full (cached), page 1 partial (r0's own)
    first = s.schedule()
    s.add(req(1, [1] * 20))
    second = s.schedule()
    r1 = second.seqs[-1]

    def stage_after_first():
        stage = Stage(64)
        stage.run(first)
        return stage
    for page, owner in ((1, "r0"), (0, "<prefix cache>")):
        r1.page_table[-1] = first.seqs[0].page_table[page]
        with pytest.raises(RuntimeError, match=f"r1 writes page {page}, which is owned by "
                                               f"{owner}"):
            stage_after_first().run(second)
    s.add(req(2, DOC[:40]))  # reuses page 0: a stage that never saw r0's plan must refuse
    third = s.schedule()
    assert third.seqs[-1].start == 16
    with pytest.raises(RuntimeError, match="r2 reads page 0, which was never written"):
        Stage(64).run(third)


# ---- real engines: cache on == cache off ---------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama_pc"), num_hidden_layers=3)


def shared_prefix_prompts(n_doc: int) -> list[list[int]]:
    doc = [(11 * i + 5) % 512 for i in range(n_doc)]
    return [doc + [1, 2, 3], doc + [4, 5, 6, 7, 8, 9, 10], doc[:n_doc // 2] + [3, 3]]


def run_turns(path, prompts, **kw):
    """Each prompt alone, one after the other (hits on the earlier ones), then all together."""
    with track(Engine(path, dtype="float32", page_size=PAGE, threads_per_stage=1, **kw)) as e:
        outs = [e.generate([p], max_new_tokens=6, ignore_eos=True)[0] for p in prompts]
        outs += e.generate(prompts, max_new_tokens=6, ignore_eos=True)
        assert_pages_free(e)
        return [o.output_ids for o in outs], [o.metrics["cached_tokens"] for o in outs]


# Prefixes that end mid-page (90), exactly on a chunk boundary (96 = 3 x 32), mid-chunk (80).
# The fast suite runs two; the rest are marked slow.
CASES = [pytest.param(1, 90, {}, id="pp1-mid-page"),
         pytest.param(2, 96, {}, id="pp2-chunk-boundary"),
         pytest.param(3, 80, {}, id="pp3-mid-chunk", marks=pytest.mark.slow),
         pytest.param(2, 90, {"enable_dynamic_chunking": True, "chunked_prefill_size": 64},
                      id="pp2-dynamic", marks=pytest.mark.slow)]


@pytest.mark.parametrize("pp, n_doc, extra", CASES)
def test_cache_on_equals_cache_off(model, pp, n_doc, extra):
    kw = {"pp_size": pp, "chunked_prefill_size": 32, **extra}
    prompts = shared_prefix_prompts(n_doc)
    on, cached = run_turns(model, prompts, **kw)
    off, no_cache = run_turns(model, prompts, disable_radix_cache=True, **kw)
    assert on == off
    assert cached[1] >= (n_doc // PAGE) * PAGE and sum(no_cache) == 0


def test_prompt_logprobs_with_the_cache_on_match_cache_off(model):
    doc = shared_prefix_prompts(64)[0]
    got = {}
    for off in (False, True):
        with track(Engine(model, dtype="float32", page_size=PAGE, threads_per_stage=1,
                          chunked_prefill_size=32, disable_radix_cache=off)) as e:
            e.generate([doc], max_new_tokens=2)
            got[off] = e.generate([doc], max_new_tokens=4, ignore_eos=True,
                                  return_prompt_logprobs=True)[0]
    assert got[False].output_ids == got[True].output_ids
    diff = torch.tensor(got[False].prompt_logprobs) - torch.tensor(got[True].prompt_logprobs)
    assert diff.abs().max().item() < 1e-5


def test_server_reports_cached_tokens_and_cache_metrics(model):
    """A real `pipefill serve`: the second request with the same prompt reports its cached
    tokens in usage, and /metrics counts them as L1 hits."""
    import httpx

    from test_server import start_server, stop_server
    proc, url = start_server(model, None)
    try:
        body = {"prompt": list(range(100, 300)), "max_tokens": 3, "temperature": 0}
        usages = [httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
                  for _ in range(2)]
        assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 192  # 12 whole pages
        deadline = time.monotonic() + 10  # /metrics shows stage 0's pushed snapshots
        while 'pipefill_cache_hit_tokens{tier="l1"} 192.0' not in \
                httpx.get(url + "/metrics", timeout=10).text:
            assert time.monotonic() < deadline, "no L1 hit tokens in /metrics"
            time.sleep(0.2)
    finally:
        assert stop_server(proc) == 0
