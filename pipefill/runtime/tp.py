"""The ranks of one stage under tensor parallelism (ARCHITECTURE.md, 'Tensor parallelism inside
a stage').

Rank 0 of a stage, its leader, is the stage as the rest of the engine sees it: it receives
micro-batches from the previous stage (or schedules them, on stage 0), sends them on, and on
the last stage computes the results. Before it runs anything on its layers or pages it
broadcasts the same thing to its peers (`TPLink.share_*`), which run it too (`run_tp_peer`);
inside the layers the ranks meet twice a layer in `all_reduce_`. A peer never talks to
another stage or to the front end, except to report its own failure and, under the per-rank
stage transport, to pass its share of the activations' rows to its peer of the next stage.

A broadcast is one frame laid out as the pipeline's (runtime/p2p.frame_layout: the
PipeMessage body in msgpack, then hidden and residual), with four int64 (frame bytes, body
bytes, rows, kind) in its header bytes, sent as one gloo broadcast of a fixed 16 KiB slot when
it fits (a decode step's plan does), as the slot with the four numbers and then the frame when
it does not (`FrameBroadcast`).
Under the per-rank stage transport a received micro-batch's rows come split over the ranks
(p2p.row_share: the leader's in its Pipe frame, each peer's from its own SliceLink): the
leader broadcasts the plan alone and the ranks gather the rows (`gather_rows`).
The sums go through the shared-memory group of the stage's ranks (comm/shm.py), or through
gloo where that cannot be set up (a sentence in the log says why) or where the stage's ranks
run on different nodes (Layout.node_of). On CUDA (each rank on its own GPU,
Layout.gpu_index) the sums, the gathers and a forward's activations go over an NCCL group of
the stage's ranks, the plans and objects over the gloo one (`sum_path`, `OverNccl`; written,
never run on a GPU).
"""
from __future__ import annotations

import datetime
import logging

import numpy as np
import torch
import torch.distributed as dist

from pipefill.base.plan import PageOps, PipeMessage, StepPlan
from pipefill.base.wire import BodyCodec
from pipefill.comm.shm import ShmGroup
from pipefill.runtime.executor import Activations
from pipefill.runtime.p2p import HEADER_BYTES, frame_layout, tensor_at

log = logging.getLogger(__name__)

_FORWARD, _PAGE_OPS, _STOP, _FORWARD_SHARED, _OWNERS = 0, 1, 2, 3, 4
SUM_TIMEOUT_S = 3600.0
INLINE_BYTES = 16384  # a gloo broadcast of 16 KiB costs the CPU what one of 32 bytes does


class FrameBroadcast:
    """A leader's frames to its peers, one gloo broadcast each where the frame fits
    INLINE_BYTES (a plan, page ops, a stop: a decode step's), two where it does not (a chunk's
    activations). The broadcast buffer is a fixed slot: its first four int64 (frame bytes, body
    bytes, rows, kind) sit in the frame's header bytes, which nothing else in TP uses
    (p2p.frame_layout), and the frame fills the slot's start when it fits; when it does not,
    the slot carries the four numbers alone and the frame follows in a second broadcast.
    A peer waits in the slot's broadcast for as long as the leader is idle."""

    def __init__(self, src: int, group, inline_bytes: int = INLINE_BYTES):
        assert inline_bytes >= HEADER_BYTES
        self.src, self.group = src, group
        self._slot = torch.zeros(inline_bytes, dtype=torch.uint8)
        self._words = self._slot[:32].view(torch.int64).numpy()  # 32 <= HEADER_BYTES
        self._frame = torch.empty(0, dtype=torch.uint8)

    def fits(self, frame_len: int) -> bool:
        return frame_len <= self._slot.numel()

    def frame_for(self, frame_len: int) -> torch.Tensor:
        """The leader's buffer to lay a frame of frame_len bytes in (then send it)."""
        return self._slot[:frame_len] if self.fits(frame_len) else self._buffer(frame_len)

    def send(self, frame: torch.Tensor, body_len: int, rows: int, kind: int) -> None:
        """Broadcasts a frame laid out in frame_for's buffer."""
        self._words[:] = (frame.numel(), body_len, rows, kind)  # the slot's header bytes
        dist.broadcast(self._slot, src=self.src, group=self.group)
        if not self.fits(frame.numel()):
            dist.broadcast(frame, src=self.src, group=self.group)

    def receive(self) -> tuple[torch.Tensor, int, int, int]:
        """A peer's next frame (valid until the next receive), body bytes, rows, kind."""
        dist.broadcast(self._slot, src=self.src, group=self.group)
        frame_len, body_len, rows, kind = self._words.tolist()
        if self.fits(frame_len):
            return self._slot[:frame_len], body_len, rows, kind
        frame = self._buffer(frame_len)
        dist.broadcast(frame, src=self.src, group=self.group)
        return frame, body_len, rows, kind

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._frame.numel() < nbytes:
            self._frame = torch.empty(1 << (nbytes - 1).bit_length(), dtype=torch.uint8)
        return self._frame[:nbytes]


class InFrame:
    """A forward's activations on CPU: inside the leader's frame, after the plan (one
    FrameBroadcast over gloo)."""

    def __init__(self, specs):
        self.frame_specs = specs  # the frame lays out one tensor per spec

    def send(self, tensors: list[torch.Tensor]) -> None:
        pass  # already in the frame

    def receive(self, frame: torch.Tensor, body_len: int, rows: int) -> Activations:
        offsets = frame_layout(body_len, rows, self.frame_specs)[0]
        # Copies: the frame buffer is reused by the next broadcast, the forward keeps these.
        return Activations(*(tensor_at(frame, offset, rows, width, dtype).clone()
                             for offset, (width, dtype) in zip(offsets, self.frame_specs)))


class OverNccl:
    """A forward's activations on CUDA: the leader's frame carries the plan and the row count
    over gloo, and the tensors follow GPU to GPU, one NCCL broadcast each, in the same order
    on every rank (as p2p's channels between stages do). Written, never run on a GPU."""
    frame_specs = ()

    def __init__(self, specs, src: int, group, device: torch.device):
        self.specs, self.src, self.group, self.device = specs, src, group, device

    def send(self, tensors: list[torch.Tensor]) -> None:
        for t, (_, dtype) in zip(tensors, self.specs):
            dist.broadcast(t.to(self.device, dtype).contiguous(), src=self.src,
                           group=self.group)

    def receive(self, frame: torch.Tensor, body_len: int, rows: int) -> Activations:
        tensors = [torch.empty(rows, width, dtype=dtype, device=self.device)
                   for width, dtype in self.specs]
        for t in tensors:
            dist.broadcast(t, src=self.src, group=self.group)
        return Activations(*tensors)


def sum_path(layout, stage: int, device: torch.device) -> str:
    """How stage `stage`'s TP ranks sum and gather their tensors: "nccl" on CUDA (each rank's
    GPU), "gloo" where the ranks run on different nodes, else "shared memory" (gloo where it
    cannot be set up). Every rank of the stage sees the same layout and device type, so all
    take the same path."""
    if device.type == "cuda":
        return "nccl"
    return "gloo" if layout.tp_spans_nodes(stage) else "shared memory"


def stage_groups(layout, backend: str) -> list:
    """Every stage's TP group on `backend`. Every process of the world creates every stage's
    group, in the same order. Peers wait in a broadcast for as long as the server is idle: no
    timeout to speak of."""
    return [dist.new_group(layout.tp_group_ranks(s), backend=backend,
                           timeout=datetime.timedelta(days=30))
            for s in range(layout.pp_size)]


class TPLink:
    """One rank's end of its stage's TP group: the sums, and the leader's broadcasts. `group`
    (gloo) carries the plans and objects; `tensors`, the sums, the gathers and a forward's
    activations: the same gloo group on CPU, the stage's NCCL group on CUDA."""

    def __init__(self, layout, stage: int, tp_rank: int, hidden_size: int,
                 dtype: torch.dtype, hide_cpu_flags: str = "",
                 device: torch.device = torch.device("cpu")):
        self.stage, self.tp_rank, self.size = stage, tp_rank, layout.tp_size
        self.leader = layout.global_rank(stage, 0)
        self.group = self.tensors = stage_groups(layout, "gloo")[stage]
        self.specs = [(hidden_size, dtype), (hidden_size, torch.float32)]
        self.codec = BodyCodec(PipeMessage)
        self.plans = FrameBroadcast(self.leader, self.group)
        self.acts = InFrame(self.specs)
        self.shm, self.backend = None, "gloo"
        path = sum_path(layout, stage, device)
        if path == "nccl":
            self.tensors = stage_groups(layout, "nccl")[stage]
            self.acts = OverNccl(self.specs, self.leader, self.tensors, device)
            self.backend = f"NCCL on {device} (untested on a GPU)"
        elif path == "gloo":
            self.backend = "gloo (the stage's TP ranks are on different nodes)"
        else:
            self._try_shared_memory(hide_cpu_flags)

    def _try_shared_memory(self, hide_cpu_flags: str) -> None:
        try:
            # A peer that died is seen at once (its pid is watched); a long wait is a rank
            # still loading its weights before the warm-up forward, or a slow machine.
            self.shm = ShmGroup(self.tp_rank, self.size, f"tp{self.stage}", group=self.group,
                                timeout_s=SUM_TIMEOUT_S, hide_cpu_flags=hide_cpu_flags)
            self.backend = f"shared memory ({self.shm.isa})"
        except RuntimeError as e:  # every rank raises alike (the rendezvous agrees)
            log.warning("stage %d: TP all-reduce over gloo: %s", self.stage, e)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the stage's ranks, in place; every rank gets the same bits."""
        assert tensor.is_contiguous(), "a TP sum needs a contiguous tensor"
        if self.shm is not None and tensor.dtype in (torch.float32, torch.bfloat16):
            return self.shm.all_reduce_(tensor)
        dist.all_reduce(tensor, group=self.tensors)
        return tensor

    def bind_sum(self, tensor: torch.Tensor):
        """all_reduce_(tensor) as a call without arguments, checked once (the decode step's
        buffers: model/decode_step.py)."""
        assert tensor.is_contiguous(), "a TP sum needs a contiguous tensor"
        if self.shm is not None and tensor.dtype in (torch.float32, torch.bfloat16):
            return self.shm.bind_all_reduce(tensor)
        return lambda: dist.all_reduce(tensor, group=self.tensors)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (the same shape on each), stacked in rank order."""
        if self.shm is not None:
            return self.shm.all_gather(tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self.tensors)
        return torch.stack(parts)

    # ---- the leader ------------------------------------------------------------------------

    def gather_rows(self, acts: Activations) -> Activations:
        """The whole micro-batch from every rank's rows of it (p2p.row_share, per-rank
        transport): one all-gather per tensor, each rank's rows padded to the longest share."""
        total = acts.share_of
        each = -(-total // self.size)
        whole = []
        for part in (acts.hidden, acts.residual):
            if part.shape[0] != each:
                padded = part.new_zeros(each, part.shape[1])
                padded[:part.shape[0]] = part
                part = padded
            whole.append(self.all_gather(part.contiguous()).view(-1, part.shape[1])[:total])
        return Activations(*whole)

    def share_forward(self, plan: StepPlan, acts: Activations | None) -> Activations | None:
        """Shares a forward with the peers; returns the whole activations to run it on."""
        tensors = [] if acts is None else [acts.hidden, acts.residual]
        assert not tensors or acts.residual is not None, "activations come with their residual"
        if acts is not None and acts.share_of:  # the peers got theirs from the previous stage
            self._send(_FORWARD_SHARED, PipeMessage(plan), [])
            return self.gather_rows(acts)
        self._send(_FORWARD, PipeMessage(plan), tensors)
        return acts

    def share_page_ops(self, ops: PageOps) -> None:
        self._send(_PAGE_OPS, PipeMessage(None, control=("page_ops",), page_ops=ops), [])

    def share_owners(self, op: tuple) -> None:
        """A PD decode's page bookkeeping outside the plans: ("allocate", rid, pages) or
        ("written", pages), and "window_allocate" / "window_written" for window pages."""
        self._send(_OWNERS, PipeMessage(None, control=("owners", *op)), [])

    def share_stop(self) -> None:
        self._send(_STOP, PipeMessage(None, control=("stop",)), [])

    def _send(self, kind: int, msg: PipeMessage, tensors: list[torch.Tensor]) -> None:
        body = self.codec.encode(msg)
        rows = tensors[0].shape[0] if tensors else -1
        offsets, frame_len = frame_layout(len(body), rows, self.acts.frame_specs)
        frame = self.plans.frame_for(frame_len)
        frame[HEADER_BYTES:HEADER_BYTES + len(body)].numpy()[:] = np.frombuffer(body, np.uint8)
        for offset, t, (width, dtype) in zip(offsets, tensors, self.acts.frame_specs):
            tensor_at(frame, offset, rows, width, dtype).copy_(t)
        self.plans.send(frame, len(body), rows, kind)
        self.acts.send(tensors)

    # ---- a peer ----------------------------------------------------------------------------

    def receive(self) -> tuple[int, PipeMessage, Activations | None]:
        """The leader's next broadcast: (kind, message, activations or None)."""
        frame, body_len, rows, kind = self.plans.receive()
        msg = self.codec.decode(frame[HEADER_BYTES:HEADER_BYTES + body_len].numpy().tobytes())
        if rows < 0:
            return kind, msg, None
        return kind, msg, self.acts.receive(frame, body_len, rows)

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (small, picklable), in rank order, on every rank."""
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()


def map_stage_kv(link: TPLink, shared, cache) -> list[tuple[torch.Tensor, ...]] | None:
    """PD under TP (ARCHITECTURE.md, 'KV heads across TP sizes'): every rank's KV files
    (kv/shared.SharedEmpty) reach the leader, which maps its peers' K and V; then every rank
    removes its files' names. The leader gets (k, v) per rank, its own first, with a windowed
    cache's window K and V after them ('Window pages'); a peer None."""
    from pipefill.kv.shared import map_shared
    files = link.gather_objects(shared.files)
    try:
        if link.tp_rank != 0:
            return None
        own = (cache.k, cache.v)
        if getattr(cache, "window", None) is not None:  # SharedEmpty's order: K, V, window's
            own += (cache.window.k, cache.window.v)
        return [own] + [tuple(map_shared(*f) for f in rank_files) for rank_files in files[1:]]
    finally:
        link.barrier()  # the leader holds every mapping (or failed): the names may go
        shared.unlink()


def apply_owners(kv, op) -> None:
    """A leader's share_owners on a peer's page owners (kv: its StageKV); a "window_" op on
    its window pool's ('Window pages')."""
    kind, window = op[0].removeprefix("window_"), op[0].startswith("window_")
    owners = kv.window_owners if window else kv.owners
    if owners is None:
        raise RuntimeError("the TP leader shared window pages with a peer that keeps none")
    if kind == "allocate":
        owners.allocate(op[1], op[2])
    else:
        owners.mark_written(op[1])


def run_tp_peer(executor, link: TPLink, slices=None) -> None:
    """A TP peer's loop: does what its leader shares, until the leader's stop. slices
    (p2p.SliceLink): the per-rank stage transport, this rank's rows from the previous stage
    and to the next."""
    while True:
        kind, msg, acts = link.receive()
        if kind == _STOP:
            if slices is not None:
                slices.flush()
            executor.kv.close()
            return
        if kind == _FORWARD_SHARED:
            acts = link.gather_rows(slices.recv(msg))
        if kind == _PAGE_OPS:
            executor.kv.without_forward(msg.page_ops)
            continue
        if kind == _OWNERS:
            apply_owners(executor.kv, msg.control[1:])
            continue
        plan = msg.plan
        if plan.step_id < 0 and plan.seqs:  # a scratch prefill on pages lent by stage 0
            executor.kv.wait_for(plan.seqs[0].page_table, plan.seqs[0].page_table)
        acts = executor.forward(plan, acts)[0]
        if executor.model.is_last and plan.step_id >= 0:  # the leader's results() gathers
            for _ in executor.logit_blocks(plan, acts):
                pass
        elif slices is not None and slices.to_next is not None and plan.step_id >= 0 \
                and acts is not None:  # what the leader's loop sends on, in the same order
            slices.send(plan.step_id, acts)
