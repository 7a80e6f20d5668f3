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


def measure(executor, lengths: list[int]) -> list[float]:
    """Seconds of one from-scratch prefill per length on this stage's layers, before the stage
    serves anything (synchronized on CUDA)."""
    from tqdm import tqdm
    return [executor.scratch_prefill(n)
            for n in tqdm(lengths, desc="dynamic chunking: profiling stage 0", unit="prefill",
                          leave=False, disable=None)]


def load_or_measure(executor, lengths: list[int], key: dict, cache_dir: str | None) -> tuple[list[int], list[float], str, bool]:
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
    seconds = measure(executor, lengths)
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
