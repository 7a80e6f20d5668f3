"""A stage process: `python -m pipefill.runtime.worker`, its arguments (a StageStart) as JSON on
stdin."""
from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
from dataclasses import dataclass

from pipefill.chunking.progress import shape_coefficients
from pipefill.config import DisaggMode, ServerArgs
from pipefill.model.tensor_parallel import choose_head_split
from pipefill.runtime.heartbeat import stage_heartbeat
from pipefill.runtime.ipc import Addresses, StageChannel
from pipefill.runtime.loop import (FirstStageLoop, report_to_first, run_guarded,
                                   run_later_stage)
from pipefill.scheduler.prefill_order import make_prefill_order
from pipefill.scheduler.role import NullRole
from pipefill.base.wire import BodyCodec

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class StageStart:
    """What the parent writes on a stage process's stdin."""
    args: ServerArgs
    model_file: str
    rank: int  # the stage
    addrs: Addresses
    tp_rank: int = 0  # the process's rank inside its stage (tensor parallelism)


def encode_stage_start(args: ServerArgs, model_file: str, rank: int, addrs: Addresses,
                       tp_rank: int = 0) -> bytes:
    return BodyCodec(StageStart, json=True).encode(StageStart(args, model_file, rank, addrs,
                                                              tp_rank))


def decode_stage_start(data: bytes) -> StageStart:
    return BodyCodec(StageStart, json=True).decode(data)


def stage_entry(args: ServerArgs, model_file: str, rank: int, addrs: Addresses,
                tp_rank: int = 0) -> None:
    """Body of a stage process (stage `rank`, TP rank `tp_rank` in it)."""
    from pipefill.runtime.logging_setup import setup_logging
    setup_logging(args.log_level, prefix=process_name(rank, tp_rank))
    # Die with the process that started us: no orphan stage outlives its front end.
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The front end decides when stages stop (a SIGTERM to the whole process group reaches us
    # too); if it dies, PDEATHSIG above ends us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = StageChannel(addrs, read_requests=rank == 0 and tp_rank == 0, rank=rank,
                           node_rank=args.node_rank)
    code = 1
    try:
        code = _run_stage(args, model_file, rank, channel, addrs, tp_rank)
    finally:
        channel.close()
        logging.shutdown()
        # Skip interpreter teardown: receiver threads may sit in a blocking gloo recv.
        os._exit(code)


def process_name(rank: int, tp_rank: int = 0) -> str:
    """How logs and error sentences name a stage process."""
    return f"stage {rank}" + (f" TP rank {tp_rank}" if tp_rank else "")


def init_distributed(args: ServerArgs, rank: int):
    """One torch.distributed group for all stage processes (`rank`: this one's global rank,
    Layout.global_rank); returns (meta_group, pair_groups).

    On CPU both are None (everything on the default gloo group). On CUDA the default group is
    NCCL; metadata goes over a gloo group, and every neighbour pair gets an NCCL group of its
    own, because one NCCL communicator must not serve two threads (a stage sends to its next
    neighbour while it receives from its previous one)."""
    import torch.distributed as dist
    host, _, port = args.dist_init_addr.rpartition(":")
    backend = "nccl" if args.device == "cuda" else "gloo"
    # The rendezvous is bounded (a node that never joins is an error within
    # --dist-init-timeout), but once joined stages wait on their neighbours for as long as the
    # server is idle: no timeout to speak of. A dead peer is noticed by its closed connection
    # (and by the front end's watch).
    startup = datetime.timedelta(seconds=args.dist_init_timeout)
    try:
        store = dist.TCPStore(host, int(port), args.layout.world_size, is_master=rank == 0,
                              timeout=startup, wait_for_workers=True)
    except (RuntimeError, TimeoutError) as e:  # DistStoreError is a RuntimeError
        raise RuntimeError(
            f"not every stage joined the rendezvous at {host}:{port} within "
            f"{args.dist_init_timeout} s (--dist-init-timeout): is every node started and "
            f"able to reach node 0 at that address? ({str(e).splitlines()[0]})") from None
    store.set_timeout(datetime.timedelta(days=30))
    dist.init_process_group(backend, store=store, rank=rank,
                            world_size=args.layout.world_size,
                            timeout=datetime.timedelta(days=30))
    if backend == "nccl":
        meta = dist.new_group(backend="gloo")
        pairs = {(s, s + 1): dist.new_group([s, s + 1], backend="nccl")
                 for s in range(args.pp_size - 1)}  # every rank creates every group, in order
        return meta, pairs
    return None, None


def _run_stage(args: ServerArgs, model_file: str, rank: int, channel: StageChannel,
               addrs: Addresses | None = None, tp_rank: int = 0) -> int:
    import torch

    from pipefill.model.loader import WeightSource
    from pipefill.base.platform import (keep_freed_memory_for_reuse, place_stage,
                                        release_freed_memory, resident_memory, resolve_dtype)
    from pipefill.runtime.trace import StageTracer

    baseline = resident_memory()  # the interpreter, torch, pipefill: before any weight

    name = process_name(rank, tp_rank)
    shared_kv = None  # a TP rank of a PD stage: its KV files (kv/shared.py)
    try:
        layout = args.layout
        place_stage(layout.local_process(rank, tp_rank), layout.processes_per_node,
                    layout.num_threads)
        keep_freed_memory_for_reuse()
        source = WeightSource(model_file, vocabulary=False)  # a stage never tokenizes
        info = layout.stage(rank, tp_rank)
        device = torch.device("cpu")
        if args.device == "cuda":  # one GPU a process, a stage's TP ranks side by side
            layout.check_gpus(torch.cuda.device_count())
            device = torch.device("cuda", layout.gpu_index(rank, tp_rank))
            torch.cuda.set_device(device)
        groups = (init_distributed(args, layout.global_rank(rank, tp_rank))
                  if layout.world_size > 1 else (None, None))
        tp = None
        if layout.tp_size > 1:
            from pipefill.runtime.tp import TPLink
            tp = TPLink(layout, rank, tp_rank, source.config.hidden_size,
                        resolve_dtype(args.dtype), args.hide_cpu_flags, device)
            log.info("%s: TP all-reduce over %s", name, tp.backend)
        if args.disagg.enabled and layout.tp_size > 1:  # the leader moves every rank's KV
            from pipefill.kv.shared import SharedEmpty
            shared_kv = SharedEmpty(f"stage{rank}-tp{tp_rank}",
                                    processes=layout.processes_per_node)
        executor, rank_kv = build_with_shared_kv(args, source, info, device, tp, shared_kv)
        cfg = source.config
        pipe, slices = None, None
        per_rank = args.pp_size > 1 and layout.tp_size > 1 and \
            args.tp_stage_transport == "per_rank"
        if args.pp_size > 1 and info.is_tp_leader:
            from pipefill.runtime.p2p import Pipe
            pipe = Pipe(rank, args.pp_size, cfg.hidden_size, resolve_dtype(args.dtype),
                        device, *groups, tp_share=(0, layout.tp_size) if per_rank else None)
        elif per_rank:
            slices = share_link(layout, info, cfg.hidden_size, resolve_dtype(args.dtype),
                                device)
        role = (make_pd_role(args, executor, info, cfg, pipe, rank_kv) if info.is_tp_leader
                else None)
        del source  # the file reader (GGUF metadata: ~220 MB RSS for the default model)
        release_freed_memory()
        executor.memory = stage_memory_marks(baseline, executor)
    except Exception as e:  # noqa: BLE001 - start-up errors become one sentence
        log.debug("start-up failed", exc_info=True)
        if shared_kv is not None:
            shared_kv.unlink()
        if args.node_rank > 0:  # node 0's front end may be the unreachable part: say it here
            log.error("%s could not start: %s", name, e)
        channel.report("fatal", f"{name} could not start: {e}")
        return 1
    if layout.world_size > 1:
        import torch.distributed as dist
        dist.barrier(group=groups[0])  # every process loaded before stage 0 says ready
    if not info.is_tp_leader:  # runs what its leader shares, nothing else
        from pipefill.runtime.tp import run_tp_peer
        return run_guarded(name, channel, lambda: run_tp_peer(executor, tp, slices))
    executor.tp = tp
    tracer = StageTracer(rank, args.trace_dir is not None)
    heartbeat = stage_heartbeat(addrs.folder if addrs is not None else None, rank)
    executor.model.after_layer = heartbeat.layer_done  # forwards run on this loop thread
    if rank == 0:
        from pipefill.chunking.startup import build_chunk_policy
        policy = build_chunk_policy(args, executor.profile_bench(), model_file, info.layers,
                                    args.layout.layer_counts)
        loop = make_first_stage_loop(args, cfg, executor, channel, pipe, tracer,
                                     policy, role, heartbeat)
        channel.report("ready", {"rank": rank, "num_pages": loop.scheduler.pool.num_pages,
                                 "page_size": args.page_size, "chunking": policy.info})
        return run_guarded(f"stage {rank}", channel, loop.run)
    return run_guarded(f"stage {rank}", channel,
                       lambda: run_later_stage(executor, pipe, channel, tracer, role,
                                               heartbeat))


def share_link(layout, info, hidden_size: int, dtype, device):
    """A TP peer's channels of the per-rank stage transport: to and from the same TP rank of
    the neighbouring stages."""
    from pipefill.runtime.p2p import SliceLink
    prev_peer = layout.global_rank(info.rank - 1, info.tp_rank) if not info.is_first else None
    next_peer = layout.global_rank(info.rank + 1, info.tp_rank) if not info.is_last else None
    return SliceLink(prev_peer, next_peer, info.tp_rank, layout.tp_size, hidden_size, dtype,
                     device)


def build_with_shared_kv(args: ServerArgs, source, info, device, tp, shared_kv):
    """(executor, every rank's (k, v) on a PD stage's TP leader, else None): with shared_kv
    (kv/shared.SharedEmpty) the KV pool lives in files the leader maps (ARCHITECTURE.md, 'KV
    heads across TP sizes')."""
    from pipefill.runtime.stage import build_stage
    if shared_kv is None:
        return build_stage(args, source, info, device, tp), None
    from pipefill.runtime.tp import map_stage_kv
    executor = build_stage(args, source, info, device, tp, kv_empty=shared_kv)
    return executor, map_stage_kv(tp, shared_kv, executor.cache)


def stage_memory_marks(baseline: dict, executor) -> dict:
    """The stage's memory before any weight and once loaded (bytes; base.platform's
    resident_memory), and the bytes of its weight tensors (ARCHITECTURE.md, 'What a stage's
    memory is made of'): reported in its stats, read by the memory benchmarks."""
    from pipefill.base.platform import resident_memory
    return {"baseline": baseline, "loaded": resident_memory(),
            "weights": executor.model.w.tensor_bytes()}


def make_pd_role(args: ServerArgs, executor, info, cfg, pipe, rank_kv=None):
    """The stage's PD disaggregation role (pipefill.scheduler.role): NullRole, or one of
    pipefill.disagg.roles. A later stage's role reports to stage 0 through the pipe. rank_kv:
    under TP, every rank's (k, v), mapped by the leader (runtime/tp.map_stage_kv)."""
    if not args.disagg.enabled:
        return NullRole()
    # Imported here: the transfer plane costs every stage's start-up, and most serve no PD.
    from pipefill.disagg.heads import latent_head_map, tp_head_map
    from pipefill.disagg.roles import DecodeStagePD, PrefillStagePD
    from pipefill.disagg.transfer import StageTensors
    to_first = report_to_first(pipe) if info.rank > 0 else None
    stage_kv = None
    if rank_kv is not None:
        heads = (latent_head_map(args.tp_size) if cfg.mla is not None else
                 tp_head_map(cfg.num_heads, cfg.num_kv_heads, args.tp_size,
                             choose_head_split(cfg, args.tp_size)[0]))
        stage_kv = StageTensors.of_ranks(executor.cache, info.layers.start, rank_kv, heads)
    if args.disagg.mode is DisaggMode.DECODE:
        return DecodeStagePD(args, executor, cfg, info, to_first, stage_kv)
    return PrefillStagePD(args, executor, info.rank, info.layers.start, cfg, to_first,
                          stage_kv)


def make_first_stage_loop(args, cfg, executor, channel, pipe, tracer, policy, role=None,
                          heartbeat=None):
    from pipefill.kv.pool import PagePool
    from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig
    from pipefill.kv.tiers import build_prefix_cache
    from pipefill.kv.window import window_pages_for
    pool = PagePool(executor.cache.num_pages)
    # The sliding-window layers' own pages, where the stages keep them apart
    # (ARCHITECTURE.md, 'Window pages').
    window = window_pages_for(executor.cache, args.page_size, cfg.sliding_window)
    cache = build_prefix_cache(args, pool, executor.kv, args.layout.ranges,
                               window.pool if window is not None else None,
                               [sum(cfg.window_of(i) is not None for i in r)
                                for r in args.layout.ranges])
    scheduler = Scheduler(SchedulerConfig(
        page_size=args.page_size, max_prefill_tokens=args.max_prefill_tokens,
        max_running_requests=args.max_running_requests, max_model_len=args.max_model_len,
        eos_token_ids=cfg.eos_token_ids, seed=args.seed, vocab_size=cfg.vocab_size), pool,
        policy, cache, role,
        make_prefill_order(args.chunking.schedule_policy), window)
    loop = FirstStageLoop(executor, scheduler, channel, pipe, args.layout.max_inflight, tracer,
                          on_result=policy.observe, chunk_policy=policy, heartbeat=heartbeat)
    if args.layer_costs:  # the family's weights per layer (config.resolve)
        loop.progress.prior = shape_coefficients(args.layer_costs, cfg.attention_width)
    return loop
