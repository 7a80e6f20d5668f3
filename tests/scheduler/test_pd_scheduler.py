"""The scheduler's PD roles without processes: a prefill request's pages stay held until every
stage's sender is done with its room, whole pages go out chunk by chunk (the partial last page
with the final chunk, prefix-cache hits from page 0); a decode request waits in pre-allocated
pages for its KV, continues from the prefill's first token, and gives its pages back on every
ending, whatever the order of the room's result and the receiver's release."""
from pipefill.chunking.policy import ChunkPolicy
from pipefill.kv.pool import PagePool
from pipefill.base.plan import (NewRequest, PDInfo, SamplingParams, SeqResult,
                                StepResult)
from pipefill.kv.radix import RadixCache
from pipefill.scheduler.role import DecodeRole, PrefillRole, kv_send_end
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig

PAGE = 16


def make(role: str, stages: int = 2, cache: bool = False, num_pages: int = 64):
    pool = PagePool(num_pages)
    return Scheduler(SchedulerConfig(PAGE, 64, 8, 1024, (2,)), pool, ChunkPolicy(32),
                     cache=RadixCache(PAGE, pool) if cache else None,
                     role=PrefillRole(stages) if role == "prefill" else DecodeRole())


def req(rid: str, n: int, room: int, max_new: int = 1):
    return NewRequest(rid, list(range(10, 10 + n)), SamplingParams(max_new_tokens=max_new),
                      PDInfo(room, "127.0.0.1", 8998))


def run(s, token=5):
    """Plans to completion, one in flight: (every SeqWork, every output)."""
    works, outs = [], []
    while (plan := s.schedule()) is not None:
        works += plan.seqs
        outs += s.update(plan, StepResult(plan.step_id, [
            SeqResult(w.rid, token if w.sample else None) for w in plan.seqs]))
    return works, outs


def sent_ranges(works):
    return [(w.kv_send_from // PAGE, kv_send_end(w, PAGE)) for w in works if w.room is not None]


def test_prefill_sends_whole_pages_and_holds_them_until_every_stage_is_done():
    s = make("prefill")
    s.add(req("a", 100, room=7))
    works, outs = run(s)
    # Chunks of 32 tokens: pages [0,2), [2,4), [4,6), then the last one with the partial page.
    assert sent_ranges(works) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert outs[-1].finished and outs[-1].new_token_ids == [5]
    assert s.pool.num_free == 64 - 7  # the senders still read them
    s.role.stage_done(s, 7)
    assert s.pool.num_free == 64 - 7
    s.role.stage_done(s, 7)
    assert s.pool.num_free == 64 and not s.running
    s.role.stage_done(s, 7)  # a late duplicate changes nothing
    assert s.pool.num_free == 64


def test_prefill_sends_cached_pages_from_page_zero_and_ignores_aborts():
    s = make("prefill", stages=1, cache=True)
    s.add(req("a", 100, room=1))
    run(s)
    s.role.stage_done(s, 1)
    s.add(req("b", 100, room=2))  # 6 whole pages come from the prefix cache
    assert s.abort("b") is None  # its decode waits for this KV: it runs to its end
    works, outs = run(s)
    assert works[0].start == 96 and sent_ranges(works) == [(0, 7)]
    assert outs[-1].finished


def test_decode_waits_in_preallocated_pages_then_continues_from_the_first_token():
    s = make("decode")
    s.add(req("a", 40, room=3, max_new=3))
    assert s.schedule() is None  # not admitted into a plan before its KV
    (r,) = [a.request for a in s.role.admit(s)]
    assert len(r.pages) == 3 and s.schedule() is None
    assert s.role.awaits_kv and not s.has_work  # the loop polls for the room often, yet is idle
    out = s.role.kv_arrived(s, 3, token=9, logprob=-0.5, top=[(9, -0.5)], seed=1234)
    assert not s.role.awaits_kv
    assert out.new_token_ids == [9] and out.token_logprobs == [-0.5] and not out.finished
    assert r.seed == 1234
    plan = s.schedule()
    (w,) = plan.seqs
    assert (w.start, w.end, w.input_ids) == (40, 41, [9]) and w.sample.step == 1
    s.update(plan, StepResult(plan.step_id, [SeqResult("a", 6)]))
    _, outs = run(s)
    assert outs[-1].finished and s.pool.num_free == 64


def test_decode_frees_pages_on_failure_in_either_order_and_on_abort():
    s = make("decode")
    for rid, room in (("a", 1), ("b", 2), ("c", 3)):
        s.add(req(rid, 40, room))
    assert len(s.role.admit(s)) == 3 and s.pool.num_free == 64 - 9
    # a: the result first, then the receiver lets the pages go.
    out = s.role.kv_failed(s, 1, "the prefill died")
    assert out.finish_reason == "error" and "prefill died" in out.error
    assert s.pool.num_free == 64 - 9
    s.role.kv_released(s, 1)
    assert s.pool.num_free == 64 - 6
    # b: the release first.
    s.role.kv_released(s, 2)
    assert s.pool.num_free == 64 - 6
    s.role.kv_failed(s, 2, "timeout")
    assert s.pool.num_free == 64 - 3
    # c: the client went away: the room is dropped, the pages wait for the receiver.
    assert s.abort("c").finish_reason == "abort" and s.role.dropped == [3]
    assert s.pool.num_free == 64 - 3
    assert s.role.kv_arrived(s, 3, 9, None, None, None) is None  # too late: nothing is returned
    assert s.pool.num_free == 64 and not s.running
