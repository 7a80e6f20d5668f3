"""Which layers each pipeline stage owns: a pure function of numbers."""
from __future__ import annotations

from typing import Sequence


def partition_layers(num_layers: int, pp_size: int, explicit: str | None = None,
                     costs: Sequence[float] | None = None) -> list[range]:
    """Contiguous layer ranges, one per stage.

    Default: num_layers // pp_size each, the remainder on the *last* stages, because later
    stages wait on earlier ones and extra work is cheapest there. With per-layer costs that
    differ (a model's dense layers among mixture-of-experts ones), the stages' summed costs
    are balanced instead (balanced_counts). An explicit --pp-layer-partition overrides both.
    """
    if pp_size > num_layers:
        raise ValueError(f"--pp-size {pp_size} is larger than the model's {num_layers} layers; "
                         f"use at most {num_layers} stages")
    if explicit:
        counts = _parse_partition(explicit, num_layers, pp_size)
    elif costs is not None and len(set(costs)) > 1:
        if len(costs) != num_layers:
            raise ValueError(f"{len(costs)} layer costs for {num_layers} layers")
        counts = balanced_counts(costs, pp_size)
    else:
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (1 if i >= pp_size - extra else 0) for i in range(pp_size)]
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def balanced_counts(costs: Sequence[float], pp_size: int) -> list[int]:
    """Layer counts whose heaviest stage (the sum of its layers' costs) is as light as any
    contiguous split allows; among those splits, later stages take as many layers as they
    can (they wait on the earlier ones anyway)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def load(i: int, j: int) -> float:  # layers [i, j)
        return prefix[j] - prefix[i]

    # best[k][j]: the lightest heaviest stage splitting layers [0, j) into k stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp_size + 1)]
    best[0][0] = 0.0
    for k in range(1, pp_size + 1):
        for j in range(k, n + 1):
            best[k][j] = min(max(best[k - 1][i], load(i, j)) for i in range(k - 1, j))
    bound = best[pp_size][n] * (1 + 1e-9)
    counts, end = [], n
    for k in range(pp_size, 0, -1):
        # The last stage starts as early as the earlier stages can still fit under the bound.
        start = next(i for i in range(k - 1, end)
                     if load(i, end) <= bound and best[k - 1][i] <= bound)
        counts.append(end - start)
        end = start
    return counts[::-1]


def _parse_partition(text: str, num_layers: int, pp_size: int) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--pp-layer-partition {text!r} must be comma-separated integers, "
                         f"e.g. {','.join(['1'] * pp_size)}") from None
    if len(counts) != pp_size:
        raise ValueError(f"--pp-layer-partition has {len(counts)} entries but --pp-size is "
                         f"{pp_size}: give one layer count per stage")
    if any(n < 1 for n in counts):
        raise ValueError(f"--pp-layer-partition {text}: every stage needs at least one layer")
    if sum(counts) != num_layers:
        raise ValueError(f"--pp-layer-partition {text} sums to {sum(counts)} but the model has "
                         f"{num_layers} layers: change the counts so they add up to {num_layers}")
    return counts
