"""A TP leader's frames reach its peer in one gloo broadcast when they fit the inline slot and in
two when they do not (runtime/tp.FrameBroadcast): two real gloo ranks, every torch.distributed
broadcast counted, frames from a header alone to past the slot, one exactly at its size, an
inline frame after a large one (the slot is not stale); the peer gets the leader's bytes. A
forward's activations reach the peer inside the frame and as broadcasts after it (the CUDA
path's carrier); which group a stage's sums take (sum_path)."""
import json
import subprocess
import sys

import pytest
import torch

from pipefill.base.platform import free_port
from pipefill.config import ServerArgs
from pipefill.runtime.p2p import HEADER_BYTES
from pipefill.runtime.tp import INLINE_BYTES, sum_path

# (frame bytes, body bytes, rows, kind) as the leader sends them, in order
FRAMES = [(HEADER_BYTES, 0, -1, 2), (1024, 900, -1, 0), (INLINE_BYTES, INLINE_BYTES - 64, -1, 1),
          (INLINE_BYTES + 64, 128, 7, 0), (1 << 20, 4000, 300, 0), (HEADER_BYTES + 64, 10, -1, 4)]

PEER = r"""
import datetime, json, sys
import torch
import torch.distributed as dist

rank, port, frames = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
real, count = dist.broadcast, [0]
def counted(*a, **kw):
    count[0] += 1
    return real(*a, **kw)
dist.broadcast = counted
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2, timeout=datetime.timedelta(seconds=60))
from pipefill.runtime.p2p import HEADER_BYTES
from pipefill.runtime.tp import FrameBroadcast

def content(k, n):  # the frame past its header bytes, as the leader lays it
    return torch.randint(0, 256, (n - HEADER_BYTES,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(k))

link, report = FrameBroadcast(0, None), []
for k, (frame_len, body_len, rows, kind) in enumerate(frames):
    before = count[0]
    if rank == 0:
        frame = link.frame_for(frame_len)
        frame[HEADER_BYTES:] = content(k, frame_len)
        link.send(frame, body_len, rows, kind)
        report.append([count[0] - before])
    else:
        frame, *numbers = link.receive()
        same = bool(torch.equal(frame[HEADER_BYTES:], content(k, frame_len)))
        report.append([count[0] - before, frame.numel(), *numbers, same])
print("REPORT " + json.dumps(report), flush=True)
"""


def run_pair(script: str, arg: str) -> list[list]:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), port, arg],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    reports = []
    try:
        for p in procs:
            out = p.communicate(timeout=60)[0]
            lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
            assert p.returncode == 0 and lines, out
            reports.append(json.loads(lines[-1].removeprefix("REPORT ")))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return reports


def test_inline_frames_take_one_broadcast_and_larger_ones_two():
    leader, peer = run_pair(PEER, json.dumps(FRAMES))
    expected_broadcasts = [1 if f[0] <= INLINE_BYTES else 2 for f in FRAMES]
    assert expected_broadcasts == [1, 1, 1, 2, 2, 1]  # the boundary: exactly the slot is inline
    assert [r[0] for r in leader] == expected_broadcasts
    assert [r[0] for r in peer] == expected_broadcasts
    assert [tuple(r[1:5]) for r in peer] == [tuple(f) for f in FRAMES]
    assert all(r[5] for r in peer), "the peer's frame differs from the leader's"


SHARE = r"""
import datetime, json, os, sys
import torch
import torch.distributed as dist

rank, port, carrier = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2, timeout=datetime.timedelta(seconds=60))
from pipefill.base.plan import StepPlan
from pipefill.config import ServerArgs
from pipefill.runtime.executor import Activations
from pipefill.runtime.tp import OverNccl, TPLink

HIDDEN = 24
link = TPLink(ServerArgs(tp_size=2).layout, 0, rank, HIDDEN, torch.bfloat16)
if carrier == "broadcasts":  # CUDA's carrier, run here on the gloo group and CPU tensors
    link.acts = OverNccl(link.specs, link.leader, link.tensors, torch.device("cpu"))
report = []
for step, rows in enumerate([5, 3000, 1]):  # 3000 rows: past the inline slot
    g = torch.Generator().manual_seed(step)
    hidden = torch.randn(rows, HIDDEN, generator=g)  # float32: the link sends bfloat16
    residual = torch.randn(rows, HIDDEN, generator=g)
    if rank == 0:
        link.share_forward(StepPlan(step, []), Activations(hidden, residual))
    else:
        kind, msg, acts = link.receive()
        report.append([msg.plan.step_id, acts.hidden.dtype == torch.bfloat16,
                       bool(torch.equal(acts.hidden, hidden.bfloat16())),
                       bool(torch.equal(acts.residual, residual))])
if rank == 0:
    link.share_stop()
else:
    report.append(link.receive()[0])
link.barrier()
link.close()
print("REPORT " + json.dumps(report), flush=True)
os._exit(0)  # as a stage process ends (runtime/worker.py): no teardown of the gloo groups
"""


@pytest.mark.parametrize("carrier", ["frame", "broadcasts"])
def test_a_forwards_activations_reach_the_peer_in_either_carrier(carrier):
    """A leader's forward reaches its peer with the plan and the activations' bits (hidden in
    the compute dtype): inside the frame (CPU), or as broadcasts after it (tp.OverNccl, the
    CUDA path's, here on the gloo group: NCCL itself needs GPUs)."""
    peer = run_pair(SHARE, carrier)[1]
    assert peer == [[0, True, True, True], [1, True, True, True], [2, True, True, True], 2]


def test_the_sum_path_is_nccl_on_cuda_gloo_across_nodes_else_shared_memory():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    one_node = ServerArgs(pp_size=2, tp_size=2).layout
    across = ServerArgs(pp_size=1, tp_size=2, nnodes=2, dist_init_addr="h:1").layout
    assert [sum_path(one_node, s, cpu) for s in (0, 1)] == ["shared memory"] * 2
    assert sum_path(across, 0, cpu) == "gloo"
    assert [sum_path(layout, 0, gpu) for layout in (one_node, across)] == ["nccl"] * 2
