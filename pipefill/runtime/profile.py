"""The start-up profile behind dynamic chunking and `--chunked-prefill-size auto`: single
from-scratch prefills on stage 0's layer slice, timed, cached on disk so a restart skips them.

A ProfileRun measures one prefill per step, so that stage 0's loop can run it in slices while
it is idle (the background profile) or all at once before it serves (blocking)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipefill.scheduler.plan import SeqWork, StepPlan

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path.home() / ".cache" / "pipefill" / "profiles"
# The warm-up prefill (not timed) is a quarter of the longest length: enough to touch the
# kernels' code paths and buffers, at a sixteenth of the old full-length warm-up's attention.
WARMUP_FRACTION = 4


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


def profile_forward(executor, num_tokens: int, pages: list[int]) -> float:
    """Seconds of one from-scratch prefill of num_tokens dummy tokens into `pages` on this
    stage's layers (zero activations in on later stages). A scratch plan (step id -1): no
    page bookkeeping, the caller owns the pages."""
    plan = StepPlan(-1, [SeqWork("profile", 0, num_tokens, [1] * num_tokens, pages)])
    acts = None
    if not executor.model.is_first:
        from pipefill.runtime.executor import Activations
        shape, device = (num_tokens, executor.model.cfg.hidden_size), executor.cache.k.device
        acts = Activations(torch.zeros(shape, dtype=executor.model.dtype, device=device),
                           torch.zeros(shape, dtype=torch.float32, device=device))
    return executor.forward(plan, acts)[1]


@dataclass
class ProfileRun:
    """The profile's prefills, one per step: an untimed warm-up, then every length."""
    lengths: list[int]
    seconds: list[float] = field(default_factory=list)
    warmed: bool = False
    busy_s: float = 0.0  # wall time spent in steps

    @property
    def finished(self) -> bool:
        return len(self.seconds) == len(self.lengths)

    @property
    def steps_left(self) -> int:
        return len(self.lengths) - len(self.seconds) + (not self.warmed)

    def pages_needed(self, page_size: int) -> int:
        return -(-max(self.lengths) // page_size)

    def step(self, executor, pages: list[int]) -> None:
        t0 = time.perf_counter()
        if not self.warmed:
            profile_forward(executor, max(1, max(self.lengths) // WARMUP_FRACTION), pages)
            self.warmed = True
        else:
            self.seconds.append(profile_forward(executor, self.lengths[len(self.seconds)],
                                                pages))
        self.busy_s += time.perf_counter() - t0


def measure(executor, lengths: list[int]) -> list[float]:
    """Blocking: every prefill now, into pages 0.., before the stage serves anything (no
    request owns a page yet)."""
    from tqdm import tqdm
    run = ProfileRun(lengths)
    pages = list(range(run.pages_needed(executor.cache.page_size)))
    with tqdm(total=run.steps_left, desc="dynamic chunking: profiling stage 0",
              unit="prefill", leave=False, disable=None) as bar:
        while not run.finished:
            run.step(executor, pages)
            bar.update()
    log.info("dynamic chunking: profiled %d prefills in %.1f s", len(lengths), run.busy_s)
    return run.seconds


def load_or_measure(executor, lengths: list[int], key: dict, cache_dir: str | None
                    ) -> tuple[list[int], list[float], str, bool]:
    """(lengths, seconds, cache file, whether it was a cache hit); blocking."""
    cached = load_cached(key, cache_dir)
    if cached is not None:
        return (*cached, True)
    seconds = measure(executor, lengths)
    return lengths, seconds, save(key, lengths, seconds, cache_dir), False
