"""All-reduce and all-gather between the CPU ranks of one node over a shared-memory segment
that every rank spins on (ARCHITECTURE.md, 'The all-reduce inside a node').

    group = ShmGroup(rank, world, "tp", max_bytes)   # every rank of a gloo group, together
    group.all_reduce_(hidden)                        # sum over the ranks, in place
    summed = group.bind_all_reduce(hidden); summed() # the same, checked once (a hot buffer)
    parts = group.all_gather(shard)                  # [world, *shard.shape]
    group.close()

The ranks must already share a torch.distributed group (gloo): it carries the rendezvous (rank 0
creates the segment and broadcasts its name, the others attach, and rank 0 removes the name
from /dev/shm as soon as every rank holds a mapping, so nothing is left there whatever happens
later). Every rank makes the same calls in the same order with the same shapes and dtypes (a
mismatch raises on every rank). One thread per group at a time.

A call that cannot finish — a peer exited, closed the group or failed, or did not arrive within
`timeout_s` — raises ShmPeerError with a sentence; the group is unusable from then on, on every
rank. (A rank that finds everything it needed already there may still complete the call during
which a peer gave up; its next call raises.)
"""
from __future__ import annotations

import functools
import os
import re
import secrets
import time
import weakref

import torch
import torch.distributed as dist

from pipefill.kernels import shm_comm

DEFAULT_MAX_BYTES = 8 << 20  # per rank and buffer: a 128 MiB all-reduce runs as 16 pieces
SMALL_MAX_BYTES = 64 << 10  # pieces up to this size: every rank sums everything (one barrier)
SEGMENT_PREFIX = "pipefill-"
STALE_AFTER_S = 60.0  # a segment name older than this whose creator is gone is a leftover
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_NAME = re.compile(r"[A-Za-z0-9_.]{1,48}")


class ShmPeerError(RuntimeError):
    """A shared-memory collective could not finish: a peer exited, left, failed or timed out."""


class ShmGroup:
    """One shared-memory segment between the `world` ranks of `group` (default: the default
    group), created collectively. `max_bytes`: each rank's buffer (rounded up to 4 KiB); larger
    calls run in pieces of that size. `timeout_s`: the longest wait for one peer at one step.
    Sums use the best build of the CPU (`isa` forces one of shm_comm.ISAS; `hide_cpu_flags`
    rules out builds that need those flags). `spin_us`: how long a wait spins before it yields
    and then sleeps; `small_max_bytes`: pieces up to this size are summed whole by every rank,
    larger ones split into one part per rank (reduce-scatter, then all-gather)."""

    def __init__(self, rank: int, world: int, name: str = "shm",
                 max_bytes: int = DEFAULT_MAX_BYTES, *, group=None, timeout_s: float = 120.0,
                 isa: str | None = None, hide_cpu_flags: str = "", spin_us: float = 50.0,
                 small_max_bytes: int = SMALL_MAX_BYTES):
        _check_arguments(rank, world, name, max_bytes, group, timeout_s)
        self.rank, self.world, self.timeout_s = rank, world, float(timeout_s)
        self.slot_bytes = -(-max_bytes // 4096) * 4096
        self.isa, why = shm_comm.choose_isa(hide_cpu_flags, isa)
        lib = shm_comm.extension() if self.isa else None
        unavailable = None if lib else f"the shared-memory all-reduce is unavailable: {why}"
        # Every rank takes part in the rendezvous, even one that cannot join: the others then
        # raise its reason instead of waiting for it.
        addr = _rendezvous(lib, rank, world, name, self.slot_bytes, group, unavailable)
        self.segment_bytes = lib.segment_bytes(world, self.slot_bytes)
        try:
            self._comm = lib.Comm(addr, rank, world, self.slot_bytes, shm_comm.ISA_CODE[self.isa],
                                  small_max_bytes, spin_us)
        except Exception:
            lib.unmap_segment(addr, self.segment_bytes)
            raise
        # Unmapped when closed, or when the group is garbage collected without close().
        self._release = weakref.finalize(self, _release, lib, self._comm, addr,
                                         self.segment_bytes)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` (float32 or bfloat16, contiguous, on the CPU) over the ranks, in place;
        bfloat16 is summed in float32 and rounded once. Every rank gets the same bits."""
        self._check(tensor, "all_reduce_")
        if tensor.dtype not in _DTYPE_CODE:
            raise ValueError(f"all_reduce_: float32 or bfloat16 tensors only, got {tensor.dtype}")
        err = self._open().all_reduce(tensor.data_ptr(), tensor.numel(), _DTYPE_CODE[tensor.dtype],
                                      self.timeout_s)
        if err:
            raise ShmPeerError(f"shared-memory all_reduce on rank {self.rank} of {self.world}: "
                               f"{err}")
        return tensor

    def bind_all_reduce(self, tensor: torch.Tensor):
        """all_reduce_(tensor) as a call without arguments, its checks done once: for a buffer
        summed many times a step (the decode step's o_proj and down outputs), where the
        checks would cost more than the sum. The tensor must stay alive and in place; a call
        after close() raises ShmPeerError."""
        self._check(tensor, "bind_all_reduce")
        if tensor.dtype not in _DTYPE_CODE:
            raise ValueError(f"bind_all_reduce: float32 or bfloat16 tensors only, got "
                             f"{tensor.dtype}")
        reduce = functools.partial(self._open().all_reduce, tensor.data_ptr(), tensor.numel(),
                                   _DTYPE_CODE[tensor.dtype], self.timeout_s)
        rank, world = self.rank, self.world

        def all_reduce() -> None:
            err = reduce()
            if err:
                raise ShmPeerError(f"shared-memory all_reduce on rank {rank} of {world}: {err}")
        return all_reduce

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's `tensor` (contiguous, on the CPU, any dtype), stacked in rank order into
        `out` ([world, *tensor.shape], allocated when None)."""
        self._check(tensor, "all_gather")
        shape = (self.world, *tensor.shape)
        if out is None:
            out = torch.empty(shape, dtype=tensor.dtype)
        else:
            self._check(out, "all_gather (out)")
            if tuple(out.shape) != shape or out.dtype != tensor.dtype:
                raise ValueError(f"all_gather: out must be {tensor.dtype} {list(shape)}, got "
                                 f"{out.dtype} {list(out.shape)}")
        nbytes = tensor.numel() * tensor.element_size()
        err = self._open().all_gather(tensor.data_ptr(), out.data_ptr(), nbytes, self.timeout_s)
        if err:
            raise ShmPeerError(f"shared-memory all_gather on rank {self.rank} of {self.world}: "
                               f"{err}")
        return out

    def close(self) -> None:
        """Leaves the group (a peer still waiting for this rank stops waiting) and unmaps the
        segment. Idempotent."""
        self._release()

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def __enter__(self) -> ShmGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self):
        if self.closed:
            raise ValueError("this shared-memory group is closed")
        return self._comm

    def _check(self, tensor: torch.Tensor, what: str) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise ValueError(f"{what}: expected a CPU tensor")
        if not tensor.is_contiguous():
            raise ValueError(f"{what}: the tensor must be contiguous")


def _release(lib, comm, addr: int, nbytes: int) -> None:
    comm.leave()
    lib.unmap_segment(addr, nbytes)


def _check_arguments(rank, world, name, max_bytes, group, timeout_s) -> None:
    if not dist.is_initialized():
        raise ValueError("ShmGroup needs the ranks' torch.distributed (gloo) group for its "
                         "rendezvous: call torch.distributed.init_process_group first")
    if dist.get_world_size(group) != world or dist.get_rank(group) != rank:
        raise ValueError(f"ShmGroup(rank={rank}, world={world}) does not match its "
                         f"torch.distributed group (rank {dist.get_rank(group)} of "
                         f"{dist.get_world_size(group)})")
    if not _NAME.fullmatch(name):
        raise ValueError(f"ShmGroup name {name!r}: 1 to 48 letters, digits, '_' or '.'")
    if max_bytes < 1:
        raise ValueError(f"ShmGroup max_bytes must be positive, got {max_bytes}")
    if not timeout_s > 0:
        raise ValueError(f"ShmGroup timeout_s must be positive, got {timeout_s}")


def _rendezvous(lib, rank: int, world: int, name: str, slot_bytes: int, group,
                error: str | None) -> int:
    """The segment's address in this process, once every rank has mapped it; its name is
    removed from /dev/shm before this returns (or raises) on any rank. `error`: why this rank
    cannot join (every rank then raises it)."""
    segment, addr = None, 0
    if rank == 0 and error is None:
        remove_stale_segments()
        segment = f"/{SEGMENT_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            addr = lib.map_segment(segment, world, slot_bytes, True)
        except (RuntimeError, ValueError) as e:
            segment, error = None, str(e)
    try:
        found = [segment, error]
        dist.broadcast_object_list(found, group_src=0, group=group)
        if rank != 0 and found[0] is not None and error is None:  # None: rank 0 failed
            try:
                addr = lib.map_segment(found[0], world, slot_bytes, False)
            except (RuntimeError, ValueError) as e:
                error = str(e)
        errors = [None] * world
        dist.all_gather_object(errors, error, group=group)
    finally:
        if rank == 0 and segment is not None:
            lib.unlink_segment(segment)
    dist.barrier(group=group)  # the name is gone on every rank's return
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        if addr:
            lib.unmap_segment(addr, lib.segment_bytes(world, slot_bytes))
        raise RuntimeError("the shared-memory group could not be set up: " + "; ".join(failed))
    return addr


def remove_stale_segments(root: str = "/dev/shm") -> list[str]:
    """Removes the group segments whose creator has exited: a name outlives its group only when
    rank 0 died during the rendezvous. Names younger than STALE_AFTER_S are left alone (their
    creator may live in another pid namespace). Returns the names removed."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        parts = entry.name.rsplit("-", 2)
        if not entry.name.startswith(SEGMENT_PREFIX) or len(parts) != 3 or not parts[1].isdigit():
            continue
        try:
            if time.time() - entry.stat().st_mtime < STALE_AFTER_S or _alive(int(parts[1])):
                continue
            os.unlink(entry.path)
            removed.append(entry.name)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
