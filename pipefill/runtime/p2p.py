"""Point-to-point messages between pipeline stages over torch.distributed.

Two channels per stage: activations forward (stage s -> s+1: a PipeMessage with `hidden` and
`residual`), and results back (last stage -> stage 0: a StepResult). A message is a fixed-size
header (body length, rows), then the body (msgpack, decoded against the channel's dataclass by
wire.py: never unpickled), then the tensors: rows from the header, width and dtype from the
model, so nothing a peer sends picks a type. A header or body that does not fit raises a clear
error on the receiving stage (the link is trusted, but a bug must not turn into anything worse).

Each direction is served by its own thread: sends are queued and return at once with a handle
that keeps the payload alive until it is on the wire; receives are posted by the receiving
thread ahead of need, so the next micro-batch lands while this stage computes. (gloo's
`irecv(...).is_completed()` does not progress without `wait()`, so threads are the way to poll.)
No stage ever blocks on a send, so the ring (last stage -> stage 0) cannot deadlock.

On CPU everything goes over one gloo group. On CUDA, tensors go over an NCCL group per
neighbour pair and the header and body over a gloo group (untested on a GPU so far).
"""
from __future__ import annotations

import re
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipefill.runtime.executor import Activations
from pipefill.base.wire import BodyCodec, WireError
from pipefill.base.plan import PipeMessage, StepResult

_FORWARD_TAG, _RESULT_TAG = 100, 200  # + 0 header, + 1 body, + 2.. tensors
MAX_BODY_BYTES = 1 << 30
MAX_ROWS = 1 << 24  # tokens of one micro-batch


@dataclass
class SendHandle:
    sent: threading.Event
    payload: tuple  # alive until sent

    def done(self) -> bool:
        return self.sent.is_set()

    def wait(self) -> None:
        self.sent.wait()


class _Channel:
    """One direction between two ranks: messages in order, one thread doing the blocking I/O."""

    def __init__(self, peer: int, tag: int, outbound: bool, body_type: type, tensor_specs,
                 meta_group, tensor_group, device, name: str):
        self.peer, self.tag, self.specs = peer, tag, tensor_specs
        self.codec = BodyCodec(body_type)
        self.meta_group, self.tensor_group, self.device = meta_group, tensor_group, device
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
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
            handle = self.queue.get()
            body, tensors = handle.payload
            data = torch.frombuffer(bytearray(self.codec.encode(body)), dtype=torch.uint8)
            rows = tensors[0].shape[0] if tensors else -1
            dist.send(torch.tensor([data.numel(), rows], dtype=torch.int64), self.peer,
                      self.meta_group, self.tag)
            dist.send(data, self.peer, self.meta_group, self.tag + 1)
            for i, t in enumerate(tensors):
                dist.send(t, self.peer, self.tensor_group, self.tag + 2 + i)
            handle.payload = ()
            handle.sent.set()
            self.queue.task_done()

    def flush(self) -> None:
        """Waits until every queued message is on the wire."""
        while self.queue.unfinished_tasks:
            self._raise_if_broken()
            time.sleep(0.002)

    # -- receiving --
    def _recv_loop(self) -> None:
        while True:
            header = torch.empty(2, dtype=torch.int64)
            dist.recv(header, self.peer, self.meta_group, self.tag)
            body_len, rows = header.tolist()
            if not 0 < body_len <= MAX_BODY_BYTES or not -1 <= rows <= MAX_ROWS:
                raise WireError(f"stage {self.peer} sent a malformed header: body of "
                                f"{body_len} bytes, {rows} rows")
            data = torch.empty(body_len, dtype=torch.uint8)
            dist.recv(data, self.peer, self.meta_group, self.tag + 1)
            try:
                body = self.codec.decode(data.numpy().tobytes())
            except WireError as e:
                raise WireError(f"stage {self.peer} sent a malformed message: {e}") from None
            tensors = []
            for i, (width, dtype) in enumerate(self.specs if rows >= 0 else []):
                t = torch.empty(rows, width, dtype=dtype, device=self.device)
                dist.recv(t, self.peer, self.tensor_group, self.tag + 2 + i)
                tensors.append(t)
            self.queue.put((body, tensors))
            if isinstance(body, PipeMessage) and body.control == ("stop",):
                return

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


class Pipe:
    """A stage's channels: activations to/from its neighbours, results last -> first."""

    def __init__(self, rank: int, size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, meta_group=None, pair_groups=None):
        self.rank, self.size = rank, size
        specs = [(hidden_size, dtype), (hidden_size, torch.float32)]

        def channel(peer, tag, outbound, name, tensor_specs=()):
            pair = (min(rank, peer), max(rank, peer))
            tensor_group = pair_groups.get(pair) if pair_groups else None
            body_type = PipeMessage if tag == _FORWARD_TAG else StepResult
            return _Channel(peer, tag, outbound, body_type, tensor_specs, meta_group,
                            tensor_group, device, f"pipefill-{name}")
        last = size - 1
        self.to_next = channel(rank + 1, _FORWARD_TAG, True, "send-next") if rank < last else None
        self.from_prev = channel(rank - 1, _FORWARD_TAG, False, "recv-prev", specs) \
            if rank > 0 else None
        self.results_out = channel(0, _RESULT_TAG, True, "send-result") if rank == last else None
        self.results_in = channel(last, _RESULT_TAG, False, "recv-result") if rank == 0 else None

    def send_forward(self, msg: PipeMessage, acts: Activations | None) -> SendHandle:
        tensors = [] if acts is None else [acts.hidden, acts.residual]
        return self.to_next.send(msg, tensors)

    def recv_forward(self) -> tuple[PipeMessage, Activations | None]:
        msg, tensors = self.from_prev.recv()
        return msg, (Activations(*tensors) if tensors else None)

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
