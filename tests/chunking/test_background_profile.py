"""Dynamic chunking with the start-up profile in the background: the server
answers at once with fixed chunks, stage 0 profiles while idle on pages it borrows from the
pool, then switches to the fitted chunks; outputs equal HF transformers before and after; a
cached profile skips the background phase."""
import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import assert_pages_free, hf_reference, save_tiny_model, track
from pipefill import Engine
from pipefill.chunking.cost import ChunkSizePredictor, profile_lengths
from pipefill.chunking.policy import ChunkPolicy
from pipefill.chunking.profile import slow_outliers
from pipefill.chunking.startup import build_chunk_policy
from pipefill.config import make_server_args
from pipefill.frontend import prepare
from pipefill.kv.pool import PagePool
from pipefill.runtime.stage import build_stage
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig

# C0 is large enough that the profile's longest prefills (1.25 * C0) cost clearly more than
# linearly even on the tiny model: at C0 = 256 the constant per-step cost hid the quadratic
# term, and timing noise sometimes fitted a concave cost (CI at stops 9 and 18).
PAGE, C0 = 16, 1024
PROMPT = [(11 * i + 5) % 512 for i in range(2400)]
FIXED = [1024, 1024, 352]


@pytest.fixture(scope="module")
def model7(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama7bg"), num_hidden_layers=7,
                           max_position_embeddings=4096)


@pytest.fixture(scope="module")
def reference(model7):
    return hf_reference(model7, PROMPT, 8, full_forwards=True)


def engine(model, cache_dir, **kw):
    # The prefix cache is off so that every run computes the whole prompt in its own chunks.
    return track(Engine(model, dtype="float32", page_size=PAGE, threads_per_stage=1, pp_size=2,
                        chunked_prefill_size=C0, enable_dynamic_chunking=True,
                        disable_radix_cache=True, dynamic_chunking_profile_cache=str(cache_dir),
                        **kw))


def run_and_check(e, reference):
    out = e.generate([PROMPT], max_new_tokens=8, ignore_eos=True,
                     return_prompt_logprobs=True)[0]
    ref_lp, ref_tokens = reference
    assert out.output_ids == ref_tokens
    assert (torch.tensor(out.prompt_logprobs) - ref_lp).abs().max().item() < 1e-4
    assert_pages_free(e)
    return out


def wait_for_switch(e, limit_s=300.0) -> dict:
    """Stage 0's chunking state once the background profile is over (a hang guard only)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        info = e.stats()["chunking"]
        if info["mode"] != "profiling":
            return info
        time.sleep(0.2)
    raise AssertionError("the background profile never finished")


def expected_chunks(e, info) -> list[int]:
    a, b, c = info["coefficients"]
    p = ChunkSizePredictor(info["c0"], PAGE, info["smooth_factor"], e.args.max_model_len,
                           e.args.max_prefill_tokens)
    p.set_model(a, max(b, 0.0), c, info["target_latency_s"])
    return p.chunk_sequence(len(PROMPT))


def profile_then_switch(model, cache_dir, reference):
    """One engine life: served with fixed chunks while profiling, then the switch. Returns the
    chunking state after the switch and the chunks of a request served after it."""
    with engine(model, cache_dir) as e:
        # "ready" came before the first profile prefill: the server answers at once.
        assert e.chunking == {"mode": "profiling", "c0": C0,
                              "samples": len(profile_lengths(C0))}
        before = run_and_check(e, reference)
        assert before.metrics["chunk_sizes"] == FIXED  # served with fixed chunks of C0
        info = wait_for_switch(e)
        after = run_and_check(e, reference)
        if info["mode"] == "dynamic":
            assert after.metrics["chunk_sizes"] == expected_chunks(e, info)
        return info, after.metrics["chunk_sizes"]


def test_serves_during_profile_switches_then_cache_hit(model7, reference, tmp_path):
    # Should timing noise still fit a concave cost, the policy rightly stays fixed; a fresh
    # profile (new cache folder) is then taken, at most three in all.
    for attempt in range(3):
        cache_dir = tmp_path / f"profile{attempt}"
        info, chunks = profile_then_switch(model7, cache_dir, reference)
        if info["mode"] == "dynamic":
            break
        assert info["mode"] == "fixed" and "not convex" in info["fallback"], info
        assert chunks == FIXED
    assert info["mode"] == "dynamic" and not info["profile_cache_hit"], info
    assert info["samples"] == len(profile_lengths(C0)) and info["fit_rel_rms"] >= 0
    assert chunks[:2] != FIXED[:2]  # the fitted policy is in use
    with engine(model7, cache_dir) as e:  # the profile is cached: no background phase
        assert e.chunking["mode"] == "dynamic" and e.chunking["profile_cache_hit"]
        assert e.chunking["coefficients"] == info["coefficients"]
        assert e.stats()["chunking"] == e.chunking
        hit = run_and_check(e, reference)
        assert hit.metrics["chunk_sizes"] == chunks


@pytest.fixture(scope="module")
def stage0(model7, tmp_path_factory):
    """Stage 0 of a PP2 pipeline built in this process, its args and layer slice."""
    args, source = prepare(make_server_args(
        model7, dtype="float32", page_size=PAGE, threads_per_stage=1, pp_size=2,
        chunked_prefill_size=64, enable_dynamic_chunking=True, max_total_tokens=2048))
    info = args.layout.stage(0)
    return args, source, info, build_stage(args, source, info)


def scheduler_for(args, num_pages, policy):
    cfg = SchedulerConfig(page_size=PAGE, max_prefill_tokens=4096, max_running_requests=4,
                          max_model_len=args.max_model_len)
    return Scheduler(cfg, PagePool(num_pages), policy)


def test_idle_steps_borrow_pages_and_give_them_back(stage0, tmp_path):
    args, source, info, executor = stage0
    args = args.replace(dynamic_chunking_profile_cache=str(tmp_path))
    policy = build_chunk_policy(args, executor.profile_bench(), source.path, info.layers,
                                [3, 4])
    assert policy.info["mode"] == "profiling" and policy.background is not None
    num_pages = executor.cache.num_pages
    run = policy.background.run
    total = len(run.lengths) + 1  # a warm-up, then one prefill per length (then retimings)
    # A pool with too few free pages: the profile waits, touching nothing.
    tight = scheduler_for(args, num_pages, policy)
    held = tight.pool.allocate(num_pages - 2)
    assert not policy.idle_step(tight.kv) and policy.background.run.steps_left == total
    tight.pool.release(held)
    # A copy to the host tier queued for the next plan may read a free page: the profile waits.
    tight.kv.host = SimpleNamespace(ops=["copy out of a free page"])
    assert not policy.idle_step(tight.kv) and policy.background.run.steps_left == total
    sched = scheduler_for(args, num_pages, policy)
    owned = sched.pool.allocate(3)  # a request's pages: the profile must not take them
    steps = 0
    while policy.background is not None:
        assert policy.idle_step(sched.kv)
        steps += 1
        sched.pool.check_integrity()
        assert sched.pool.num_used == 3 and sched.pool.freed == []  # nothing to announce
        assert all(sched.pool.refcount(p) == 1 for p in owned)
    assert steps == total + run.retimed and run.retimed <= 4
    assert policy.info["mode"] in ("dynamic", "fixed")
    assert sched.chunk_policy is policy  # the policy changed inside, the scheduler kept it
    if policy.info["mode"] == "dynamic":  # the fitted predictor is the scheduler's now
        assert policy.sizer is not None
    assert sched.chunk_policy.next_chunk(0) == policy.c0 == 64
    assert not policy.idle_step(sched.kv)  # nothing left to do


def test_a_preempted_sample_is_timed_again():
    lengths = profile_lengths(2048)
    seconds = [1e-6 * x * x + 1e-3 * x + 0.05 for x in lengths]
    assert slow_outliers(lengths, seconds) == []
    spiked = list(seconds)
    spiked[3] *= 3  # a prefill that lost the CPU for a while
    spiked[8] *= 2
    again = slow_outliers(lengths, spiked)
    assert {3, 8} <= set(again) and len(again) <= 4
    assert again[-1] == 3  # the worst is timed again first (popped from the end)


def test_failed_background_profile_keeps_fixed_chunks(stage0, tmp_path):
    args, source, info, executor = stage0
    args = args.replace(dynamic_chunking_profile_cache=str(tmp_path))
    policy = build_chunk_policy(args, executor.profile_bench(), source.path, info.layers,
                                [3, 4])

    def broken(num_tokens, pages):
        raise RuntimeError("out of memory")
    policy.background.bench = dataclasses.replace(policy.background.bench, prefill=broken)
    sched = scheduler_for(args, executor.cache.num_pages, policy)
    assert policy.idle_step(sched.kv)
    assert policy.background is None and policy.sizer is None
    assert policy.info["mode"] == "fixed" and "out of memory" in policy.info["fallback"]
    assert sched.pool.num_used == 0 and sched.pool.freed == []
    assert sched.chunk_policy.next_chunk(1000) == 64


def test_loop_profiles_only_at_request_boundaries():
    """Stage 0's loop (in memory, one stage) calls the policy's idle_step only when no request
    is running, so a switch of chunk policy never lands inside a prompt's chunks, and again
    once the server is idle after each request."""
    import threading

    from test_loop_inmemory import FakeExecutor, MemoryChannel

    from pipefill.runtime.loop import FirstStageLoop
    from pipefill.base.plan import NewRequest, SamplingParams

    class RecordingPolicy:  # the loop's side of ChunkPolicy: idle_step and info
        info = {"mode": "profiling"}

        def __init__(self):
            self.seen_running = []

        def idle_step(self, lender):
            self.seen_running.append(len(scheduler.running))
            return True

    channel, policy = MemoryChannel(), RecordingPolicy()
    scheduler = Scheduler(SchedulerConfig(16, 64, 8, 4096), PagePool(64), ChunkPolicy(32))
    loop = FirstStageLoop(FakeExecutor(0), scheduler, channel, chunk_policy=policy)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    for rid in ("a", "b"):
        calls = len(policy.seen_running)
        channel.inbox.put(("add", [NewRequest(rid, list(range(320)),
                                              SamplingParams(max_new_tokens=3))]))
        finished = False
        while not finished:
            kind, payload = channel.reports.get(timeout=20)
            finished = kind == "outputs" and any(o.finished for o in payload)
        deadline = time.monotonic() + 20  # a hang guard: the idle loop profiles again
        while len(policy.seen_running) == calls and time.monotonic() < deadline:
            time.sleep(0.01)
    channel.inbox.put(("stop", None))
    thread.join(10)
    assert not thread.is_alive()
    assert set(policy.seen_running) == {0}, policy.seen_running  # never inside a request
    assert len(policy.seen_running) >= 2  # and again after each request
