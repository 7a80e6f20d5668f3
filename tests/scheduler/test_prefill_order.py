"""--schedule-policy on the pure scheduler, against reference schedules: fcfs finishes one long
prompt before starting the next, fair interleaves their chunks, priority runs a higher priority
prompt's chunks first and resumes the paused one; every policy lets a short prompt pass, keeps
each prompt's own chunk sizes, and finishes every prompt (no starvation)."""
import pytest

from pipefill.base.plan import NewRequest, SamplingParams
from pipefill.chunking.policy import ChunkPolicy
from pipefill.kv.pool import PagePool
from pipefill.scheduler.prefill_order import POLICIES, make_prefill_order
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig
from test_scheduler import result_for

CHUNK = 32


def make(policy: str, budget: int = CHUNK) -> Scheduler:
    cfg = SchedulerConfig(16, budget, 8, 4096, (2,))
    return Scheduler(cfg, PagePool(256), ChunkPolicy(CHUNK), order=make_prefill_order(policy))


def add(s: Scheduler, rid: str, tokens: int, priority: int = 0) -> None:
    s.add(NewRequest(rid, [3] * tokens, SamplingParams(max_new_tokens=1, ignore_eos=True),
                     priority=priority))


def run(s: Scheduler, arrivals: dict[int, list] | None = None, limit: int = 500):
    """One plan in flight at a time; arrivals: step -> [(rid, tokens, priority)] added before
    that step. Returns the rids of each step's prefill chunks and each request's chunk sizes."""
    arrivals = arrivals or {}
    steps, sizes, finished = [], {}, set()
    for step in range(limit):
        for rid, tokens, priority in arrivals.get(step, []):
            add(s, rid, tokens, priority)
        plan = s.schedule()
        if plan is None:
            if not s.waiting and not s.running and step > max(arrivals, default=0):
                return steps, sizes, finished
            continue
        steps.append("".join(w.rid for w in plan.seqs))
        for w in plan.seqs:
            sizes.setdefault(w.rid, []).append(w.end - w.start)
        finished |= {o.rid for o in s.update(plan, result_for(plan)) if o.finished}
    raise AssertionError(f"did not finish: {steps}")


def test_fcfs_finishes_the_first_long_prompt_first():
    steps, _, done = run(make("fcfs"), {0: [("A", 8 * CHUNK, 0)], 1: [("B", 4 * CHUNK, 0)]})
    assert steps == ["A"] * 8 + ["B"] * 4 and done == {"A", "B"}


def test_fair_interleaves_the_long_prompts():
    steps, _, done = run(make("fair"), {0: [("A", 8 * CHUNK, 0)], 1: [("B", 4 * CHUNK, 0)]})
    assert steps == ["A", "B", "A", "B", "A", "B", "A", "B", "A", "A", "A", "A"]
    assert done == {"A", "B"}


def test_fair_lets_a_medium_prompt_catch_up_before_taking_turns():
    steps, _, done = run(make("fair"), {0: [("A", 8 * CHUNK, 0)], 4: [("B", 6 * CHUNK, 0)]})
    # B arrives when A has had 4 chunks: B takes the chunks until it has had as many, then
    # they alternate, A first (served less recently).
    assert steps == ["A"] * 4 + ["B"] * 4 + ["A", "B", "A", "B", "A", "A"]
    assert done == {"A", "B"}


def test_fair_takes_one_long_chunk_per_step_whatever_the_budget():
    steps, _, _ = run(make("fair", budget=4 * CHUNK),
                      {0: [("A", 8 * CHUNK, 0)], 1: [("B", 4 * CHUNK, 0)]})
    # Room for both, yet the long prompts take turns: B (never served) first, then A.
    assert steps[:5] == ["A", "B", "A", "B", "A"]


def test_priority_takes_one_long_chunk_per_step_whatever_the_budget():
    steps, _, _ = run(make("priority", budget=4 * CHUNK), {0: [("A", 8 * CHUNK, 0)],
                                                           2: [("B", 4 * CHUNK, 5)]})
    assert steps[:7] == ["A", "A", "B", "B", "B", "B", "A"]


def test_short_prompts_join_the_step_of_a_long_chunk():
    steps, _, _ = run(make("fair", budget=4 * CHUNK),
                      {0: [("A", 8 * CHUNK, 0)], 1: [("s", CHUNK // 2, 0), ("t", CHUNK, 0)]})
    assert sorted(steps[1]) == ["A", "s", "t"]


def test_priority_runs_the_higher_prompt_then_resumes():
    steps, sizes, done = run(make("priority"), {0: [("A", 8 * CHUNK, 0)],
                                                2: [("B", 4 * CHUNK, 5)],
                                                3: [("C", 4 * CHUNK, 0)]})
    # B (priority 5) takes the chunks from step 2; A resumes, then C (same priority as A,
    # later) waits for A.
    assert steps == ["A", "A"] + ["B"] * 4 + ["A"] * 6 + ["C"] * 4
    assert sizes["A"] == [CHUNK] * 8 and done == {"A", "B", "C"}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_short_prompt_passes_a_long_one(policy):
    steps, _, _ = run(make(policy, budget=2 * CHUNK),
                      {0: [("A", 8 * CHUNK, 0)], 1: [("s", CHUNK // 2, 0)]})
    assert "s" in steps[1]  # admitted beside A's chunk at once


@pytest.mark.parametrize("policy", POLICIES)
def test_every_prompt_finishes_with_its_own_chunk_sizes(policy):
    arrivals = {i: [(f"r{i}", (i % 5 + 1) * 40, i % 3)] for i in range(0, 30, 2)}
    _, sizes, done = run(make(policy), arrivals)
    assert done == {rid for reqs in arrivals.values() for rid, _, _ in reqs}
    _, fcfs_sizes, _ = run(make("fcfs"), arrivals)
    assert sizes == fcfs_sizes  # interleaving never changes a prompt's chunks


def test_an_unknown_policy_is_a_sentence():
    with pytest.raises(ValueError, match="unknown schedule policy 'lifo': choose one of fcfs"):
        make_prefill_order("lifo")
