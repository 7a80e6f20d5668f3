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

The kernel splits a step into parts of DECODE_KV_PART (1,024) keys only past two parts, and
over a few parts half a head saves about what the extra calls cost: so a step takes this path
only when every sequence's keys are split into at least MIN_PARTS parts, and both ranks decide
alike from the plan's prefix lengths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipefill.kernels.cpu_attention import DECODE_KV_PART

# The fewest split parts per sequence for the split. Half the straddled head saves 30 layers x
# keys / 2 x 256 bytes (K and V of 64 bf16 dims) a step, about 0.3 us a key at one core's
# ~13 GB/s (0.9 ms at 3,073 keys, 2.4 ms at 8,192), against two gathers of ~2 us (`bench
# allreduce`) and about a dozen small torch calls a layer, ~0.5 ms a step: from 4 parts
# (more than 3,072 keys) it pays.
MIN_PARTS = 4
# The fewest keys (prefix + 1) a sequence needs for MIN_PARTS of the kernel's split parts (a
# step over more than two parts of DECODE_KV_PART keys is cut into them; a rank of one KV head,
# whose halves stop at two such parts, gets the same count), for the planner, which runs no
# kernel.
MIN_KEYS = max(2, MIN_PARTS - 1) * DECODE_KV_PART + 1


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
        # Where this rank's heads and the other rank's sit among the whole group's layout.
        peer = straddled.peer_heads
        self.own_slots = slice(peer, None) if straddled.peer_first else slice(0, self.heads)
        self.peer_slots = slice(0, peer) if straddled.peer_first else slice(self.heads, None)
        self._by_rows: dict[int, tuple] = {}

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
        parts = decode_parts(lens, self.model.cfg.num_kv_heads)
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
        send, whole_q, whole_out = self._buffers(q)
        send[:, :self.own].copy_(q[:, self.own_rows])
        peer = self.comm.all_gather(send)[1 - self.rank, :, :self.s.peer_heads]
        whole_q[:, self.own_slots].copy_(q)
        whole_q[:, self.peer_slots].copy_(peer)
        decode_attention(self.model.attention.isa, whole_q, k, v, k_cache, v_cache, *tables,
                         self.model.scale, whole_out,
                         shared=(self.s.local_kv, step.ranges, step.partials))
        merge_gathered(self.comm.all_gather(step.partials), step.counts, whole_out,
                       self.first_row)
        out.copy_(whole_out[:, self.own_slots])

    def _buffers(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(what this rank sends, q with the whole group [M, heads + peer_heads, D], the
        attention of it), kept per row count: the step reuses them every layer."""
        rows = q.shape[0]
        buffers = self._by_rows.get(rows)
        if buffers is None:
            whole = q.new_empty(rows, self.heads + self.s.peer_heads, q.shape[2])
            buffers = self._by_rows[rows] = (q.new_zeros(rows, self.width, q.shape[2]), whole,
                                             torch.empty_like(whole))
        return buffers
