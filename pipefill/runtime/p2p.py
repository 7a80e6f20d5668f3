"""Point-to-point messages between pipeline stages over torch.distributed.

Two channels per stage: activations forward (stage s -> s+1: a PipeMessage with `hidden` and
`residual`), and results back (last stage -> stage 0: StepResults). Every message is one frame,
one gloo send (ARCHITECTURE.md, 'A chunk's path'):

    header (64 bytes) | body (msgpack) | hidden | residual      each part 64-byte aligned

The header holds a magic, the body's length, the rows, the frame's length and the slot size
the sender wants from now on. The body is decoded against the channel's dataclass by wire.py
(never unpickled); the tensors' rows come from the header, their width and dtype from the
model, so nothing a peer sends picks a type; the frame's length must be what those give. A
header or body that does not fit raises a clear WireError on the receiving stage (the link is
trusted, but a bug must not turn into anything worse).

Why one send: gloo sends a message only once the receiver has posted a receive for it, and a
send finding none waits a round trip for the receiver's "ready". The receiving thread keeps
RECV_AHEAD receives posted, each into a fresh slot larger than any frame the sender will put
in it, so a send never waits (gloo accepts a message shorter than the receive's buffer,
without saying how long it was: the header says). Slot sizes need no agreement beforehand:
the first RECV_AHEAD slots hold FIRST_SLOT_BYTES, and every frame announces the size the
receiver's next slot gets (the largest frame so far, to the next power of two), so both ends
know the size of each slot, which is filled in order. A frame larger than its slot goes as
a header in the slot, flagged, and the whole frame after it on the channel's second tag: one
round trip more, for the first large frames only. Results are batched: the last stage's sender puts every result
queued at that moment into one frame (the body is a list).

Each direction is served by its own thread: sends are queued and return at once with a handle
that keeps the payload alive until it is on the wire (the send thread copies it into a frame
buffer it keeps for the next one: a copy and one largest frame of memory, against a round
trip per tensor); receives are posted by the receiving thread ahead of need, so the next
micro-batch lands while this stage computes. (gloo's `irecv(...).is_completed()` does not
progress without `wait()`, so threads are the way to poll.) No stage ever blocks on a send, so
the ring (last stage -> stage 0) cannot deadlock. The tensors a stage receives are views into
the slot they arrived in.

On CPU everything goes over one gloo group. On CUDA, the frame carries the header and body
only, over a gloo group, and the tensors follow over an NCCL group per neighbour pair, one send
each (untested on a GPU so far).
"""
from __future__ import annotations

import queue
import re
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from pipefill.base.plan import PipeMessage, StepResult
from pipefill.base.wire import BodyCodec, WireError
from pipefill.runtime.executor import Activations

_FORWARD_TAG, _RESULT_TAG = 100, 200  # + 0 frames, + 1 spilled frames, + 2.. NCCL tensors
_SPILL = 1
MAX_BODY_BYTES = 1 << 30
MAX_ROWS = 1 << 24  # tokens of one micro-batch
MAX_SLOT_BYTES = 1 << 34  # the most a sender may ask the receiver to post per slot
MAX_FRAME_BYTES = 1 << 36
FIRST_SLOT_BYTES = 1 << 20
RECV_AHEAD = 3
MAX_BATCH = 64  # results in one frame
ALIGN = 64
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sIqqqq")  # magic, flags, body bytes, rows, frame bytes, next slot
_MAGIC = b"PFP2"


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Header:
    flags: int
    body_len: int
    rows: int  # -1: no tensors
    frame_len: int
    next_slot: int  # the receiver posts its next slot this large

    def pack(self) -> bytes:
        return _HEADER.pack(_MAGIC, self.flags, self.body_len, self.rows, self.frame_len,
                            self.next_slot).ljust(HEADER_BYTES, b"\0")


def frame_layout(body_len: int, rows: int, specs) -> tuple[list[int], int]:
    """Offsets of the tensors in a frame, and the frame's length."""
    end = HEADER_BYTES + _aligned(body_len)
    offsets = []
    for width, dtype in specs if rows >= 0 else ():
        offsets.append(end)
        end += _aligned(rows * width * dtype.itemsize)
    return offsets, end


@dataclass
class SendHandle:
    sent: threading.Event
    payload: tuple  # alive until sent

    def done(self) -> bool:
        return self.sent.is_set()

    def wait(self) -> None:
        self.sent.wait()


class _Channel:
    """One direction between two ranks: messages in order, one thread doing the blocking I/O.
    tensor_specs: (width, dtype) of each tensor a message carries, from the model. batches:
    the body is a list, and the sender puts every message queued at once into one frame."""

    def __init__(self, peer: int, tag: int, outbound: bool, body_type: type, tensor_specs,
                 meta_group, tensor_group, device, name: str, batches: bool = False):
        self.peer, self.tag, self.specs, self.batches = peer, tag, tensor_specs, batches
        self.codec = BodyCodec(list[body_type] if batches else body_type)
        self.meta_group, self.tensor_group, self.device = meta_group, tensor_group, device
        # On CUDA the tensors go over NCCL, after the frame; on CPU inside it.
        self.inline = tensor_group is None
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        # Sender: the size of each slot the receiver has posted, in the order they fill.
        self._slots = deque([FIRST_SLOT_BYTES] * RECV_AHEAD)
        self._next_slot = FIRST_SLOT_BYTES
        self._frame = torch.empty(0, dtype=torch.uint8)  # reused for every frame
        # Receiver: (slot, its receive) in the order the sender fills them; kept here, alive
        # as long as the channel, so a receive gloo still holds never points at freed memory.
        self._posted: deque[tuple[torch.Tensor, object]] = deque()
        target = self._send_loop if outbound else self._recv_loop
        self.thread = threading.Thread(target=self._guard, args=(target,), name=name,
                                       daemon=True)
        self.thread.start()

    def _guard(self, loop) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread
            loop()
        except BaseException as e:  # noqa: BLE001 - surfaced to the stage's main thread
            self.error = e
            self.queue.put(None)

    # -- sending --
    def send(self, body: object, tensors: list[torch.Tensor]) -> SendHandle:
        self._raise_if_broken()
        handle = SendHandle(threading.Event(), (body, [t.contiguous() for t in tensors]))
        self.queue.put(handle)
        return handle

    def _send_loop(self) -> None:
        while True:
            batch = self._take_batch()
            bodies = [h.payload[0] for h in batch]
            tensors = batch[0].payload[1]
            assert len(batch) == 1 or not tensors, "only body-only messages are batched"
            self._send_frame(bodies if self.batches else bodies[0], tensors)
            for handle in batch:
                handle.payload = ()
                handle.sent.set()
                self.queue.task_done()

    def _take_batch(self) -> list[SendHandle]:
        batch = [self.queue.get()]
        while self.batches and len(batch) < MAX_BATCH:
            try:
                batch.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _send_frame(self, body: object, tensors: list[torch.Tensor]) -> None:
        data = self.codec.encode(body)
        rows = tensors[0].shape[0] if tensors else -1
        offsets, frame_len = frame_layout(len(data), rows,
                                          self.specs if self.inline and tensors else ())
        slot = self._slots.popleft()
        # The receiver posts its next slot of this size as soon as it reads this header.
        self._next_slot = max(self._next_slot,
                              min(1 << (frame_len - 1).bit_length(), MAX_SLOT_BYTES))
        self._slots.append(self._next_slot)
        spill = frame_len > slot
        header = Header(_SPILL if spill else 0, len(data), rows, frame_len, self._next_slot)
        frame = self._fill(header, data, offsets, tensors if self.inline else [])
        if spill:
            dist.send(frame[:HEADER_BYTES], self.peer, self.meta_group, self.tag)
            dist.send(frame, self.peer, self.meta_group, self.tag + 1)
        else:
            dist.send(frame, self.peer, self.meta_group, self.tag)
        if not self.inline:
            for i, t in enumerate(tensors):
                dist.send(t, self.peer, self.tensor_group, self.tag + 2 + i)

    def _fill(self, header: Header, data: bytes, offsets: list[int],
              tensors: list[torch.Tensor]) -> torch.Tensor:
        """The frame in this channel's reused buffer: a view of its first frame_len bytes."""
        if self._frame.numel() < header.frame_len:
            self._frame = torch.empty(1 << (header.frame_len - 1).bit_length(),
                                      dtype=torch.uint8)
        frame = self._frame[:header.frame_len]
        raw = frame.numpy()
        raw[:HEADER_BYTES] = np.frombuffer(header.pack(), dtype=np.uint8)
        raw[HEADER_BYTES:HEADER_BYTES + len(data)] = np.frombuffer(data, dtype=np.uint8)
        for offset, t, (width, dtype) in zip(offsets, tensors, self.specs):
            tensor_at(frame, offset, header.rows, width, dtype).copy_(t)  # the model's dtype
        return frame

    def flush(self) -> None:
        """Waits until every queued message is on the wire."""
        while self.queue.unfinished_tasks:
            self._raise_if_broken()
            time.sleep(0.002)

    # -- receiving --
    def _post(self, nbytes: int) -> None:
        slot = torch.empty(nbytes, dtype=torch.uint8)
        self._posted.append((slot, dist.irecv(slot, self.peer, self.meta_group, self.tag)))

    def _recv_loop(self) -> None:
        for _ in range(RECV_AHEAD):
            self._post(FIRST_SLOT_BYTES)
        while True:
            slot, work = self._posted[0]
            work.wait()
            self._posted.popleft()
            header = self._read_header(slot)
            self._post(header.next_slot)  # before anything else: the sender may not wait
            frame = slot
            if header.flags & _SPILL:
                frame = torch.empty(header.frame_len, dtype=torch.uint8)
                dist.recv(frame, self.peer, self.meta_group, self.tag + 1)
            bodies, tensors = self._unpack(frame, header)
            for body in bodies if self.batches else [bodies]:
                self.queue.put((body, tensors))
            if isinstance(bodies, PipeMessage) and bodies.control == ("stop",):
                return

    def _read_header(self, slot: torch.Tensor) -> Header:
        magic, flags, body_len, rows, frame_len, next_slot = _HEADER.unpack(
            slot[:_HEADER.size].numpy().tobytes())
        header = Header(flags, body_len, rows, frame_len, next_slot)
        specs = self.specs if self.inline else ()
        problem = None
        if magic != _MAGIC or flags not in (0, _SPILL):
            problem = "not a pipefill frame"
        elif not 0 < body_len <= MAX_BODY_BYTES or not -1 <= rows <= MAX_ROWS or \
                (rows >= 0 and not self.specs):
            problem = f"body of {body_len} bytes, {rows} rows"
        elif frame_len != frame_layout(body_len, rows, specs)[1] or \
                frame_len > MAX_FRAME_BYTES or (not flags and frame_len > slot.numel()):
            problem = f"a frame of {frame_len} bytes for a body of {body_len} and {rows} rows"
        elif not FIRST_SLOT_BYTES <= next_slot <= MAX_SLOT_BYTES:
            problem = f"a next slot of {next_slot} bytes"
        if problem is not None:
            raise WireError(f"stage {self.peer} sent a malformed header: {problem}")
        return header

    def _unpack(self, frame: torch.Tensor, header: Header) -> tuple[object, list]:
        data = frame[HEADER_BYTES:HEADER_BYTES + header.body_len].numpy().tobytes()
        try:
            body = self.codec.decode(data)
        except WireError as e:
            raise WireError(f"stage {self.peer} sent a malformed message: {e}") from None
        if header.rows < 0:
            return body, []
        if self.inline:
            offsets = frame_layout(header.body_len, header.rows, self.specs)[0]
            return body, [tensor_at(frame, offset, header.rows, width, dtype)
                          for offset, (width, dtype) in zip(offsets, self.specs)]
        tensors = []
        for i, (width, dtype) in enumerate(self.specs):
            t = torch.empty(header.rows, width, dtype=dtype, device=self.device)
            dist.recv(t, self.peer, self.tensor_group, self.tag + 2 + i)
            tensors.append(t)
        return body, tensors

    def ready(self) -> bool:
        self._raise_if_broken()
        return not self.queue.empty()

    def recv(self) -> tuple[object, list]:
        item = self.queue.get()
        if item is None:
            self._raise_if_broken()
        return item

    def _raise_if_broken(self) -> None:
        if self.error is not None:
            # gloo's message carries a source path and advice; keep the cause.
            cause = re.sub(r"\[/[^\]]*\]\s*", "", str(self.error)).split(". This is")[0]
            raise RuntimeError(f"link to stage {self.peer} failed: {cause}") from self.error


def tensor_at(frame: torch.Tensor, offset: int, rows: int, width: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The [rows, width] tensor of `dtype` at byte `offset` of a frame (a view)."""
    nbytes = rows * width * dtype.itemsize
    return frame[offset:offset + nbytes].view(dtype).view(rows, width)


def row_share(rows: int, tp_rank: int, tp_size: int) -> range:
    """The rows of a micro-batch's activations that TP rank `tp_rank` sends to its peer of the
    next stage under the per-rank transport: runs of ceil(rows / tp_size) in rank order, the
    last ones shorter or empty (the receivers gather them padded to that length)."""
    each = -(-rows // tp_size)
    return range(min(tp_rank * each, rows), min((tp_rank + 1) * each, rows))


def plan_rows(msg: PipeMessage) -> int:
    return sum(w.num_tokens for w in msg.plan.seqs)


class Pipe:
    """A stage's channels: activations to/from its neighbours, results last -> first.
    tp_share (tp_rank, tp_size): the per-rank stage transport, where this leader sends and
    receives only its TP rank's rows (row_share) and its TP peers the rest (SliceLink)."""

    def __init__(self, rank: int, size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, meta_group=None, pair_groups=None,
                 tp_share: tuple[int, int] | None = None):
        self.rank, self.size, self.tp_share = rank, size, tp_share
        specs = [(hidden_size, dtype), (hidden_size, torch.float32)]

        def channel(peer, tag, outbound, name, tensor_specs=()):
            pair = (min(rank, peer), max(rank, peer))
            tensor_group = pair_groups.get(pair) if pair_groups else None
            results = tag == _RESULT_TAG
            return _Channel(peer, tag, outbound, StepResult if results else PipeMessage,
                            tensor_specs, meta_group, tensor_group, device, f"pipefill-{name}",
                            batches=results)
        last = size - 1
        self.to_next = channel(rank + 1, _FORWARD_TAG, True, "send-next", specs) \
            if rank < last else None
        self.from_prev = channel(rank - 1, _FORWARD_TAG, False, "recv-prev", specs) \
            if rank > 0 else None
        self.results_out = channel(0, _RESULT_TAG, True, "send-result") if rank == last else None
        self.results_in = channel(last, _RESULT_TAG, False, "recv-result") if rank == 0 else None

    def send_forward(self, msg: PipeMessage, acts: Activations | None) -> SendHandle:
        tensors = [] if acts is None else [acts.hidden, acts.residual]
        if tensors and self.tp_share is not None:
            rows = row_share(acts.hidden.shape[0], *self.tp_share)
            tensors = [t[rows.start:rows.stop] for t in tensors]
        return self.to_next.send(msg, tensors)

    def recv_forward(self) -> tuple[PipeMessage, Activations | None]:
        msg, tensors = self.from_prev.recv()
        if not tensors:
            return msg, None
        if self.tp_share is None:
            return msg, Activations(*tensors)
        total = plan_rows(msg)
        _check_share(tensors, total, *self.tp_share, self.rank - 1)
        return msg, Activations(*tensors, share_of=total)

    def post_local(self, msg: PipeMessage) -> None:
        """Puts a control message into this stage's own inbound queue, behind what has
        arrived: any thread of this stage wakes the stage's loop with it this way (a later
        stage's KV transfer reports, which its loop passes on towards stage 0)."""
        self.from_prev.queue.put((msg, []))

    def send_result(self, result: StepResult) -> SendHandle:
        return self.results_out.send(result, [])

    def result_ready(self) -> bool:
        return self.results_in.ready()

    def recv_result(self) -> StepResult:
        return self.results_in.recv()[0]

    def flush(self) -> None:
        for ch in (self.to_next, self.results_out):
            if ch is not None:
                ch.flush()


def _check_share(tensors: list[torch.Tensor], total: int, tp_rank: int, tp_size: int,
                 sender: int) -> None:
    expected = len(row_share(total, tp_rank, tp_size))
    if tensors[0].shape[0] != expected:
        raise WireError(f"stage {sender} TP rank {tp_rank} sent {tensors[0].shape[0]} rows of a "
                        f"{total}-row micro-batch, not its share of {expected}")


class SliceLink:
    """A TP peer's part of the per-rank stage transport (ARCHITECTURE.md, 'Tensor parallelism
    inside a stage'): its rows of each micro-batch's activations (row_share) to the same TP
    rank of the next stage, and its rows from the previous stage's. The plans travel between
    the leaders (Pipe) and reach the peers in their leader's broadcast; each slice names its
    plan's step, which the receiver checks. prev_peer / next_peer: global ranks, None at the
    pipeline's ends."""

    def __init__(self, prev_peer: int | None, next_peer: int | None, tp_rank: int,
                 tp_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.tp_rank, self.tp_size, self.prev_peer = tp_rank, tp_size, prev_peer
        specs = [(hidden_size, dtype), (hidden_size, torch.float32)]
        self.to_next = None if next_peer is None else _Channel(
            next_peer, _FORWARD_TAG, True, PipeMessage, specs, None, None, device,
            "pipefill-send-share")
        self.from_prev = None if prev_peer is None else _Channel(
            prev_peer, _FORWARD_TAG, False, PipeMessage, specs, None, None, device,
            "pipefill-recv-share")

    def send(self, step_id: int, acts: Activations) -> SendHandle:
        rows = row_share(acts.hidden.shape[0], self.tp_rank, self.tp_size)
        return self.to_next.send(PipeMessage(None, control=("share", step_id)),
                                 [t[rows.start:rows.stop] for t in (acts.hidden, acts.residual)])

    def recv(self, msg: PipeMessage) -> Activations:
        """This rank's rows of the micro-batch `msg` (its leader's broadcast) carries."""
        body, tensors = self.from_prev.recv()
        if body.control != ("share", msg.plan.step_id) or not tensors:
            raise WireError(f"rank {self.prev_peer} sent {body.control} where rows of step "
                            f"{msg.plan.step_id} were due")
        total = plan_rows(msg)
        _check_share(tensors, total, self.tp_rank, self.tp_size, self.prev_peer)
        return Activations(*tensors, share_of=total)

    def flush(self) -> None:
        if self.to_next is not None:
            self.to_next.flush()
