"""The scheduler without processes or torch: fabricated results in, plans out."""
import pytest

from pipefill.chunking.policy import ChunkPolicy
from pipefill.kv.pool import PagePool
from pipefill.base.plan import NewRequest, SamplingParams, SeqResult, StepResult
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig


def make(num_pages=64, chunk=32, budget=64, page=16, max_running=8, max_len=1024, eos=(2,)):
    cfg = SchedulerConfig(page, budget, max_running, max_len, eos)
    return Scheduler(cfg, PagePool(num_pages), ChunkPolicy(chunk))


def result_for(plan, token=5):
    return StepResult(plan.step_id, [SeqResult(w.rid, token if w.sample else None)
                                     for w in plan.seqs])


def drain(s, token=5, limit=1000):
    """Runs plans to completion, one in flight; returns every output."""
    outs = []
    for _ in range(limit):
        plan = s.schedule()
        if plan is None:
            return outs
        outs += s.update(plan, result_for(plan, token))
    raise AssertionError("did not finish")


def test_chunks_cover_the_prompt_and_pages_come_back():
    s = make()
    s.add(NewRequest("a", list(range(100)), SamplingParams(max_new_tokens=3)))
    plans = [s.schedule() for _ in range(3)]
    # Consecutive chunks without waiting for results (pipelining), the last one samples.
    spans = [(p.seqs[0].start, p.seqs[0].end) for p in plans]
    assert spans == [(0, 32), (32, 64), (64, 96)]
    assert [p.seqs[0].sample is None for p in plans] == [True, True, True]
    for p in plans:
        s.update(p, result_for(p))
    outs = drain(s)
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 3
    s.pool.check_integrity()
    assert s.pool.num_free == 64


def test_decode_waits_for_its_token():
    s = make()
    s.add(NewRequest("a", [1, 2, 3], SamplingParams(max_new_tokens=4)))
    first = s.schedule()
    assert first.seqs[0].sample is not None
    assert s.schedule() is None  # the token is not back yet
    s.update(first, result_for(first))
    nxt = s.schedule()
    assert (nxt.seqs[0].start, nxt.seqs[0].end, nxt.seqs[0].input_ids) == (3, 4, [5])


def test_eos_stops_and_frees():
    s = make()
    s.add(NewRequest("a", [1, 2, 3], SamplingParams(max_new_tokens=10)))
    outs = drain(s, token=2)
    assert outs[-1].finish_reason == "stop" and len(outs) == 1
    assert s.pool.num_free == 64


def test_budget_mixes_decode_and_prefill():
    s = make(chunk=32, budget=40)
    s.add(NewRequest("short", [1, 2], SamplingParams(max_new_tokens=5)))
    p = s.schedule()
    s.update(p, result_for(p))
    s.add(NewRequest("long", list(range(200)), SamplingParams(max_new_tokens=1)))
    plan = s.schedule()
    kinds = {w.rid: w.num_tokens for w in plan.seqs}
    assert kinds == {"short": 1, "long": 32}
    assert plan.num_tokens <= 40


def test_admission_waits_for_pages():
    s = make(num_pages=4, page=16)  # 64 tokens of cache
    s.add(NewRequest("a", list(range(40)), SamplingParams(max_new_tokens=8)))  # 3 pages
    s.add(NewRequest("b", list(range(20)), SamplingParams(max_new_tokens=8)))  # 2 pages
    plan = s.schedule()
    assert [w.rid for w in plan.seqs] == ["a"]  # b queues instead of failing
    drain_outs = s.update(plan, result_for(plan)) + drain(s)
    assert {o.rid for o in drain_outs if o.finished} == {"a", "b"}
    assert s.pool.num_free == 4


def test_request_larger_than_pool_is_rejected():
    s = make(num_pages=2, page=16)
    with pytest.raises(ValueError, match="max-total-tokens"):
        s.add(NewRequest("a", list(range(40)), SamplingParams(max_new_tokens=1)))


def test_abort_in_flight_frees_after_retire():
    s = make()
    s.add(NewRequest("a", list(range(100)), SamplingParams(max_new_tokens=3)))
    p1 = s.schedule()
    out = s.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert s.pool.num_free < 64  # a micro-batch still writes its pages
    assert s.update(p1, result_for(p1)) == []
    assert s.pool.num_free == 64 and not s.running


@pytest.mark.parametrize("bad, match", [
    (NewRequest("a", [], SamplingParams()), "empty"),
    (NewRequest("a", [1] * 1020, SamplingParams(max_new_tokens=5)), "max-model-len"),
    (NewRequest("a", [1], SamplingParams(max_new_tokens=-1)), "max_new_tokens"),
    (NewRequest("a", [1], SamplingParams(top_p=0)), "top_p"),
])
def test_bad_requests(bad, match):
    with pytest.raises(ValueError, match=match):
        make().add(bad)


def test_prompt_logprob_targets_span_chunks():
    s = make(chunk=4)
    s.add(NewRequest("a", list(range(10, 20)), SamplingParams(1, return_prompt_logprobs=True)))
    targets = []
    while (plan := s.schedule()) is not None:
        targets += plan.seqs[0].logprob_targets or []
        s.update(plan, result_for(plan))
    assert targets == list(range(11, 20))


def test_zero_new_tokens_finishes_after_prefill():
    s = make()
    s.add(NewRequest("a", list(range(40)), SamplingParams(max_new_tokens=0)))
    outs = drain(s)
    assert len(outs) == 1 and outs[0].finished and outs[0].new_token_ids == []


def test_long_prompts_go_first_come_first_served():
    s = make(chunk=32, budget=96)
    s.add(NewRequest("long1", list(range(100)), SamplingParams(max_new_tokens=1)))
    s.add(NewRequest("long2", list(range(100)), SamplingParams(max_new_tokens=1)))
    s.add(NewRequest("short", list(range(10)), SamplingParams(max_new_tokens=1)))
    first = s.schedule()
    # One chunk of the first long prompt, the short prompt whole; the second long one waits.
    assert [(w.rid, w.num_tokens) for w in first.seqs] == [("long1", 32), ("short", 10)]
    rids = []
    while (plan := s.schedule()) is not None:
        rids.append([w.rid for w in plan.seqs])
    assert rids[:3] == [["long1"], ["long1"], ["long1"]]  # long1 to the end first
    assert rids[3] == ["long2"]
    assert s.kv.promised >= 0
