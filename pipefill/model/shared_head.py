"""A decode step's straddled KV head split by keys between two TP ranks (ARCHITECTURE.md,
'Tensor parallelism inside a stage').

At TP 2 split by query heads (SmolLM2-135M: heads 0-4 on rank 0 over KV heads 0-1, heads 5-8
on rank 1 over KV heads 1-2), each rank's attention reads all keys of KV head 1 for its own
query heads of that group: every rank reads 2 of the 3 KV heads, where one process's two
threads share the 3 between them, and a decode step over a long context is bound by those
bytes. Here both ranks attend with the group's three query heads, each over half of the head's
split-KV parts, and merge the two halves:

1. the ranks swap their query heads of the group (an all-gather of a few hundred bytes), so
   each holds the whole group next to its own heads: equal groups, the kernel's plain layout;
2. the kernel runs every other head whole and the shared head's parts [lo, hi) only, leaving
   their unmerged (O, max, sum) (cpu_attention.decode_attention's `shared`);
3. the ranks gather those partials and merge them in part order (merge_gathered), the same
   arithmetic one rank computing every part does: the step's bits do not change.

The kernel splits a step into parts only past 2 x 1,024 keys, and over fewer keys half a head
saves about what the two gathers cost: so a step takes this path only when every sequence's
keys are split into at least MIN_PARTS parts, and both ranks decide alike from the plan's
prefix lengths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The fewest split parts per sequence for the split: the kernel's first split, 3 parts (2,049
# to 3,072 keys). Half a head of 64 dims over 1,536 keys in bf16 is 384 KB a layer, about 30 us
# at one core's ~13 GB/s, against two gathers of about 2 us each (`bench allreduce`: a token's
# sum takes 2 us on 2 Zen 4 cores); below, the kernel runs a step as one part.
MIN_PARTS = 3
# The kernel's split-KV part (kAutoKvPart, kernels/csrc/cpu_attn_ext.cpp): a step over more than
# two of them is cut into parts of this many keys. MIN_KEYS: the fewest keys (prefix + 1) a
# sequence needs for MIN_PARTS parts, for the planner, which runs no kernel.
KV_PART = 1024
MIN_KEYS = max(2, MIN_PARTS - 1) * KV_PART + 1


@dataclass
class StepSplit:
    """One step's parts of the shared head: this rank's [lo, hi) per sequence, both ranks'
    counts (rank order) and a buffer for this rank's partials."""
    ranges: torch.Tensor  # int64 [B, 2]
    counts: torch.Tensor  # int64 [2, B]
    partials: torch.Tensor  # float32 [B, P, group, D + 2]


class SharedHeadDecode:
    """The attention of a TP rank's decode step with its straddled head split by keys."""

    def __init__(self, model, straddled):
        self.model, self.s = model, straddled
        self.comm = model.tp.comm
        self.rank = 1 if straddled.peer_first else 0
        cfg = model.cfg
        self.heads, self.own = cfg.num_heads, straddled.group - straddled.peer_heads
        # The group's query heads among this rank's own: the last ones on rank 0, the first
        # ones on rank 1.
        self.own_rows = (slice(0, self.own) if straddled.peer_first
                         else slice(self.heads - self.own, self.heads))
        self.width = max(self.own, straddled.peer_heads)  # what each rank sends, padded
        self.first_row = straddled.local_kv * straddled.group  # the group in the whole layout

    @staticmethod
    def build(model):
        """The rank's split, or None where its attention or its heads do not take one."""
        from pipefill.model.attention import VectorAttention
        straddled = getattr(model.tp, "straddled", None)
        if straddled is None or type(model.attention) is not VectorAttention:
            return None
        return SharedHeadDecode(model, straddled)

    def plan(self, lens: torch.Tensor) -> StepSplit | None:
        """This step's split from its prefix lengths (int64 [B]); None: the plain path."""
        from pipefill.kernels.cpu_attention import decode_parts
        parts = decode_parts(lens)
        if int(parts.min()) < MIN_PARTS:
            return None
        first = parts // 2  # rank 0 the earlier half, rank 1 the later one and the new token
        counts = torch.stack([first, parts - first])
        lo, hi = (torch.zeros_like(first), first) if self.rank == 0 else (first, parts)
        partials = torch.empty(len(lens), int(counts.max()), self.s.group,
                               self.model.cfg.head_dim + 2)
        return StepSplit(torch.stack([lo, hi], 1).contiguous(), counts, partials)

    def attend(self, q, k, v, k_cache, v_cache, tables, step: StepSplit, out) -> None:
        """out [M, heads, D] = the rank's own heads' attention, as decode_batch gives it."""
        from pipefill.kernels.cpu_attention import decode_attention, merge_gathered
        whole_q = self._whole_group(q)
        whole_out = torch.empty_like(whole_q)
        decode_attention(self.model.attention.isa, whole_q, k, v, k_cache, v_cache, *tables,
                         self.model.scale, whole_out,
                         shared=(self.s.local_kv, step.ranges, step.partials))
        merge_gathered(self.comm.all_gather(step.partials), step.counts, whole_out,
                       self.first_row)
        out.copy_(self._own(whole_out))

    def _whole_group(self, q: torch.Tensor) -> torch.Tensor:
        """q [M, heads, D] with the other rank's query heads of the group added where they
        belong: [M, heads + peer_heads, D], every KV head's group whole."""
        rows = q.shape[0]
        send = q.new_zeros(rows, self.width, q.shape[2])
        send[:, :self.own] = q[:, self.own_rows]
        peer = self.comm.all_gather(send)[1 - self.rank, :, :self.s.peer_heads]
        return torch.cat([peer, q] if self.s.peer_first else [q, peer], dim=1)

    def _own(self, whole: torch.Tensor) -> torch.Tensor:
        peer = self.s.peer_heads
        return whole[:, peer:] if self.s.peer_first else whole[:, :self.heads]
