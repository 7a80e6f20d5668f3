"""Which layers each pipeline stage owns: a pure function of integers."""
from __future__ import annotations


def partition_layers(num_layers: int, pp_size: int, explicit: str | None = None) -> list[range]:
    """Contiguous layer ranges, one per stage.

    Default: num_layers // pp_size each, the remainder on the *last* stages, because later
    stages wait on earlier ones and extra work is cheapest there.
    """
    if pp_size > num_layers:
        raise ValueError(f"--pp-size {pp_size} is larger than the model's {num_layers} layers; "
                         f"use at most {num_layers} stages")
    if explicit:
        counts = _parse_partition(explicit, num_layers, pp_size)
    else:
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (1 if i >= pp_size - extra else 0) for i in range(pp_size)]
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return ranges


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
