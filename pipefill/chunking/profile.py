"""The start-up profile behind dynamic chunking and `--chunked-prefill-size auto`: single
from-scratch prefills on stage 0's layer slice, timed, cached on disk so a restart skips them
(ARCHITECTURE.md, 'The chunking room').

A ProfileRun measures one prefill per step, so that stage 0's loop can run it in slices while
it is idle (the background profile) or all at once before it serves (blocking). The prefill
itself is the runtime's: it comes in as ProfileBench.prefill."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from pipefill.chunking.cost import fit_quadratic

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path.home() / ".cache" / "pipefill" / "profiles"
# The warm-up prefill (not timed) is an eighth of the longest length: it runs the kernels' code
# paths once (the stage's own 16-token warm-up ran them at toy size), for a fraction of the old
# full-length warm-up.
WARMUP_FRACTION = 8
RETIME_RATIO, MAX_RETIMED = 1.3, 4

# Seconds of one from-scratch prefill of n dummy tokens into these pages on stage 0's layers.
ScratchPrefill = Callable[[int, list[int]], float]


@dataclass(frozen=True)
class ProfileBench:
    """What the profile needs of stage 0, handed in by the runtime (StageExecutor.profile_bench)
    so that this room never imports it."""
    prefill: ScratchPrefill
    page_size: int
    cache_kind: str  # the KV cache class's name: part of the profile's cache key
    hidden_size: int  # the simulator's bytes per token crossing a stage border


def profile_key(model_file: str, dtype: str, layers: range, threads: int, c0: int,
                page_size: int, backend: str, lengths: list[int]) -> dict:
    stat = os.stat(model_file)
    return {"model": os.path.abspath(model_file), "model_size": stat.st_size,
            "model_mtime": int(stat.st_mtime), "dtype": dtype,
            "layers": [layers.start, layers.stop], "threads": threads, "c0": c0,
            "page_size": page_size, "attention": backend, "torch": torch.__version__,
            "lengths": [lengths[0], lengths[-1], len(lengths)]}


def cache_path(cache_dir: str | None, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir or DEFAULT_CACHE) / f"profile-{digest}.json"


def load_cached(key: dict, cache_dir: str | None) -> tuple[list[int], list[float], str] | None:
    """(lengths, seconds, cache file) of a cached profile with exactly this key, or None."""
    path = cache_path(cache_dir, key)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key:
            log.info("dynamic chunking: profile cache hit %s", path)
            return data["lengths"], data["seconds"], str(path)
    except (OSError, ValueError) as e:
        log.warning("dynamic chunking: unreadable profile cache %s (%s); re-profiling", path, e)
    return None


def save(key: dict, lengths: list[int], seconds: list[float], cache_dir: str | None) -> str:
    path = cache_path(cache_dir, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "lengths": lengths, "seconds": seconds}))
        tmp.replace(path)
    except OSError as e:
        log.warning("dynamic chunking: could not write the profile cache %s: %s", path, e)
    return str(path)


@dataclass
class ProfileRun:
    """The profile's prefills, one per step: an untimed warm-up, then every length, then a
    second timing of the few samples far above the fit of all (a prefill that was preempted
    on a busy machine; with 12 samples one such spike can bend the fit), keeping the faster."""
    lengths: list[int]
    seconds: list[float] = field(default_factory=list)
    warmed: bool = False
    retry: list[int] | None = None  # indices to time again; None until every length ran
    retimed: int = 0
    busy_s: float = 0.0  # wall time spent in steps

    @property
    def finished(self) -> bool:
        return self.retry == []

    @property
    def steps_left(self) -> int:
        """At least this many (the second timings are known once every length ran)."""
        return (not self.warmed) + len(self.lengths) - len(self.seconds) + len(self.retry or [])

    def pages_needed(self, page_size: int) -> int:
        return -(-max(self.lengths) // page_size)

    def step(self, prefill: ScratchPrefill, pages: list[int]) -> None:
        t0 = time.perf_counter()
        if not self.warmed:
            prefill(max(1, max(self.lengths) // WARMUP_FRACTION), pages)
            self.warmed = True
        elif len(self.seconds) < len(self.lengths):
            self.seconds.append(prefill(self.lengths[len(self.seconds)], pages))
        elif self.retry:
            i = self.retry.pop()
            self.seconds[i] = min(self.seconds[i], prefill(self.lengths[i], pages))
            self.retimed += 1
        if self.retry is None and len(self.seconds) == len(self.lengths):
            self.retry = slow_outliers(self.lengths, self.seconds)
        self.busy_s += time.perf_counter() - t0


def slow_outliers(lengths: list[int], seconds: list[float]) -> list[int]:
    """Indices of at most MAX_RETIMED samples above RETIME_RATIO x the quadratic fit of all,
    the largest excess last (a spike bends the fit most where its excess in seconds is)."""
    try:
        a, b, c = fit_quadratic(lengths, seconds)
    except ValueError:
        return []
    excess = {i: s - f for i, (x, s) in enumerate(zip(lengths, seconds))
              if s > RETIME_RATIO * (f := a * x * x + b * x + c)}
    return sorted(excess, key=excess.get)[-MAX_RETIMED:]


def measure(bench: ProfileBench, lengths: list[int]) -> list[float]:
    """Blocking: every prefill now, into pages 0.., before the stage serves anything (no
    request owns a page yet)."""
    run = ProfileRun(lengths)
    pages = list(range(run.pages_needed(bench.page_size)))
    with tqdm(total=run.steps_left, desc="dynamic chunking: profiling stage 0",
              unit="prefill", leave=False, disable=None) as bar:
        while not run.finished:
            run.step(bench.prefill, pages)
            bar.total = bar.n + 1 + run.steps_left
            bar.update()
    log.info("dynamic chunking: profiled %d lengths in %.1f s (%d timed twice)", len(lengths),
             run.busy_s, run.retimed)
    return run.seconds
