"""The pipeline simulator (ARCHITECTURE.md, 'The chunking room'): replays a chunk schedule
through P stages from a cost model and predicts TTFT, per-stage busy time and the bubble ratio,
for pipeline sizes larger than the machine. Also the tuner behind `--chunked-prefill-size auto`
and the pipeline diagram that traces draw.

Recurrence, with t_s(k) the time of chunk k on stage s and d_k its transfer delay:
    end[s][k] = max(end[s][k-1], end[s-1][k] + d_k) + t_s(k)
and stage 0 may start chunk k only when fewer than W = pp_size + async depth micro-batches
are in flight: start[0][k] >= end[P-1][k-W] + d_k.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipefill.chunking.cost import ChunkSizePredictor
from pipefill.chunking.progress import shape_coefficients

# The smooth factors `--chunked-prefill-size auto` and `pipefill sim` try with dynamic chunks.
SMOOTH_GRID = (0.0, 0.5, 0.65, 0.75, 0.85, 1.0)


@dataclass(frozen=True)
class CostModel:
    """Seconds of a from-scratch prefill of l tokens on stage 0: f(l) = a*l^2 + b*l + c.
    A chunk of C tokens after H cached ones costs f(H + C) - f(H) + c on stage 0, times
    stage_scale[s] on stage s (layer counts differ with uneven partitions)."""
    a: float
    b: float
    c: float
    stage_scale: tuple[float, ...] = (1.0,)

    def chunk_seconds(self, stage: int, size: int, history: int) -> float:
        base = self.a * size * (size + 2 * history) + self.b * size + self.c
        return self.stage_scale[stage] * base

    @staticmethod
    def from_shapes(layer_params: list[float], attention_width: float, counts: list[int],
                    flops: float, overhead_s: float = 0.0) -> "CostModel":
        """The cost model a model's shapes imply on a device doing `flops` FLOP/s: stage 0's
        layers' FLOPs (progress.shape_coefficients) over the device's rate. Stage 0 runs the
        first counts[0] layers; the other stages are scaled by their layers' weights."""
        starts = [sum(counts[:s]) for s in range(len(counts))]
        stage_params = [sum(layer_params[a:a + n]) for a, n in zip(starts, counts)]
        a, b = shape_coefficients(layer_params[:counts[0]], attention_width)
        return CostModel(a / flops, b / flops, overhead_s,
                         tuple(p / stage_params[0] for p in stage_params))

    def with_stages(self, pp_size: int, layer_counts: list[int] | None = None) -> "CostModel":
        counts = layer_counts or [1] * pp_size
        return CostModel(self.a, self.b, self.c, tuple(n / counts[0] for n in counts))


@dataclass(frozen=True)
class Transfer:
    """Hidden states crossing a stage border: latency + bytes / bandwidth."""
    latency_s: float = 2e-4
    bytes_per_token: int = 576 * 6  # bf16 hidden + float32 residual of SmolLM2
    bandwidth_bytes_per_s: float = 3e9

    def delay(self, num_tokens: int) -> float:
        return self.latency_s + num_tokens * self.bytes_per_token / self.bandwidth_bytes_per_s


@dataclass
class SimResult:
    chunks: list[int]
    start: list[list[float]]  # [stage][chunk]
    end: list[list[float]]
    busy_s: list[float] = field(default_factory=list)

    @property
    def pp_size(self) -> int:
        return len(self.end)

    @property
    def ttft_s(self) -> float:
        return self.end[-1][-1]

    @property
    def bubble_ratio(self) -> float:
        makespan = self.end[-1][-1] - self.start[0][0]
        return 1 - sum(self.busy_s) / (self.pp_size * makespan) if makespan > 0 else 0.0

    @property
    def bubble_theory(self) -> float:
        p, m = self.pp_size, len(self.chunks)
        return (p - 1) / (p - 1 + m)

    def summary(self) -> dict:
        return {"ttft_s": self.ttft_s, "bubble_ratio": self.bubble_ratio,
                "bubble_theory": self.bubble_theory, "busy_s_per_stage": self.busy_s,
                "num_chunks": len(self.chunks), "chunks": self.chunks}


def simulate_costs(costs: list[list[float]], delays: list[float],
                   max_inflight: int | None = None) -> SimResult:
    """The recurrence over an explicit cost matrix costs[stage][chunk] (seconds)."""
    p, m = len(costs), len(costs[0])
    window = max_inflight or p
    start = [[0.0] * m for _ in range(p)]
    end = [[0.0] * m for _ in range(p)]
    for k in range(m):
        for s in range(p):
            ready = end[s][k - 1] if k else 0.0
            if s == 0:
                if k >= window:  # a slot frees when an earlier micro-batch's result is back
                    ready = max(ready, end[p - 1][k - window] + delays[k])
            else:
                ready = max(ready, end[s - 1][k] + delays[k])
            start[s][k] = ready
            end[s][k] = ready + costs[s][k]
    return SimResult([0] * m, start, end, [sum(row) for row in costs])


def simulate(model: CostModel, chunks: list[int], transfer: Transfer = Transfer(),
             max_inflight: int | None = None, prefix_len: int = 0) -> SimResult:
    p = len(model.stage_scale)
    history = [prefix_len + sum(chunks[:k]) for k in range(len(chunks))]
    costs = [[model.chunk_seconds(s, c, h) for c, h in zip(chunks, history)] for s in range(p)]
    result = simulate_costs(costs, [transfer.delay(c) for c in chunks], max_inflight)
    result.chunks = list(chunks)
    return result


def chunk_plan(model: CostModel, prompt_len: int, c0: int, smooth: float,
               page_size: int = 64, max_model_len: int | None = None,
               max_prefill_tokens: int | None = None) -> list[int]:
    """Chunk sizes the engine would use: fixed C0 (smooth = 0) or dynamic (C0, smooth)."""
    predictor = ChunkSizePredictor(c0, page_size, smooth,
                                   max_model_len or prompt_len + (1 << 20),
                                   max_prefill_tokens or (1 << 30))
    predictor.set_model(model.a, model.b, model.c, model.a * c0 * c0 + model.b * c0)
    return predictor.chunk_sequence(prompt_len)


@dataclass(frozen=True)
class Candidate:
    c0: int
    smooth: float
    ttft_s: float
    bubble_ratio: float
    num_chunks: int


def tune(model: CostModel, prompt_len: int, c0_grid: list[int], smooth_grid: list[float],
         transfer: Transfer = Transfer(), max_inflight: int | None = None,
         page_size: int = 64, max_prefill_tokens: int | None = None) -> list[Candidate]:
    """Every (C0, smooth) on the grid, fastest first."""
    out = []
    for c0 in c0_grid:
        for smooth in smooth_grid:
            chunks = chunk_plan(model, prompt_len, c0, smooth, page_size,
                                max_prefill_tokens=max_prefill_tokens)
            r = simulate(model, chunks, transfer, max_inflight)
            out.append(Candidate(c0, smooth, r.ttft_s, r.bubble_ratio, len(chunks)))
    return sorted(out, key=lambda c: c.ttft_s)


def pick(ranked: list, tolerance: float = 0.03):
    """The fastest candidate, where predictions within `tolerance` of the fastest count as a
    tie (the simulator errs by 5-10%) won by the one with the fewest chunks: per-chunk costs
    the profile does not see (scheduling, transfers, kernel set-up) favour larger chunks.
    Returns (chosen, runner-up)."""
    near = [c for c in ranked if c.ttft_s <= ranked[0].ttft_s * (1 + tolerance)]
    chosen = min(near, key=lambda c: (c.num_chunks, c.ttft_s))
    rest = [c for c in ranked if c is not chosen]
    return chosen, rest[0] if rest else chosen


def default_c0_grid(prompt_len: int, page_size: int, max_prefill_tokens: int,
                    largest: int = 16384) -> list[int]:
    top = min(max_prefill_tokens, max(prompt_len, page_size), largest)
    grid = [g for g in (512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
            if g <= top and g % page_size == 0]
    return grid or [max(page_size, top // page_size * page_size)]


def draw_timeline(bars: list[tuple[int, float, float, int]], num_stages: int, path: str,
                  title: str, xlabel: str = "seconds") -> str:
    """A textbook pipeline diagram: bars (stage, start s, duration s, micro-batch index) as
    one row per stage, colored and numbered by micro-batch."""
    # Imported here: matplotlib costs a second at import, and only plots need it; the backend
    # must be chosen before pyplot is imported.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = plt.get_cmap("tab20")
    span = max((x + w for _, x, w, _ in bars), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(12, 0.7 * num_stages + 1.5))
    for stage, x, w, k in bars:
        ax.barh(stage, w, left=x, height=0.8, color=colors(k % 20), edgecolor="black",
                linewidth=0.4)
        if w > 0.02 * span:
            ax.text(x + w / 2, stage, str(k), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(num_stages), [f"stage {r}" for r in range(num_stages)])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(result: SimResult, path: str, title: str = "") -> str:
    bars = [(s, a, b - a, k) for s in range(result.pp_size)
            for k, (a, b) in enumerate(zip(result.start[s], result.end[s]))]
    return draw_timeline(bars, result.pp_size, path,
                         title or f"{result.pp_size} stages, {len(result.chunks)} chunks: TTFT "
                                  f"{result.ttft_s:.2f} s, bubble {result.bubble_ratio:.3f}",
                         "seconds (simulated)")


def describe_chunks(chunks: list[int]) -> str:
    if len(chunks) <= 12:
        return ", ".join(map(str, chunks))
    return (", ".join(map(str, chunks[:6])) + f", ... ({len(chunks) - 12} more) ..., "
            + ", ".join(map(str, chunks[-6:])))
