"""Stage 0's chunk policy at start-up (ARCHITECTURE.md, 'The chunking room'): fixed C0, dynamic
chunks from a profiled cost model, the simulator's pick for `--chunked-prefill-size auto`, and
online calibration. A failed profile or fit never stops the server: it logs a warning and keeps
fixed chunks.

Without a cached profile, `--dynamic-chunking-profile background` (the default) serves at once
with fixed chunks and runs the profile's prefills one at a time while stage 0 is idle; the
policy then becomes the fitted one (at a request boundary: idle means no prompt is half
chunked)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pipefill.chunking.calibration import OnlineCalibrator
from pipefill.chunking.cost import (PROFILE_SAMPLES, ChunkSizePredictor, fit_quadratic,
                                    fit_relative_error, profile_lengths)
from pipefill.chunking.policy import ChunkPolicy, PageLender
from pipefill.chunking.profile import (ProfileBench, ProfileRun, load_cached, measure,
                                       profile_key, save)
from pipefill.chunking.sim import (SMOOTH_GRID, CostModel, Transfer, default_c0_grid, pick,
                                   tune)
from pipefill.config import ServerArgs

log = logging.getLogger(__name__)

# C0 while `--chunked-prefill-size auto` has not picked one (a background profile, a failure).
FALLBACK_C0 = 2048
# 'auto' profiles up to 1.25 x the largest C0 of its grid: keep it modest, the profile runs
# at start-up (once; it is cached).
AUTO_LARGEST_C0 = 8192


def first_chunk_size(args: ServerArgs) -> int:
    """C0 as an int: the flag's number, or FALLBACK_C0 where 'auto' has not picked one yet."""
    c0 = args.chunked_prefill_size
    return FALLBACK_C0 if c0 == "auto" else c0


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
class BackgroundProfile:
    """The profile's prefills, run by stage 0's loop one per idle turn on pages it borrows
    and gives back before the next plan."""
    args: ServerArgs
    setup: ProfileSetup
    bench: ProfileBench
    layer_counts: list[int]
    run: ProfileRun
    started: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return self.run.finished

    def step(self, lender: PageLender) -> bool:
        """One prefill; False when there is no room for it now (it waits for frees)."""
        pages = lender.borrow(self.run.pages_needed(self.bench.page_size))
        if pages is None:
            return False
        try:
            self.run.step(self.bench.prefill, pages)
        finally:
            lender.give_back(pages)
        return True

    def fitted_policy(self) -> ChunkPolicy:
        lengths, seconds = self.setup.lengths, self.run.seconds
        where = save(self.setup.key, lengths, seconds, self.args.dynamic_chunking_profile_cache)
        log.info("dynamic chunking: background profile done: %d lengths (+1 warm-up, %d timed "
                 "twice), %.1f s of stage 0's time within %.1f s", len(lengths),
                 self.run.retimed, self.run.busy_s, time.monotonic() - self.started)
        try:
            return _policy_from_profile(self.args, self.setup, lengths, seconds, where, False,
                                        self.bench, self.layer_counts)
        except Exception as e:  # noqa: BLE001 - an unusable fit keeps fixed chunks, loudly
            return _fallback(self.args, e)


def build_chunk_policy(args: ServerArgs, bench: ProfileBench, model_file: str, layers: range,
                       layer_counts: list[int]) -> ChunkPolicy:
    """Stage 0's policy: fixed, from a cached or a blocking profile, or fixed while a
    background profile runs."""
    dynamic = args.enable_dynamic_chunking and args.pp_size > 1
    idle_flag = calibration_without_effect(args)
    if idle_flag is not None:
        log.warning("--dynamic-chunking-online-calibration has no effect: %s", idle_flag)
    if args.chunked_prefill_size != "auto" and not dynamic:
        return ChunkPolicy(first_chunk_size(args))
    try:
        setup = _profile_setup(args, bench, model_file, layers, dynamic)
        cache_dir = args.dynamic_chunking_profile_cache
        cached = load_cached(setup.key, cache_dir)
        if cached is not None:
            return _policy_from_profile(args, setup, *cached, True, bench, layer_counts)
        if args.dynamic_chunking_profile == "background":
            return _background(args, setup, bench, layer_counts)
        seconds = measure(bench, setup.lengths)
        where = save(setup.key, setup.lengths, seconds, cache_dir)
        return _policy_from_profile(args, setup, setup.lengths, seconds, where, False,
                                    bench, layer_counts)
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
    fixed = first_chunk_size(args)
    log.warning("dynamic chunking disabled (%s); using fixed chunks of %d tokens%s", e, fixed,
                " (--dynamic-chunking-online-calibration has no effect either)"
                if calibration_without_effect(args) is None and
                args.dynamic_chunking_online_calibration else "")
    return ChunkPolicy(fixed, info={"mode": "fixed", "c0": fixed, "fallback": str(e)})


def _background(args, setup: ProfileSetup, bench, layer_counts) -> ChunkPolicy:
    c0 = first_chunk_size(args)
    what = "--chunked-prefill-size auto" if setup.auto else "dynamic chunking"
    log.info("%s: profiling in background, serving with fixed chunks of %d", what, c0)
    bg = BackgroundProfile(args, setup, bench, layer_counts, ProfileRun(setup.lengths))
    return ChunkPolicy(c0, info={"mode": "profiling", "c0": c0, "samples": len(setup.lengths)},
                       background=bg)


def _profile_setup(args, bench: ProfileBench, model_file, layers, dynamic) -> ProfileSetup:
    auto = args.chunked_prefill_size == "auto"
    tune_len = min(args.tune_input_len or args.max_model_len, args.max_model_len)
    grid = default_c0_grid(tune_len, args.page_size, args.max_prefill_tokens,
                           AUTO_LARGEST_C0) if auto else []
    profile_c0 = max(grid) if auto else args.chunked_prefill_size
    lengths = profile_lengths(profile_c0, PROFILE_SAMPLES)
    key = profile_key(model_file, args.dtype, layers, args.layout.num_threads, profile_c0,
                      args.page_size, bench.cache_kind, lengths)
    return ProfileSetup(auto, dynamic, tune_len, grid, lengths, key)


def _policy_from_profile(args, setup: ProfileSetup, lengths, seconds, where, hit,
                         bench: ProfileBench, layer_counts) -> ChunkPolicy:
    a, b, c = fit_quadratic(lengths, seconds)
    fit_error = fit_relative_error(lengths, seconds, (a, b, c))
    log.info("start-up profile: %d lengths (%d..%d tokens), %.1f s of prefills, quadratic fit "
             "error %.1f%% RMS", len(lengths), min(lengths), max(lengths), sum(seconds),
             100 * fit_error)
    c0, sigma = args.chunked_prefill_size, args.dynamic_chunking_smooth_factor
    info = {"profile": where, "profile_cache_hit": hit, "coefficients": [a, b, c],
            "samples": len(lengths), "fit_rel_rms": fit_error}
    if setup.auto:
        model = CostModel(a, max(b, 0.0), c).with_stages(args.pp_size, layer_counts)
        c0, sigma, info["auto"] = _tune_auto(args, setup, model, bench.hidden_size)
    if not setup.dynamic:
        return ChunkPolicy(c0, info={**info, "mode": "fixed", "c0": c0})
    predictor = ChunkSizePredictor(c0, args.page_size, sigma, args.max_model_len,
                                   args.max_prefill_tokens)
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


def _tune_auto(args, setup: ProfileSetup, model: CostModel, hidden_size: int
               ) -> tuple[int, float, dict]:
    """`--chunked-prefill-size auto`: the simulator's (C0, smooth factor) for --tune-input-len
    tokens, and what to report about the choice."""
    dynamic, tune_len = setup.dynamic, setup.tune_len
    transfer = Transfer(bytes_per_token=hidden_size * 6)
    ranked = tune(model, tune_len, setup.grid, list(SMOOTH_GRID) if dynamic else [0.0],
                  transfer, args.layout.max_inflight, args.page_size, args.max_prefill_tokens)
    best, second = pick(ranked)
    why = ("runner-up" if second.ttft_s >= best.ttft_s else
           "predicted faster but within 3% with more chunks")
    log.info("--chunked-prefill-size auto: C0 = %d%s for %d-token prompts on %d stage(s): "
             "predicted TTFT %.2f s (%s: C0 = %d%s, %.2f s)", best.c0,
             f", smooth factor {best.smooth}" if dynamic else "", tune_len, args.pp_size,
             best.ttft_s, why, second.c0, f", smooth {second.smooth}" if dynamic else "",
             second.ttft_s)
    report = {"tune_input_len": tune_len, "best": vars(best), "runner_up": vars(second)}
    return best.c0, best.smooth, report
