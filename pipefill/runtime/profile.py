"""The start-up profile behind dynamic chunking and `--chunked-prefill-size auto`: single
from-scratch prefills on stage 0's layer slice, timed, cached on disk so a restart skips them."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from pipefill.scheduler.plan import SeqWork, StepPlan

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path.home() / ".cache" / "pipefill" / "profiles"


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


def measure(executor, lengths: list[int], page_size: int) -> list[float]:
    """Seconds of one from-scratch prefill per length on this stage's layers. Runs before the
    stage serves anything: every page is free, so the prefills write pages 0.. directly and
    nothing needs freeing afterwards."""
    from tqdm import tqdm
    times = []
    hidden_size = executor.model.cfg.hidden_size
    for n in tqdm(lengths, desc="dynamic chunking: profiling stage 0", unit="prefill",
                  leave=False, disable=None):
        pages = list(range(-(-n // page_size)))
        plan = StepPlan(-1, [SeqWork("profile", 0, n, [1] * n, pages)])
        acts = None
        if not executor.model.is_first:
            from pipefill.runtime.executor import Activations
            acts = Activations(torch.zeros(n, hidden_size, dtype=executor.model.dtype),
                               torch.zeros(n, hidden_size, dtype=torch.float32))
        _, seconds = executor.forward(plan, acts)  # synchronizes on CUDA
        times.append(seconds)
    return times


def load_or_measure(executor, lengths: list[int], page_size: int, key: dict,
                    cache_dir: str | None) -> tuple[list[int], list[float], str, bool]:
    """(lengths, seconds, cache file, whether it was a cache hit). The first measured sample
    is dropped: it runs cold."""
    path = cache_path(cache_dir, key)
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                log.info("dynamic chunking: profile cache hit %s", path)
                return data["lengths"], data["seconds"], str(path), True
        except (OSError, ValueError) as e:
            log.warning("dynamic chunking: unreadable profile cache %s (%s); re-profiling",
                        path, e)
    t0 = time.perf_counter()
    seconds = measure(executor, lengths, page_size)
    lengths, seconds = lengths[1:], seconds[1:]
    log.info("dynamic chunking: profiled %d prefills in %.1f s", len(lengths) + 1,
             time.perf_counter() - t0)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "lengths": lengths, "seconds": seconds}))
        tmp.replace(path)
    except OSError as e:
        log.warning("dynamic chunking: could not write the profile cache %s: %s", path, e)
    return lengths, seconds, str(path), False
