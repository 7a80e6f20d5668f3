"""Stage 0's chunk policy at start-up: fixed C0, dynamic chunks from a profiled cost model, the
simulator's pick for `--chunked-prefill-size auto`, and online calibration. A failed profile
or fit never stops the server: it logs a warning and keeps fixed chunks."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from pipefill.chunking import (MAX_PROFILE_SAMPLES, ChunkSizePredictor, OnlineCalibrator,
                               fit_quadratic, fit_relative_error, profile_lengths)
from pipefill.config import ServerArgs
from pipefill.sim import CostModel, Transfer, default_c0_grid, pick, tune

log = logging.getLogger(__name__)

FALLBACK_C0 = 2048
# 'auto' profiles up to 1.25 x the largest C0 of its grid: keep both modest, the profile runs
# at start-up (once; it is cached).
AUTO_PROFILE_SAMPLES = 16
AUTO_LARGEST_C0 = 8192
SMOOTH_GRID = (0.0, 0.5, 0.65, 0.75, 0.85, 1.0)


@dataclass
class ChunkPolicy:
    c0: int
    next_chunk_size: Callable[[int], int] | None = None  # None: fixed chunks
    calibrator: OnlineCalibrator | None = None
    info: dict = field(default_factory=dict)  # reported to the front end with "ready"

    def observe(self, plan, result) -> None:
        """Online calibration from one micro-batch's timing (single-chunk prefills only)."""
        if self.calibrator is None or len(plan.seqs) != 1 or not result.stage_seconds:
            return
        work = plan.seqs[0]
        if work.num_tokens > 1:  # a prefill chunk, not a decode step
            self.calibrator.observe(work.num_tokens, work.start, max(result.stage_seconds))


def build_chunk_policy(args: ServerArgs, executor, model_file: str, layers: range,
                       layer_counts: list[int]) -> ChunkPolicy:
    c0 = args.chunked_prefill_size
    dynamic = args.enable_dynamic_chunking and args.pp_size > 1
    if c0 != "auto" and not dynamic:
        return ChunkPolicy(c0, info={"mode": "fixed", "c0": c0})
    try:
        return _profiled_policy(args, executor, model_file, layers, layer_counts, dynamic)
    except Exception as e:  # noqa: BLE001 - any profiling failure falls back, loudly
        fixed = c0 if c0 != "auto" else FALLBACK_C0
        log.warning("dynamic chunking disabled (%s); using fixed chunks of %d tokens", e, fixed)
        return ChunkPolicy(fixed, info={"mode": "fixed", "c0": fixed, "fallback": str(e)})


def _profiled_policy(args, executor, model_file, layers, layer_counts, dynamic) -> ChunkPolicy:
    from pipefill.runtime.profile import load_or_measure, profile_key
    auto = args.chunked_prefill_size == "auto"
    tune_len = min(args.tune_input_len or args.max_model_len, args.max_model_len)
    grid = default_c0_grid(tune_len, args.page_size, args.max_prefill_tokens,
                           AUTO_LARGEST_C0) if auto else []
    profile_c0 = max(grid) if auto else args.chunked_prefill_size
    lengths = profile_lengths(profile_c0, AUTO_PROFILE_SAMPLES if auto else MAX_PROFILE_SAMPLES)
    backend = type(executor.cache).__name__
    key = profile_key(model_file, args.dtype, layers, args.num_threads, profile_c0,
                      args.page_size, backend, lengths)
    lengths, seconds, where, hit = load_or_measure(executor, lengths, key,
                                                   args.dynamic_chunking_profile_cache)
    a, b, c = fit_quadratic(lengths, seconds)
    fit_error = fit_relative_error(lengths, seconds, (a, b, c))
    log.info("start-up profile: %d lengths (%d..%d tokens), %.1f s of prefills, quadratic fit "
             "error %.1f%% RMS", len(lengths), min(lengths), max(lengths), sum(seconds),
             100 * fit_error)
    c0, sigma = args.chunked_prefill_size, args.dynamic_chunking_smooth_factor
    info = {"profile": where, "profile_cache_hit": hit, "coefficients": [a, b, c],
            "samples": len(lengths), "fit_rel_rms": fit_error}
    if auto:
        model = CostModel(a, max(b, 0.0), c).with_stages(args.pp_size, layer_counts)
        transfer = Transfer(bytes_per_token=executor.model.cfg.hidden_size * 6)
        ranked = tune(model, tune_len, grid, list(SMOOTH_GRID) if dynamic else [0.0],
                      transfer, args.max_inflight, args.page_size, args.max_prefill_tokens)
        best, second = pick(ranked)
        c0, sigma = best.c0, best.smooth
        why = ("runner-up" if second.ttft_s >= best.ttft_s else
               "predicted faster but within 3% with more chunks")
        log.info("--chunked-prefill-size auto: C0 = %d%s for %d-token prompts on %d stage(s): "
                 "predicted TTFT %.2f s (%s: C0 = %d%s, %.2f s)", c0,
                 f", smooth factor {sigma}" if dynamic else "", tune_len, args.pp_size,
                 best.ttft_s, why, second.c0, f", smooth {second.smooth}" if dynamic else "",
                 second.ttft_s)
        info.update(auto={"tune_input_len": tune_len, "best": vars(best),
                          "runner_up": vars(second)})
    predictor = ChunkSizePredictor(c0, args.page_size, sigma, args.max_model_len,
                                   args.max_prefill_tokens)
    if not dynamic:
        return ChunkPolicy(c0, info={**info, "mode": "fixed", "c0": c0})
    predictor.fit(lengths, seconds)
    info.update(mode="dynamic", c0=c0, smooth_factor=sigma,
                target_latency_s=predictor.target_latency)
    log.info("dynamic chunking on: C0 %d, smooth factor %.2f, T* %.3f s, f(l) = %.3g l^2 + "
             "%.3g l + %.3g", c0, sigma, predictor.target_latency, *predictor.coefficients)
    if args.dynamic_chunking_online_calibration:
        calibrator = OnlineCalibrator(predictor)
        return ChunkPolicy(c0, calibrator.next_chunk_size, calibrator,
                           {**info, "online_calibration": True})
    return ChunkPolicy(c0, predictor.next_chunk_size, None, info)
