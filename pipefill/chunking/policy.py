"""Stage 0's chunk policy at start-up: fixed C0, dynamic chunks from a profiled cost model, the
simulator's pick for `--chunked-prefill-size auto`, and online calibration. A failed profile
or fit never stops the server: it logs a warning and keeps fixed chunks.

Without a cached profile, `--dynamic-chunking-profile background` (the default) serves at once
with fixed chunks and runs the profile's prefills one at a time while stage 0 is idle; the
loop then installs the fitted policy (at a request boundary: idle means no prompt is half
chunked)."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from pipefill.chunking import (PROFILE_SAMPLES, ChunkSizePredictor, OnlineCalibrator,
                               fit_quadratic, fit_relative_error, profile_lengths)
from pipefill.config import ServerArgs
from pipefill.sim import CostModel, Transfer, default_c0_grid, pick, tune

log = logging.getLogger(__name__)

FALLBACK_C0 = 2048
# 'auto' profiles up to 1.25 x the largest C0 of its grid: keep it modest, the profile runs
# at start-up (once; it is cached).
AUTO_LARGEST_C0 = 8192
SMOOTH_GRID = (0.0, 0.5, 0.65, 0.75, 0.85, 1.0)


@dataclass
class ProfileSetup:
    """What stage 0 profiles, the cache key of the result, and what the result is for."""
    auto: bool
    dynamic: bool
    tune_len: int
    grid: list[int]
    lengths: list[int]
    key: dict


@dataclass
class ChunkPolicy:
    c0: int
    next_chunk_size: Callable[[int], int] | None = None  # None: fixed chunks
    calibrator: OnlineCalibrator | None = None
    info: dict = field(default_factory=dict)  # reported to the front end with "ready"
    background: BackgroundProfile | None = None  # a profile still to run while idle

    def observe(self, plan, result) -> None:
        """Online calibration from one micro-batch's timing (single-chunk prefills only)."""
        if self.calibrator is None or len(plan.seqs) != 1 or not result.stage_seconds:
            return
        work = plan.seqs[0]
        if work.num_tokens > 1:  # a prefill chunk, not a decode step
            self.calibrator.observe(work.num_tokens, work.start, max(result.stage_seconds))

    def idle_step(self, scheduler) -> bool:
        """Stage 0's loop calls this when nothing is in flight and nothing waits: one prefill
        of the background profile, and after the last one the fitted policy replaces the
        fixed chunks. Idle means no prompt is half chunked, so the switch is at a request
        boundary. False when there was nothing to do."""
        bg = self.background
        if bg is None:
            return False
        try:
            if not bg.step(scheduler):
                return False
            if not bg.run.finished:
                return True
            new = bg.fitted_policy()
        except Exception as e:  # noqa: BLE001 - a failed profile keeps the fixed chunks
            log.warning("dynamic chunking disabled (background profile failed: %s); keeping "
                        "fixed chunks of %d tokens", e, self.c0)
            new = ChunkPolicy(self.c0, info={"mode": "fixed", "c0": self.c0,
                                             "fallback": str(e)})
        self.background = None
        self._install(new, scheduler, bg.args.max_prefill_tokens)
        return True

    def _install(self, new: ChunkPolicy, scheduler, max_prefill_tokens: int) -> None:
        was = self.c0
        self.c0, self.next_chunk_size = new.c0, new.next_chunk_size
        self.calibrator, self.info = new.calibrator, new.info
        scheduler.cfg = dataclasses.replace(
            scheduler.cfg, chunked_prefill_size=new.c0,
            max_prefill_tokens=max(max_prefill_tokens, new.c0))
        scheduler.next_chunk_size = new.next_chunk_size or (
            lambda _: scheduler.cfg.chunked_prefill_size)
        error = new.info.get("fit_rel_rms")
        log.info("dynamic chunking: profile ready, switched from fixed chunks of %d to %s "
                 "chunks, C0 %d%s", was, new.info["mode"], new.c0,
                 "" if error is None else f", quadratic fit error {100 * error:.1f}% RMS")


@dataclass
class BackgroundProfile:
    """The profile's prefills, run by stage 0's loop one per idle turn on pages it borrows
    from the pool and gives back before the next plan."""
    args: ServerArgs
    setup: ProfileSetup
    executor: object
    layer_counts: list[int]
    run: ProfileRun
    started: float = field(default_factory=time.monotonic)

    def step(self, scheduler) -> bool:
        """One prefill; False when the pool has no room for it now (it waits for frees)."""
        pool = scheduler.pool
        n = self.run.pages_needed(self.args.page_size)
        if _tier_ops_pending(scheduler.kv) or pool.num_free - scheduler.kv.promised < n:
            return False
        pages = pool.allocate(n)
        try:
            self.run.step(self.executor, pages)
        finally:
            pool.release(pages)
            # No stage ever heard of these pages: their release is no news for the next plan.
            assert pool.freed[-n:] == pages, "profile pages interleaved with other frees"
            del pool.freed[-n:]
        return True

    def fitted_policy(self) -> ChunkPolicy:
        from pipefill.runtime.profile import save
        lengths, seconds = self.setup.lengths, self.run.seconds
        where = save(self.setup.key, lengths, seconds, self.args.dynamic_chunking_profile_cache)
        log.info("dynamic chunking: background profile done: %d lengths (+1 warm-up, %d timed "
                 "twice), %.1f s of stage 0's time within %.1f s", len(lengths),
                 self.run.retimed, self.run.busy_s, time.monotonic() - self.started)
        try:
            return _policy_from_profile(self.args, self.setup, lengths, seconds, where, False,
                                        self.executor, self.layer_counts)
        except Exception as e:  # noqa: BLE001 - an unusable fit keeps fixed chunks, loudly
            return _fallback(self.args, e)


def _tier_ops_pending(kv) -> bool:
    """Copies to the host or storage tier queued for the next plan may read pages that are
    free already (evicted): the profile must not write any page before they ran."""
    return any(t is not None and t.ops for t in (kv.host, kv.storage))


def build_chunk_policy(args: ServerArgs, executor, model_file: str, layers: range,
                       layer_counts: list[int]) -> ChunkPolicy:
    c0 = args.chunked_prefill_size
    dynamic = args.enable_dynamic_chunking and args.pp_size > 1
    idle_flag = calibration_without_effect(args)
    if idle_flag is not None:
        log.warning("--dynamic-chunking-online-calibration has no effect: %s", idle_flag)
    if c0 != "auto" and not dynamic:
        return ChunkPolicy(c0, info={"mode": "fixed", "c0": c0})
    from pipefill.runtime.profile import load_cached, measure, save
    try:
        setup = _profile_setup(args, executor, model_file, layers, dynamic)
        cache_dir = args.dynamic_chunking_profile_cache
        cached = load_cached(setup.key, cache_dir)
        if cached is not None:
            return _policy_from_profile(args, setup, *cached, True, executor, layer_counts)
        if args.dynamic_chunking_profile == "background":
            return _background(args, setup, executor, layer_counts)
        seconds = measure(executor, setup.lengths)
        where = save(setup.key, setup.lengths, seconds, cache_dir)
        return _policy_from_profile(args, setup, setup.lengths, seconds, where, False,
                                    executor, layer_counts)
    except Exception as e:  # noqa: BLE001 - any profiling failure falls back, loudly
        return _fallback(args, e)


def calibration_without_effect(args: ServerArgs) -> str | None:
    """Why --dynamic-chunking-online-calibration cannot change any chunk, or None. It refits
    dynamic chunking's cost model, and dynamic chunking runs only with pipeline stages."""
    if not args.dynamic_chunking_online_calibration:
        return None
    if not args.enable_dynamic_chunking:
        return "--enable-dynamic-chunking is off, so chunks are fixed and no cost model is fitted"
    if args.pp_size == 1:
        return ("--pp-size is 1, where dynamic chunking is off (equal-time chunks only matter "
                "between pipeline stages)")
    return None


def _fallback(args: ServerArgs, e: Exception) -> ChunkPolicy:
    c0 = args.chunked_prefill_size
    fixed = c0 if c0 != "auto" else FALLBACK_C0
    log.warning("dynamic chunking disabled (%s); using fixed chunks of %d tokens%s", e, fixed,
                " (--dynamic-chunking-online-calibration has no effect either)"
                if calibration_without_effect(args) is None and
                args.dynamic_chunking_online_calibration else "")
    return ChunkPolicy(fixed, info={"mode": "fixed", "c0": fixed, "fallback": str(e)})


def _background(args, setup: ProfileSetup, executor, layer_counts) -> ChunkPolicy:
    from pipefill.runtime.profile import ProfileRun
    c0 = FALLBACK_C0 if setup.auto else args.chunked_prefill_size
    what = "--chunked-prefill-size auto" if setup.auto else "dynamic chunking"
    log.info("%s: profiling in background, serving with fixed chunks of %d", what, c0)
    bg = BackgroundProfile(args, setup, executor, layer_counts, ProfileRun(setup.lengths))
    return ChunkPolicy(c0, info={"mode": "profiling", "c0": c0, "samples": len(setup.lengths)},
                       background=bg)


def _profile_setup(args, executor, model_file, layers, dynamic) -> ProfileSetup:
    from pipefill.runtime.profile import profile_key
    auto = args.chunked_prefill_size == "auto"
    tune_len = min(args.tune_input_len or args.max_model_len, args.max_model_len)
    grid = default_c0_grid(tune_len, args.page_size, args.max_prefill_tokens,
                           AUTO_LARGEST_C0) if auto else []
    profile_c0 = max(grid) if auto else args.chunked_prefill_size
    lengths = profile_lengths(profile_c0, PROFILE_SAMPLES)
    backend = type(executor.cache).__name__
    key = profile_key(model_file, args.dtype, layers, args.layout.num_threads, profile_c0,
                      args.page_size, backend, lengths)
    return ProfileSetup(auto, dynamic, tune_len, grid, lengths, key)


def _policy_from_profile(args, setup: ProfileSetup, lengths, seconds, where, hit, executor,
                         layer_counts) -> ChunkPolicy:
    auto, dynamic, tune_len, grid = setup.auto, setup.dynamic, setup.tune_len, setup.grid
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
                      transfer, args.layout.max_inflight, args.page_size, args.max_prefill_tokens)
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
