"""A TP leader's frames reach its peer in one gloo broadcast when they fit the inline slot and in
two when they do not (runtime/tp.FrameBroadcast): two real gloo ranks, every torch.distributed
broadcast counted, frames from a header alone to past the slot, one exactly at its size, an
inline frame after a large one (the slot is not stale); the peer gets the leader's bytes."""
import json
import subprocess
import sys

from pipefill.base.platform import free_port
from pipefill.runtime.p2p import HEADER_BYTES
from pipefill.runtime.tp import INLINE_BYTES

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


def run_pair() -> list[list]:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", PEER, str(r), port, json.dumps(FRAMES)],
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
    leader, peer = run_pair()
    expected_broadcasts = [1 if f[0] <= INLINE_BYTES else 2 for f in FRAMES]
    assert expected_broadcasts == [1, 1, 1, 2, 2, 1]  # the boundary: exactly the slot is inline
    assert [r[0] for r in leader] == expected_broadcasts
    assert [r[0] for r in peer] == expected_broadcasts
    assert [tuple(r[1:5]) for r in peer] == [tuple(f) for f in FRAMES]
    assert all(r[5] for r in peer), "the peer's frame differs from the leader's"
