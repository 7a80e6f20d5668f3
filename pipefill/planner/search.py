"""The layout search (ARCHITECTURE.md, 'The deployment planner'): every PP × TP layout of
the devices, each with its best C0 and σ, simulated through the chunking room's simulator
from the per-operation cost model; the fastest that fits in memory first.

A layout's chunks are the ones pipefill would cut: fixed C0, or dynamic chunks from the
quadratic fitted to stage 0's cost at the start-up profile's lengths, as the engine fits its
measured profile (ARCHITECTURE.md, 'The chunking room').
"""
from __future__ import annotations

from dataclasses import dataclass

from pipefill.chunking.cost import fit_quadratic, profile_lengths
from pipefill.chunking.sim import SMOOTH_GRID, CostModel, chunk_plan, pick, simulate_costs
from pipefill.model.config import ModelConfig
from pipefill.planner.costs import Layout, LayoutCosts, Precision
from pipefill.planner.hardware import Hardware

C0_GRID = (256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 18432, 24576, 32768)
# The fewest tokens a C0 on the grid may have: prompt / this (more chunks cost the search
# time and gain nothing the grid's larger sizes do not).
MAX_FIRST_CHUNKS = 128
# The share of a device's memory weights and KV may take; the rest holds activations,
# workspaces and the runtime.
MEMORY_HEADROOM = 0.9


@dataclass(frozen=True)
class Plan:
    """One layout at one (C0, σ) for one prompt, as predicted."""
    layout: Layout
    c0: int
    smooth: float
    ttft_s: float
    bubble_ratio: float
    num_chunks: int
    throughput_tok_s: float  # prompts back to back: tokens over the busiest stage's seconds
    weight_bytes: float  # on the fullest device (weights + KV)
    kv_bytes: float  # on that device, the whole prompt cached
    fits: bool
    link_bytes: dict  # per device (the busiest rank), bytes a prompt puts on each link kind
    stage_layers: tuple[int, ...]

    def summary(self) -> dict:
        return {"layout": str(self.layout), "pp": self.layout.pp, "tp": self.layout.tp,
                "threads": self.layout.threads, "c0": self.c0, "smooth_factor": self.smooth,
                "ttft_s": self.ttft_s, "bubble_ratio": self.bubble_ratio,
                "num_chunks": self.num_chunks, "throughput_tok_s": self.throughput_tok_s,
                "weight_bytes_per_device": self.weight_bytes,
                "kv_bytes_per_device": self.kv_bytes, "fits": self.fits,
                "link_bytes_per_device": self.link_bytes,
                "stage_layers": list(self.stage_layers)}


def chunks_of(costs: LayoutCosts, prompt_len: int, c0: int, smooth: float,
              page_size: int) -> list[int]:
    """The chunk sizes pipefill would use: fixed, or dynamic from stage 0's fitted cost."""
    if smooth <= 0 or costs.layout.pp == 1:
        return chunk_plan(CostModel(0.0, 1.0, 0.0), prompt_len, c0, 0.0, page_size)
    lengths = profile_lengths(c0)
    a, b, c = fit_quadratic(lengths, [costs.chunk_seconds(0, n, 0) for n in lengths])
    if a <= 0:  # the engine falls back to fixed chunks
        return chunk_plan(CostModel(0.0, 1.0, 0.0), prompt_len, c0, 0.0, page_size)
    return chunk_plan(CostModel(a, max(b, 0.0), c), prompt_len, c0, smooth, page_size)


def evaluate(cfg: ModelConfig, hw: Hardware, layout: Layout, precision: Precision,
             prompt_len: int, c0: int, smooth: float = 0.0, page_size: int = 64,
             async_depth: int = 0) -> Plan:
    """The predicted prefill of one prompt in one layout at one (C0, σ)."""
    costs = LayoutCosts(cfg, hw, layout, precision)
    chunks = chunks_of(costs, prompt_len, c0, smooth, page_size)
    history = [sum(chunks[:k]) for k in range(len(chunks))]
    matrix = [[costs.chunk_seconds(s, c, h) for c, h in zip(chunks, history)]
              for s in range(layout.pp)]
    result = simulate_costs(matrix, [costs.border_delay(c) for c in chunks],
                            layout.pp + async_depth)
    stages = range(layout.pp)
    memory = [(costs.stage_weight_bytes(s), costs.stage_kv_bytes(s, prompt_len))
              for s in stages]
    weights, kv = max(memory, key=sum)  # the fullest device's
    links = [costs.stage_link_bytes(s, prompt_len) for s in stages]
    busiest = max(links, key=lambda d: sum(d.values()))
    return Plan(layout, c0, smooth, result.ttft_s, result.bubble_ratio, len(chunks),
                prompt_len / max(result.busy_s), weights, kv,
                weights + kv <= MEMORY_HEADROOM * hw.memory_bytes * layout.threads, busiest,
                tuple(len(r) for r in costs.stage_layers))


def layouts(cfg: ModelConfig, hw: Hardware, devices: int) -> list[Layout]:
    """Every PP × TP (× threads on CPU cores) that uses exactly `devices`: at most one stage
    per layer, at most one TP rank per attention head."""
    out = []
    for pp in range(1, min(devices, cfg.num_layers) + 1):
        if devices % pp:
            continue
        for tp in range(1, devices // pp + 1):
            threads, rest = divmod(devices, pp * tp)
            if rest or tp > cfg.num_heads or (threads > 1 and not hw.devices_are_cores):
                continue
            out.append(Layout(pp, tp, threads))
    return out


def c0_grid(prompt_len: int, page_size: int, largest: int) -> list[int]:
    low = prompt_len / MAX_FIRST_CHUNKS
    top = min(largest, max(prompt_len, page_size))
    grid = [g for g in C0_GRID if low <= g <= top and g % page_size == 0]
    return grid or [max(page_size, min(top, largest) // page_size * page_size)]


def best_for_layout(cfg: ModelConfig, hw: Hardware, layout: Layout, precision: Precision,
                    prompt_len: int, c0s: list[int], smooths: list[float],
                    page_size: int = 64) -> Plan:
    """The layout's fastest (C0, σ), where predictions within 3% count as a tie won by the
    fewest chunks (chunking.sim.pick: per-chunk costs the model does not see favour them)."""
    smooths = smooths if layout.pp > 1 else [0.0]
    ranked = sorted((evaluate(cfg, hw, layout, precision, prompt_len, c0, s, page_size)
                     for c0 in c0s for s in smooths), key=lambda p: p.ttft_s)
    return pick(ranked)[0]  # it reads .ttft_s and .num_chunks, as of a Candidate


def search(cfg: ModelConfig, hw: Hardware, devices: int, precision: Precision,
           prompt_len: int, c0s: list[int] | None = None,
           smooths: list[float] | None = None, page_size: int = 64,
           largest_chunk: int = 32768, only: list[Layout] | None = None) -> list[Plan]:
    """Each layout's best plan, those that fit in memory first, fastest first."""
    candidates = only or layouts(cfg, hw, devices)
    if not candidates:
        raise ValueError(f"no PP x TP layout uses {devices} devices for a model of "
                         f"{cfg.num_layers} layers and {cfg.num_heads} heads")
    c0s = c0s or c0_grid(prompt_len, page_size, largest_chunk)
    smooths = list(SMOOTH_GRID) if smooths is None else smooths
    plans = [best_for_layout(cfg, hw, lay, precision, prompt_len, c0s, smooths, page_size)
             for lay in candidates]
    return sorted(plans, key=lambda p: (not p.fits, p.ttft_s))
