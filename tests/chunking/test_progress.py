"""A long prefill's ETA follows the cost model (a prefill slows as it goes), ages come from
stage 0's clock, and the scheduler reports only prompts longer than one chunk."""
import pytest

from pipefill.base.plan import NewRequest, SamplingParams
from pipefill.chunking import ChunkPolicy
from pipefill.chunking.progress import (PrefillProgress, ProgressClock, eta_seconds,
                                        shape_coefficients)
from pipefill.kv.pool import PagePool
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig


def test_eta_scales_time_by_the_cost_left():
    # Linear: half done in 10 s -> 10 s left.
    assert eta_seconds(10.0, 0, 500, 1000) == pytest.approx(10.0)
    # Quadratic cost (a=1, b=0): the second half costs 3x the first.
    assert eta_seconds(10.0, 0, 500, 1000, (1.0, 0.0, 0.0)) == pytest.approx(30.0)
    # A cached prefix is not time spent: 200 cached, 300 computed in 6 s, 500 left.
    assert eta_seconds(6.0, 200, 500, 1000) == pytest.approx(10.0)
    assert eta_seconds(0.0, 0, 0, 1000) is None


def test_shapes_weigh_attention_against_weights():
    # Two layers of 100 weights, width 10: F(L) = 20 L² + 400 L FLOPs.
    assert shape_coefficients([100.0, 100.0], 10) == (20.0, 400.0)
    # Without a fitted model the clock uses the shapes' F, not a line: 40 tokens (F(40) =
    # 48,000 FLOPs) took 4 s; F(100) - F(40) = 192,000 FLOPs are left -> 16 s, not 6 s.
    t = [0.0]
    clock = ProgressClock(lambda: t[0], prior=(20.0, 400.0))
    clock.report([("a", 0, 100)])
    t[0] = 4.0
    assert clock.report([("a", 40, 100)])[0].eta_s == pytest.approx(16.0)
    # A fitted model wins over the shapes.
    assert clock.report([("a", 40, 100)], (0.0, 1.0, 0.0))[0].eta_s == pytest.approx(6.0)


def test_clock_ages_and_forgets():
    t = [100.0]
    clock = ProgressClock(lambda: t[0])
    assert clock.report([("a", 0, 100)])[0].age_s == 0
    t[0] = 104.0
    (p,) = clock.report([("a", 40, 100)])
    assert p.age_s == 4.0 and p.eta_s == pytest.approx(6.0)
    assert p.line() == "prefill 40/100 eta 6.0s"
    assert PrefillProgress.of(p.as_list()) == p
    clock.report([])  # a finished
    t[0] = 110.0
    assert clock.report([("a", 0, 100)])[0].age_s == 0  # a new request with the same id


def test_scheduler_reports_prompts_longer_than_a_chunk():
    cfg = SchedulerConfig(16, 64, 8, 1024, (2,))
    s = Scheduler(cfg, PagePool(64), ChunkPolicy(32))
    for rid, n in (("long", 100), ("short", 20)):
        s.add(NewRequest(rid, [3] * n, SamplingParams(max_new_tokens=1)))
    s.schedule()
    assert s.long_prefills() == [("long", 32, 100)]
