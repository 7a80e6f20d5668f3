"""The shared-memory all-reduce and all-gather (pipefill.comm.shm) between real processes that
share a gloo group: sums against the rank-order reference (bit for bit) and against gloo, every
sum build the CPU runs and both piece paths, bfloat16, calls that span several pieces, ranks
that disagree, a peer that dies mid-call, a sum bound once and called many times (and after
close), and /dev/shm left clean.

Two launches (world 2 and world 3) run every check in their ranks; the tests read the results.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipefill.base.platform import free_port
from pipefill.comm import shm
from pipefill.kernels import shm_comm

_ISAS = [isa for isa in shm_comm.ISAS if shm_comm.isa_status()[isa][0]]
pytestmark = pytest.mark.skipif(not _ISAS, reason="shared-memory all-reduce unavailable: "
                                f"{shm_comm.isa_status()['scalar'][1]}")

MAX_BYTES = 8192  # 2,048 float32 per piece: the sizes below span one and several pieces
SIZES = (0, 1, 7, 1000, 2048, 5003)  # empty, one, odd, one piece (small), one whole, several
TIMEOUT_S = 30.0


def _inputs(n: int, dtype: torch.dtype, world: int, integers: bool = False):
    g = torch.Generator().manual_seed(1000 * n + world)
    if integers:  # every partial sum exact in float32, whatever the order
        return [torch.randint(-1000, 1000, (n,), generator=g).to(dtype) for _ in range(world)]
    return [(torch.randn(n, generator=g) * 10 ** torch.randint(-3, 4, (n,), generator=g))
            .to(dtype) for _ in range(world)]


def _rank_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """What the group computes: float32 sums in rank order, rounded once to the dtype."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def check_sums(rank: int, world: int) -> None:
    """Each sum build x both piece paths (small_max_bytes 0 forces reduce-scatter) x dtype x
    size: bit for bit the rank-order sum, on every rank."""
    for isa in _ISAS:
        for small in (shm.SMALL_MAX_BYTES, 0):
            with shm.ShmGroup(rank, world, "sums", MAX_BYTES, isa=isa, small_max_bytes=small,
                              timeout_s=TIMEOUT_S) as group:
                for dtype in (torch.float32, torch.bfloat16):
                    for n in SIZES:
                        xs = _inputs(n, dtype, world)
                        out = group.all_reduce_(xs[rank].clone())
                        ref = _rank_order_sum(xs)
                        assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16
                                                    else torch.int32),
                                           ref.view(torch.int16 if dtype == torch.bfloat16
                                                    else torch.int32)), (isa, small, dtype, n)


def check_against_gloo(rank: int, world: int) -> None:
    """float32 against gloo's all_reduce: integer values exactly; random values within the
    rounding of a reordered sum of `world` terms, |a - b| <= 2 (world - 1) 2^-24 sum_k |x_k|
    (each order rounds world - 1 times, each rounding off by at most 2^-24 of a partial sum no
    larger than sum_k |x_k|)."""
    with shm.ShmGroup(rank, world, "gloo", MAX_BYTES, timeout_s=TIMEOUT_S) as group:
        for integers in (True, False):
            for n in SIZES:
                xs = _inputs(n, torch.float32, world, integers)
                ours = group.all_reduce_(xs[rank].clone())
                theirs = xs[rank].clone()
                dist.all_reduce(theirs)
                if integers:
                    assert torch.equal(ours, theirs), n
                else:
                    bound = 2 * (world - 1) * 2.0 ** -24 * sum(x.abs() for x in xs)
                    assert bool(((ours - theirs).abs() <= bound).all()), n


def check_all_gather(rank: int, world: int) -> None:
    with shm.ShmGroup(rank, world, "gather", MAX_BYTES, timeout_s=TIMEOUT_S) as group:
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
            for n in SIZES:
                xs = [(torch.arange(n) * (r + 3) + r).to(dtype).reshape(n, 1)
                      for r in range(world)]
                assert torch.equal(group.all_gather(xs[rank]), torch.stack(xs))
        out = torch.empty(world, 3, 5)
        mine = torch.full((3, 5), float(rank))
        assert group.all_gather(mine, out=out) is out
        assert torch.equal(out, torch.arange(world).float().view(world, 1, 1).expand(world, 3, 5))


def check_bound_sums(rank: int, world: int) -> str:
    """bind_all_reduce: the same buffer summed again and again with new contents (one decode
    token's 576 values, and a call of several pieces), bit for bit the rank-order sum; after
    close() the bound call raises a sentence instead of touching the unmapped segment."""
    group = shm.ShmGroup(rank, world, "bound", MAX_BYTES, timeout_s=TIMEOUT_S)
    for dtype in (torch.bfloat16, torch.float32):
        for n in (576, 5003):
            buf = torch.empty(n, dtype=dtype)
            bound = group.bind_all_reduce(buf)
            for call in range(3):
                xs = _inputs(n + call, dtype, world)
                buf.copy_(xs[rank][:n])
                assert bound() is None
                ref = _rank_order_sum([x[:n] for x in xs])
                assert torch.equal(buf.view(torch.int16 if dtype == torch.bfloat16 else
                                            torch.int32),
                                   ref.view(torch.int16 if dtype == torch.bfloat16 else
                                            torch.int32)), (dtype, n, call)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        group.bind_all_reduce(torch.zeros(4, dtype=torch.int32))
    bound = group.bind_all_reduce(torch.zeros(8))
    dist.barrier()
    group.close()
    with pytest.raises(shm.ShmPeerError, match="closed") as e:
        bound()
    return str(e.value)


def check_disagreement(rank: int, world: int) -> list[str]:
    """Rank 0 sums 10 elements, the others 12: every rank raises, then the group stays broken."""
    said = []
    with shm.ShmGroup(rank, world, "disagree", MAX_BYTES, timeout_s=TIMEOUT_S) as group:
        for attempt in range(2):
            try:
                group.all_reduce_(torch.ones(10 if rank == 0 else 12))
            except shm.ShmPeerError as e:
                said.append(str(e))
    return said


def check_unjoinable_rank(rank: int, world: int) -> str:
    """The last rank asks for a sum build that does not exist: every rank raises its reason."""
    try:
        shm.ShmGroup(rank, world, "unjoinable", MAX_BYTES, isa="bogus" if rank == world - 1
                     else None)
    except RuntimeError as e:
        return str(e)
    return "no error"


def check_stuck_peer(rank: int, world: int) -> str:
    """Rank 1 arrives 2 s late at a group that waits 0.5 s: rank 0 raises a timeout. Rank 1
    finds rank 0's data there and completes that call, but its next call raises: rank 0 gave
    up."""
    with shm.ShmGroup(rank, world, "stuck", MAX_BYTES, timeout_s=0.5) as group:
        if rank == 1:
            time.sleep(2)
        try:
            for _ in range(2):
                group.all_reduce_(torch.ones(5))
        except shm.ShmPeerError as e:
            return str(e)
    return "no error"


def check_dead_peer(rank: int, world: int) -> str:
    """The last rank dies (SIGKILL, from a thread) in the middle of a call of many pieces; the
    others must raise instead of waiting for it forever."""
    group = shm.ShmGroup(rank, world, "dead", 4096, timeout_s=TIMEOUT_S)
    x = torch.ones(4 << 20)  # 4,096 pieces of 4 KiB
    group.all_reduce_(torch.ones(8))  # every rank is in the group
    if rank == world - 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        while True:
            group.all_reduce_(x)
    try:
        while True:
            group.all_reduce_(x)
    except shm.ShmPeerError as e:
        return str(e)
    finally:
        group.close()


def check_no_segment_left(rank: int, world: int, pid0: int) -> list[str]:
    """No name from this launch's rank 0 in /dev/shm (other test runs may have their own)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(shm.SEGMENT_PREFIX)
            and f"-{pid0}-" in n]


CHECKS = {"sums": check_sums, "bound": check_bound_sums, "gloo": check_against_gloo,
          "gather": check_all_gather,
          "disagree": check_disagreement, "stuck": check_stuck_peer,
          "unjoinable": check_unjoinable_rank}


def _rank_main(rank: int, world: int, port: int, out_dir: str, dead_peer: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    results = {}
    for name, check in CHECKS.items():
        try:
            results[name] = {"ok": True, "value": check(rank, world)}
        except Exception:  # noqa: BLE001 - reported by the test that reads it
            results[name] = {"ok": False, "value": traceback.format_exc()}
    pid0 = [os.getpid()]
    dist.broadcast_object_list(pid0, group_src=0)
    dist.barrier()
    results["leftover"] = {"ok": True, "value": check_no_segment_left(rank, world, pid0[0])}
    dist.barrier()  # every rank has looked before rank 0 makes the next segment
    _write(out_dir, rank, results)
    if dead_peer:
        try:
            results["dead"] = {"ok": True, "value": check_dead_peer(rank, world)}
        except Exception:  # noqa: BLE001
            results["dead"] = {"ok": False, "value": traceback.format_exc()}
        results["leftover_after_death"] = {
            "ok": True, "value": check_no_segment_left(rank, world, pid0[0])}
        _write(out_dir, rank, results)
    os._exit(0)  # no gloo teardown: a dead peer would make it wait


def _write(out_dir: str, rank: int, results: dict) -> None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)


def _launch(world: int, out_dir, dead_peer: bool) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, str(out_dir), dead_peer))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 240
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = []
    for r in range(world):
        path = out_dir / f"rank{r}.json"
        assert path.exists(), f"rank {r} of {world} wrote no results (exit code {procs[r].exitcode})"
        results.append(json.loads(path.read_text()))
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def ranks(request, tmp_path_factory):
    world = request.param
    return _launch(world, tmp_path_factory.mktemp(f"shm{world}"), dead_peer=world == 3)


def _each_rank(ranks, name):
    for rank, results in enumerate(ranks):
        assert results[name]["ok"], f"rank {rank}:\n{results[name]['value']}"
        yield results[name]["value"]


def test_sums_are_the_rank_order_sum_bit_for_bit(ranks):
    list(_each_rank(ranks, "sums"))


def test_bound_sums_are_the_rank_order_sum_and_refuse_after_close(ranks):
    for sentence in _each_rank(ranks, "bound"):
        assert "this shared-memory group is closed" in sentence


def test_float32_sums_match_gloo(ranks):
    list(_each_rank(ranks, "gloo"))


def test_all_gather(ranks):
    list(_each_rank(ranks, "gather"))


def test_ranks_that_disagree_all_raise_and_the_group_stays_broken(ranks):
    for said in _each_rank(ranks, "disagree"):
        assert len(said) == 2
        assert "ranks disagree on the call" in said[0] and "10 float32 elements" in said[0]
        assert "unusable after an earlier error" in said[1]


def test_a_stuck_peer_times_out_with_a_sentence(ranks):
    said = list(_each_rank(ranks, "stuck"))
    assert "rank 1 (pid" in said[0] and "did not reach barrier" in said[0]
    assert "within 0.5 s" in said[0]
    assert "rank 0" in said[1] and "left the group" in said[1]


def test_a_rank_that_cannot_join_makes_every_rank_raise_its_reason(ranks):
    for said in _each_rank(ranks, "unjoinable"):
        assert "could not be set up" in said and f"rank {len(ranks) - 1}:" in said
        assert "unknown ISA 'bogus'" in said


def test_no_segment_is_left_in_dev_shm(ranks):
    for left in _each_rank(ranks, "leftover"):
        assert left == []


def test_a_peer_that_dies_mid_call_makes_the_others_raise(ranks):
    if len(ranks) != 3:
        pytest.skip("run by the world-3 launch")
    survivors = ranks[:-1]
    for said in _each_rank(survivors, "dead"):
        # The first to notice says the last rank exited; a rank that was waiting for that one
        # may hear first that it gave up.
        assert "exited" in said or "left the group" in said, said
        assert "did not reach" not in said  # found dead, not timed out
    for left in _each_rank(survivors, "leftover_after_death"):
        assert left == []


def test_without_torch_distributed_the_group_says_what_it_needs():
    if dist.is_initialized():
        pytest.skip("this process already has a torch.distributed group")
    with pytest.raises(ValueError, match="needs the ranks' torch.distributed"):
        shm.ShmGroup(0, 1)


def test_stale_segments_of_exited_creators_are_removed(tmp_path):
    gone = mp.get_context("spawn").Process(target=int)
    gone.start()
    gone.join()
    old = time.time() - 2 * shm.STALE_AFTER_S
    names = {"stale": f"pipefill-x-{gone.pid}-ab12", "young": f"pipefill-y-{gone.pid}-cd34",
             "alive": f"pipefill-z-{os.getpid()}-ef56", "foreign": "other-1-2"}
    for key, name in names.items():
        (tmp_path / name).write_bytes(b"")
        if key != "young":
            os.utime(tmp_path / name, (old, old))
    assert shm.remove_stale_segments(str(tmp_path)) == [names["stale"]]
    assert sorted(os.listdir(tmp_path)) == sorted(n for k, n in names.items() if k != "stale")
