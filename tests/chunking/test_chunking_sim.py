"""Chunk-size prediction and the pipeline simulator, without processes."""
import math

import pytest

from pipefill.chunking.calibration import OnlineCalibrator
from pipefill.chunking.cost import PROFILE_SAMPLES, ChunkSizePredictor, profile_lengths
from pipefill.chunking.sim import CostModel, Transfer, simulate, simulate_costs

A, B, C = 1e-6, 1e-3, 0.05


def by_hand(prompt_len, c0, sigma, page, max_len=10**6, budget=10**6):
    """The §5 recipe written out step by step, independently of the implementation."""
    target = A * c0 * c0 + B * c0
    sizes, done = [], 0
    while done < prompt_len:
        if done == 0:
            s = c0
        else:
            lin = 2 * A * done + B
            x = (-lin + math.sqrt(lin * lin + 4 * A * target)) / (2 * A)
            g = max(page, 64)
            s = c0 + sigma * (x - c0)
            s = max(math.floor(s), c0 // 4)
            s = max(s // g * g, g)
            s = min(s, max_len - done - 100, budget)
            s = s // g * g
            if s < g:
                s = c0
        sizes.append(min(s, prompt_len - done))
        done += sizes[-1]
    return sizes


def predictor(c0, sigma, page, **kw):
    p = ChunkSizePredictor(c0, page_size=page, smooth_factor=sigma, **kw)
    p.set_model(A, B, C, A * c0 * c0 + B * c0)
    return p


def test_first_continuation_chunk_by_hand():
    # T* = 1e-6 * 1024^2 + 1e-3 * 1024 = 2.072576 s; the root at L = 1024 is x = 572.46...
    assert predictor(1024, 1.0, 64).next_chunk_size(1024) == 512  # floor(572/64)*64
    assert predictor(1024, 0.75, 64).next_chunk_size(1024) == 640  # 1024 - .75*451.5 = 685
    assert predictor(1024, 0.65, 64).next_chunk_size(1024) == 704  # 730
    assert predictor(1024, 0.65, 128).next_chunk_size(1024) == 640
    assert predictor(1024, 0.0, 64).next_chunk_size(1024) == 1024


@pytest.mark.parametrize("page", [16, 64, 128])
@pytest.mark.parametrize("sigma", [0.0, 0.65, 0.75, 1.0])
def test_chunk_sequences(sigma, page):
    p = predictor(2048, sigma, page)
    for n in (100, 2048, 5000, 40000):
        seq = p.chunk_sequence(n)
        assert seq == by_hand(n, 2048, sigma, page)
        assert sum(seq) == n and seq[0] == min(2048, n)
    if sigma == 0:
        assert p.chunk_sequence(10000) == [2048] * 4 + [1808]  # fixed chunking
    else:
        seq = p.chunk_sequence(40000)
        assert seq[1:-1] == sorted(seq[1:-1], reverse=True)  # later chunks shrink
        assert min(seq[:-1]) >= 2048 // 4 // 64 * 64


def test_caps_by_context_and_budget():
    p = predictor(1024, 1.0, 64, max_model_len=3000, max_prefill_tokens=512)
    assert p.next_chunk_size(100) == 512  # the token budget caps it
    assert predictor(1024, 1.0, 64, max_model_len=1200).next_chunk_size(1050) == 1024  # < g


def test_fit_recovers_the_model_and_clamps_b():
    lengths = profile_lengths(2048)
    assert lengths[0] == 2560 and len(lengths) == PROFILE_SAMPLES and lengths[-1] > 0
    p = ChunkSizePredictor(2048)
    p.fit(lengths, [A * x * x + B * x + C for x in lengths])
    a, b, c = p.coefficients
    assert a == pytest.approx(A, rel=1e-6) and b == pytest.approx(B, rel=1e-6)
    assert p.target_latency == pytest.approx(A * 2048**2 + B * 2048, rel=1e-6)
    p.fit(lengths, [A * x * x - 1e-4 * x + C for x in lengths])
    assert p.coefficients[1] == 0.0  # b < 0 is clamped


@pytest.mark.parametrize("c0", [64, 256, 2048, 8192])
def test_profile_lengths_are_distinct_and_quadratically_spread(c0):
    lengths = profile_lengths(c0)
    top = int(1.25 * c0)
    assert lengths == sorted(set(lengths), reverse=True) and len(lengths) >= 8
    assert lengths[0] == top and 0 < lengths[-1] <= top // 16
    gaps = [x - y for x, y in zip(lengths, lengths[1:])]
    assert gaps[0] > 4 * gaps[-1]  # dense where prefills are cheap, sparse where they are long
    if c0 >= 2048:  # the whole profile: about a third of PROFILE_SAMPLES full-length ones
        assert sum(lengths) < 0.35 * PROFILE_SAMPLES * top


def test_few_noisy_samples_predict_far_prefixes():
    """With 2% timing noise, the chunk sizes predicted from the 12-length profile stay within
    10% of the true model's at prefixes 4 to 64 times C0 (what the profile extrapolates to;
    the old 128 lengths: within 3%, at ten times the cost)."""
    import random
    lengths = profile_lengths(2048)
    truth = predictor(2048, 1.0, 64)
    for seed in range(50):
        rng = random.Random(seed)
        p = ChunkSizePredictor(2048, 64, 1.0)
        p.fit(lengths, [(A * x * x + B * x + C) * (1 + rng.uniform(-0.02, 0.02))
                        for x in lengths])
        for prefix in (8192, 32768, 131072):
            assert p.raw_size(prefix) == pytest.approx(truth.raw_size(prefix), rel=0.10)


@pytest.mark.parametrize("latencies, match", [
    ([-A * x * x + B * x for x in range(100, 1000, 100)], "not convex"),
    ([1.0] * 7, "at least 8"),
    ([float("nan")] * 9, "not convex"),
])
def test_unusable_fits_raise(latencies, match):
    with pytest.raises(ValueError, match=match):
        ChunkSizePredictor(512).fit(list(range(100, 100 + 100 * len(latencies), 100)),
                                    latencies)


def test_no_prediction_without_a_positive_target():
    p = ChunkSizePredictor(1024)
    assert p.next_chunk_size(5000) == 1024  # unfitted
    p.set_model(A, B, C, 0.0)  # T* <= 0
    assert p.next_chunk_size(5000) == 1024


def test_online_calibration_refits_from_timings():
    base = predictor(1024, 1.0, 64)
    cal = OnlineCalibrator(base)
    truth = (2e-6, 5e-4, 0.02)  # the real machine is slower than the profile said
    for size, hist in [(1024, 0), (1024, 0), (768, 1024), (640, 1792), (512, 2432),
                       (512, 2944)]:
        cal.observe(size, hist, truth[0] * size * (size + hist) + truth[1] * (size + hist)
                    + truth[2])
    assert cal.model == pytest.approx(truth, rel=1e-6)
    target = truth[0] * 1024 * 1024 + truth[1] * 1024 + truth[2]
    assert cal.target() == pytest.approx(target)
    # t(x, 1024) = T*: 2e-6 x^2 + 0.002548 x - 2.097152 = 0 -> x = 568.9 -> 512 (page 64)
    a, b, c = truth
    lin, const = a * 1024 + b, b * 1024 + c - target
    x = (-lin + math.sqrt(lin * lin - 4 * a * const)) / (2 * a)
    assert 568 < x < 570
    assert cal.next_chunk_size(1024) == 512


def timing(truth, size, hist):
    a, b, c = truth
    return a * size * (size + hist) + b * (size + hist) + c


CHUNKS = [(1024, 0), (768, 1024), (640, 1792), (512, 2432), (512, 2944), (1024, 0),
          (896, 1024), (576, 1920)]


def test_online_calibration_follows_the_recent_window():
    """The machine gets twice as slow after 40 chunks: once the window holds only new timings
    the fit is the new machine's, exactly (it kept refitting past the first 30)."""
    cal = OnlineCalibrator(predictor(1024, 1.0, 64))
    fast, slow = (1e-6, 5e-4, 0.01), (2e-6, 1e-3, 0.02)
    for i in range(40):
        cal.observe(*CHUNKS[i % len(CHUNKS)], timing(fast, *CHUNKS[i % len(CHUNKS)]))
    assert cal.model == pytest.approx(fast, rel=1e-6)
    for i in range(OnlineCalibrator.WINDOW):
        cal.observe(*CHUNKS[i % len(CHUNKS)], timing(slow, *CHUNKS[i % len(CHUNKS)]))
    assert len(cal.samples) == OnlineCalibrator.WINDOW
    assert cal.model == pytest.approx(slow, rel=1e-6)
    assert cal.target() == pytest.approx(timing(slow, 1024, 0))  # T* from recent C0 chunks
    assert cal.num_fits == 40 + OnlineCalibrator.WINDOW - OnlineCalibrator.MIN_SAMPLES + 1


def test_online_calibration_window_mixes_old_and_new_while_it_turns_over():
    cal = OnlineCalibrator(predictor(1024, 1.0, 64), window=8)
    fast, slow = (1e-6, 5e-4, 0.01), (2e-6, 1e-3, 0.02)
    for size, hist in CHUNKS:
        cal.observe(size, hist, timing(fast, size, hist))
    for size, hist in CHUNKS[:4]:
        cal.observe(size, hist, timing(slow, size, hist))
    assert [s.seconds for s in cal.samples] == (
        [timing(fast, *c) for c in CHUNKS[4:]] + [timing(slow, *c) for c in CHUNKS[:4]])
    assert fast[0] < cal.model[0] < slow[0]  # between the two machines, not either one


def test_online_calibration_says_when_it_has_no_effect(caplog):
    from pipefill.config import ServerArgs
    from pipefill.chunking.startup import build_chunk_policy, calibration_without_effect
    on = dict(dynamic_chunking_online_calibration=True)
    assert calibration_without_effect(ServerArgs()) is None
    assert calibration_without_effect(ServerArgs(enable_dynamic_chunking=True, pp_size=2,
                                                 **on)) is None
    assert "--enable-dynamic-chunking is off" in calibration_without_effect(ServerArgs(**on))
    assert "--pp-size is 1" in calibration_without_effect(
        ServerArgs(enable_dynamic_chunking=True, **on))
    with caplog.at_level("WARNING", logger="pipefill.chunking.startup"):
        policy = build_chunk_policy(ServerArgs(**on), None, "", range(2), [2])
    assert policy.info["mode"] == "fixed"
    assert [r.getMessage() for r in caplog.records] == [
        "--dynamic-chunking-online-calibration has no effect: --enable-dynamic-chunking is "
        "off, so chunks are fixed and no cost model is fitted"]


def test_simulator_hand_worked_three_stages():
    costs = [[1, 2, 3, 4], [2, 2, 2, 2], [1, 3, 1, 1]]
    r = simulate_costs(costs, [0.5] * 4, max_inflight=3)
    # end[s][k] = max(end[s][k-1], end[s-1][k] + d) + t_s(k), worked out on paper:
    assert r.end == [[1, 3, 6, 10], [3.5, 5.5, 8.5, 12.5], [5, 9, 10, 14]]
    assert r.ttft_s == 14
    assert r.busy_s == [10, 8, 6]
    assert r.bubble_ratio == pytest.approx(1 - 24 / 42)
    # Two micro-batches in flight: chunk 2 waits for chunk 0's result (5 + 0.5).
    r2 = simulate_costs(costs, [0.5] * 4, max_inflight=2)
    assert r2.start[0][2] == 5.5 and r2.end[0][2] == 8.5


def test_simulator_cost_model_and_equal_chunks():
    model = CostModel(A, B, C, (1.0, 1.5))
    assert model.chunk_seconds(1, 100, 1000) == pytest.approx(
        1.5 * (A * 100 * 2100 + B * 100 + C))
    fixed = simulate(model, [2048] * 8, Transfer(0.0, 0, 1.0))
    dyn = simulate(model, predictor(2048, 1.0, 64).chunk_sequence(16384), Transfer(0.0, 0, 1.0))
    assert dyn.bubble_ratio < fixed.bubble_ratio
    assert fixed.bubble_theory == pytest.approx(1 / 9)


def test_auto_pick_prefers_fewer_chunks_in_a_near_tie():
    from pipefill.chunking.sim import Candidate, pick
    ranked = [Candidate(512, 0.5, 10.0, 0.05, 60), Candidate(1024, 0.85, 10.02, 0.06, 30),
              Candidate(2048, 0.0, 11.0, 0.2, 8)]
    chosen, runner_up = pick(ranked)
    assert (chosen.c0, runner_up.c0) == (1024, 512)
    assert pick(ranked, tolerance=0.0)[0].c0 == 512


def test_cost_model_from_shapes():
    from pipefill.chunking.sim import CostModel
    # Two stages of 2 and 1 layers; 1e6 weights per layer except the third (3e6).
    m = CostModel.from_shapes([1e6, 1e6, 3e6], attention_width=1000, counts=[2, 1], flops=1e9,
                              overhead_s=0.002)
    assert m.b == pytest.approx(2 * 2e6 / 1e9) and m.a == pytest.approx(2 * 1000 / 1e9)
    assert m.c == 0.002 and m.stage_scale == (1.0, 1.5)


def test_sim_runs_from_a_model_config(tmp_path):
    import subprocess
    import sys
    from pipefill.bench.make_model import make_config
    path = tmp_path / "config.json"
    path.write_text(make_config("qwen3-235b-a22b").to_json_string())
    out = subprocess.run([sys.executable, "-m", "pipefill.cli.main", "sim", "--model-config",
                          str(path), "--pp-size", "8", "--input-len", "65536", "--tflops", "400"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "qwen3_moe: 94 layers" in out.stdout and "TTFT" in out.stdout
    assert "[11, 11, 12, 12, 12, 12, 12, 12] layers" in out.stdout
