"""Pipeline traces: per-stage spans, merged into a Chrome/Perfetto JSON, the measured bubble
ratio next to the theory, and a PNG timeline of the stages."""
from __future__ import annotations

import json
import os
import time
from collections import deque
from contextlib import contextmanager

from pipefill.chunking.sim import draw_timeline


# Spans kept per stage: the newest ones. A long-running server with --trace-dir would otherwise
# grow without bound; 16K spans (about 8 MB) cover thousands of steps, more than a timeline
# can show anyway.
MAX_SPANS = 16384
MAX_PLOTTED_STEPS = 500


class StageTracer:
    """Records (name, category, start, duration, args) spans on one stage in a ring buffer of
    the newest max_spans; cheap when off."""

    def __init__(self, rank: int, enabled: bool, max_spans: int = MAX_SPANS):
        self.rank = rank
        self.enabled = enabled
        self.events: deque[dict] = deque(maxlen=max_spans)

    @contextmanager
    def span(self, name: str, cat: str, **args):
        if not self.enabled:
            yield
            return
        t0 = time.time()
        try:
            yield
        finally:
            self.events.append({"name": name, "cat": cat, "ph": "X", "pid": 0,
                                "tid": self.rank, "ts": t0 * 1e6,
                                "dur": (time.time() - t0) * 1e6, "args": args})

    def drain(self) -> list[dict]:
        events = list(self.events)
        self.events.clear()
        return events


def plan_label(plan) -> str:
    return " ".join(f"{w.rid}[{w.start}:{w.end}]" for w in plan.seqs)


def bubble_stats(events: list[dict], num_stages: int) -> dict:
    """Measured bubble ratio 1 - sum(busy) / (P * makespan) over the forward spans, and the
    theory (P - 1) / (P - 1 + M) for the M micro-batches seen."""
    fwd = [e for e in events if e["cat"] == "forward"]
    if not fwd:
        return {}
    start = min(e["ts"] for e in fwd)
    end = max(e["ts"] + e["dur"] for e in fwd)
    busy = sum(e["dur"] for e in fwd)
    makespan = end - start
    m = len({e["args"].get("step") for e in fwd})
    p = num_stages
    per_stage = {r: sum(e["dur"] for e in fwd if e["tid"] == r) / 1e6 for r in range(p)}
    return {"bubble_ratio": 1 - busy / (p * makespan) if makespan > 0 else 0.0,
            "bubble_theory": (p - 1) / (p - 1 + m), "micro_batches": m,
            "makespan_s": makespan / 1e6, "busy_s_per_stage": per_stage}


def write_trace(trace_dir: str, name: str, events: list[dict], num_stages: int) -> dict:
    """Writes <name>.json (Chrome trace) and <name>.png; returns the bubble statistics."""
    os.makedirs(trace_dir, exist_ok=True)
    stats = bubble_stats(events, num_stages)
    meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
             "args": {"name": f"stage {r}"}} for r in range(num_stages)]
    path = os.path.join(trace_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms",
                   "otherData": stats}, f)
    stats["json"] = path
    try:
        stats["png"] = plot_timeline(events, num_stages, os.path.join(trace_dir, f"{name}.png"),
                                     stats)
    except ImportError:
        pass
    return stats


def plot_timeline(events: list[dict], num_stages: int, path: str, stats: dict) -> str:
    """The PNG shows the last MAX_PLOTTED_STEPS micro-batches (a long server's trace has tens
    of thousands, more than a picture can show or matplotlib can draw in reasonable time)."""
    fwd = [e for e in events if e["cat"] == "forward"]
    steps = sorted({e["args"].get("step") for e in fwd}, key=lambda s: (s is None, s))
    shown = steps[-MAX_PLOTTED_STEPS:]
    index = {step: i for i, step in enumerate(shown)}
    fwd = [e for e in fwd if e["args"].get("step") in index]
    t0 = min(e["ts"] for e in fwd)
    bars = [(e["tid"], (e["ts"] - t0) / 1e6, e["dur"] / 1e6, index[e["args"].get("step")])
            for e in fwd]
    last = f" (last {len(shown)})" if len(shown) < len(steps) else ""
    return draw_timeline(bars, num_stages, path,
                         f"{num_stages} stages, {stats['micro_batches']} micro-batches{last}: "
                         f"bubble {stats['bubble_ratio']:.3f} measured, "
                         f"{stats['bubble_theory']:.3f} theory")
