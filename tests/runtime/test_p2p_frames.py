"""The stage-to-stage link sends one frame per message: two real gloo ranks exchange
micro-batches (hidden in bfloat16, residual in float32, rows from 0 to past the first slot)
and results, with every torch.distributed send counted by tag. A message is one send; a
frame larger than the slot it lands in costs one more, only until the receiver's slots have
grown; results queued together go as one send; the tensors arrive bit for bit, with the
model's width and dtype; receives stay posted ahead."""
import json
import subprocess
import sys

from pipefill.base.platform import free_port
from pipefill.runtime import p2p

HIDDEN = 64
# Rows per micro-batch: small ones fit the first slots (1 MiB), the 5,000-row ones do not
# (5,000 x 64 x (2 + 4) bytes), so the first RECV_AHEAD of those spill and the rest do not.
ROWS = [3, 0, 40, 5000, 5000, 5000, 5000, 5000, 5000, 7]
NUM_RESULTS = 5

PEER = r"""
import collections, datetime, json, os, sys, threading
import torch
import torch.distributed as dist

rank, port = int(sys.argv[1]), sys.argv[2]
ROWS, HIDDEN, NUM_RESULTS = json.loads(sys.argv[3])
sends = collections.Counter()  # tag -> sends
held, entered = threading.Event(), threading.Event()

def counted(real):
    def send(tensor, dst=None, group=None, tag=0, **kw):
        sends[str(tag)] += 1
        if tag == 200 and sends["200"] == 1:  # the first result waits: the rest queue meanwhile
            entered.set()
            held.wait(60)
        return real(tensor, dst, group, tag, **kw)
    return send

dist.send, dist.isend = counted(dist.send), counted(dist.isend)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2, timeout=datetime.timedelta(seconds=60))
from pipefill.base.plan import PipeMessage, StepResult
from pipefill.runtime.executor import Activations
from pipefill.runtime.p2p import Pipe

def acts(k, rows):
    g = torch.Generator().manual_seed(k)
    return Activations(torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16),
                       torch.randn(rows, HIDDEN, generator=g))

pipe = Pipe(rank, 2, HIDDEN, torch.bfloat16, torch.device("cpu"))
report = {}
if rank == 0:
    for k, rows in enumerate(ROWS):
        pipe.send_forward(PipeMessage(None, stage_seconds=[float(k)]), acts(k, rows))
    pipe.send_forward(PipeMessage(None, control=("stats",)), None)
    pipe.flush()
    results = []
    while len(results) < NUM_RESULTS:
        results.append(pipe.recv_result().step_id)
    report["results"] = results
else:
    same = []
    for k, rows in enumerate(ROWS):
        msg, got = pipe.recv_forward()
        want = acts(k, rows)
        same.append(msg.stage_seconds == [float(k)] and got.hidden.dtype == torch.bfloat16
                    and got.residual.dtype == torch.float32
                    and torch.equal(got.hidden, want.hidden)
                    and torch.equal(got.residual, want.residual))
    msg, got = pipe.recv_forward()
    report.update(same=same, control=list(msg.control), control_acts=got is None,
                  posted_ahead=len(pipe.from_prev._posted))
    pipe.send_result(StepResult(0))
    entered.wait(60)
    for step in range(1, NUM_RESULTS):
        pipe.send_result(StepResult(step))
    held.set()
    pipe.flush()
dist.barrier()
print("REPORT " + json.dumps({"sends": sends, **report}), flush=True)
os._exit(0)
"""


def run_pair() -> list[dict]:
    port = str(free_port())
    spec = json.dumps([ROWS, HIDDEN, NUM_RESULTS])
    procs = [subprocess.Popen([sys.executable, "-c", PEER, str(r), port, spec],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    reports = []
    try:
        for p in procs:
            out = p.communicate(timeout=120)[0]
            lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
            assert p.returncode == 0 and lines, out
            reports.append(json.loads(lines[-1].removeprefix("REPORT ")))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return reports


def test_one_send_per_message_and_results_batched():
    first, last = run_pair()
    num_messages = len(ROWS) + 1  # and the control message
    # Forward: one frame send per message, plus one per frame its slot could not hold.
    assert first["sends"].get("100") == num_messages, first
    assert first["sends"].get("101") == p2p.RECV_AHEAD, first
    assert set(first["sends"]) == {"100", "101"}, first  # nothing else went on the wire
    assert last["same"] == [True] * len(ROWS)
    assert last["control"] == ["stats"] and last["control_acts"]
    assert last["posted_ahead"] == p2p.RECV_AHEAD
    # Results: the first alone (its send was held), the other four queued meanwhile: one send.
    assert last["sends"] == {"200": 2}, last
    assert first["results"] == list(range(NUM_RESULTS))


def test_row_shares_cover_every_row_once_in_rank_order():
    """The per-rank stage transport's shares: each row once, in order, at most one short
    share then empty ones, so padding each to the first's length and gathering in rank order
    gives the rows back."""
    from pipefill.runtime.p2p import row_share
    for rows in (0, 1, 2, 5, 37, 4097):
        for size in (1, 2, 3, 4):
            shares = [row_share(rows, r, size) for r in range(size)]
            assert [i for s in shares for i in s] == list(range(rows))
            assert all(len(s) == -(-rows // size) for s in shares if s.stop < rows)
