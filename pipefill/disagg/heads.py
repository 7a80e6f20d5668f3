"""Which KV heads each tensor-parallel rank of a PD stage holds, and how a decode rank's heads
are cut out of the prefill ranks' (ARCHITECTURE.md, 'Prefill/decode disaggregation', 'KV heads
across TP sizes').

A head map lists, per TP rank of a stage in rank order, the global KV head ids its pages hold,
ascending: [[0, 1], [2]] for 3 KV heads at TP 2 split by whole groups ([[0, 1], [1, 2]] split
by query heads), [[0], [0]] for 1 KV head replicated at TP 2,
[[0, 1, 2]] at TP 1. Both sides send theirs in the handshake (RegisterStage, DecodeHello). The
bytes of one decode rank's page are its heads in its order, each head taken from one prefill
rank that holds it (`pieces`); pure functions, tested without processes.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipefill.model.tensor_parallel import head_shares

MAX_RANKS = 1024  # a stage's TP ranks named in a handshake: more is not a real stage
MAX_KV_HEADS = 1 << 14  # a model's KV heads a peer may claim (a map of them is built)


def tp_head_map(num_heads: int, num_kv_heads: int, tp_size: int,
                split: str = "groups") -> list[list[int]]:
    """The head map of a stage run at --tp-size tp_size with its heads split by `split`
    (model/tensor_parallel.head_shares; "queries" puts a straddled group's KV head on both of
    its ranks: [[0, 1], [1, 2]] for 9 heads over 3 KV heads at TP 2)."""
    return [list(kv) for _, kv in head_shares(num_heads, num_kv_heads, tp_size, split)]


def latent_head_map(tp_size: int) -> list[list[int]]:
    """A latent layer's map (DeepSeek): the latent is the cache's one KV head, and every rank
    keeps it whole, so a prefill at any TP sends one copy (its rank 0's) to each decode rank."""
    return [[0] for _ in range(tp_size)]


def whole(num_kv_heads: int) -> list[list[int]]:
    """One rank holding every head (TP 1, and what an empty map in a message means)."""
    return [list(range(num_kv_heads))]


def head_map_of(kv_heads: list[list[int]], num_kv_heads: int) -> list[list[int]]:
    """A message's kv_heads field as a head map (empty: one rank with every head)."""
    return [list(hs) for hs in kv_heads] or whole(num_kv_heads)


def describe(head_map: list[list[int]]) -> str:
    """'rank 0: heads 0-1, rank 1: head 2' for a sentence."""
    def heads(hs: list[int]) -> str:
        if len(hs) > 1 and hs == list(range(hs[0], hs[-1] + 1)):
            return f"heads {hs[0]}-{hs[-1]}"
        return ("head " if len(hs) == 1 else "heads ") + ", ".join(map(str, hs[:8])) + \
            (", ..." if len(hs) > 8 else "")
    return ", ".join(f"rank {r}: {heads(hs)}" for r, hs in enumerate(head_map[:8])) + \
        (f" (and {len(head_map) - 8} more ranks)" if len(head_map) > 8 else "")


def check_head_map(head_map: list[list[int]], num_kv_heads: int, who: str) -> None:
    """ValueError with a sentence unless head_map is a stage's map of a model with num_kv_heads
    KV heads: 1..MAX_RANKS ranks, each holding ascending distinct heads in [0, num_kv_heads),
    and every head held by some rank."""
    if not 1 <= len(head_map) <= MAX_RANKS:
        raise ValueError(f"{who} names {len(head_map)} TP ranks (1 to {MAX_RANKS} are taken)")
    for r, hs in enumerate(head_map):
        if not hs:
            raise ValueError(f"{who}'s TP rank {r} holds no KV head")
        if any(not 0 <= h < num_kv_heads for h in hs) or sorted(set(hs)) != list(hs):
            raise ValueError(f"{who}'s TP rank {r} holds KV heads {list(hs)[:8]}, not distinct "
                             f"ascending heads of the model's {num_kv_heads}")
    missing = set(range(num_kv_heads)).difference(*map(set, head_map))
    if missing:
        raise ValueError(f"{who}'s TP ranks ({describe(head_map)}) hold no copy of KV head "
                         f"{min(missing)} of the model's {num_kv_heads}")


def check_pairing(prefill: list[list[int]], decode: list[list[int]], num_kv_heads: int,
                  decode_kv_heads: int | None = None) -> None:
    """ValueError with a sentence when a decode stage with head map `decode` cannot take its
    KV from a prefill stage with head map `prefill` (num_kv_heads: the prefill's model's;
    decode_kv_heads: the decode's, when it said)."""
    if decode_kv_heads is not None and decode_kv_heads != num_kv_heads:
        raise ValueError(f"the prefill's model has {num_kv_heads} KV heads, the decode's "
                         f"{decode_kv_heads}: start both with the same --model-path")
    check_head_map(prefill, num_kv_heads, "the prefill stage")
    check_head_map(decode, num_kv_heads, "the decode stage")


@dataclass(frozen=True)
class Piece:
    """`count` consecutive heads of one decode rank's page, taken from prefill rank `src`:
    its local heads [src_at, src_at + count) go to the decode rank's [dst_at, dst_at + count)."""
    src: int
    src_at: int
    dst_at: int
    count: int


def pieces(prefill: list[list[int]], dst_heads: list[int]) -> list[Piece]:
    """How one decode rank's heads (dst_heads, in its page order) are cut out of the prefill
    ranks' pages: each head from the first prefill rank that holds it, runs that are
    consecutive on both sides merged. A head no prefill rank holds is an AssertionError: the
    handshake (check_pairing) refused such a pair before any page moved."""
    where = {}
    for r, hs in enumerate(prefill):
        for i, h in enumerate(hs):
            where.setdefault(h, (r, i))
    out: list[Piece] = []
    for j, h in enumerate(dst_heads):
        assert h in where, f"KV head {h} is on no prefill rank"
        r, i = where[h]
        last = out[-1] if out else None
        if last is not None and last.src == r and last.src_at + last.count == i:
            out[-1] = Piece(r, last.src_at, last.dst_at, last.count + 1)
        else:
            out.append(Piece(r, i, j, 1))
    return out


def whole_source(prefill: list[list[int]], dst_heads: list[int]) -> int | None:
    """The first prefill rank whose pages are exactly the decode rank's (same heads, same
    order): its pages cross as they are, with no cutting (at equal TP with a straddled KV head
    on two ranks, each decode rank's own prefill rank). None when the heads must be cut."""
    for r, hs in enumerate(prefill):
        if list(hs) == list(dst_heads):
            return r
    return None
