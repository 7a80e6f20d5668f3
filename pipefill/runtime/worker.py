"""A stage process: `python -m pipefill.runtime.worker`, its arguments pickled on stdin."""
from __future__ import annotations

import logging
import pickle
import signal
import sys

from pipefill.config import ServerArgs
from pipefill.runtime.ipc import Addresses, StageChannel

log = logging.getLogger(__name__)


def stage_entry(args: ServerArgs, model_file: str, rank: int, addrs: Addresses) -> None:
    """Body of a stage process."""
    from pipefill.runtime.logging_setup import setup_logging
    setup_logging(args.log_level, prefix=f"stage {rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    channel = StageChannel(addrs, read_requests=rank == 0)
    code = 1
    try:
        code = _run_stage(args, model_file, rank, channel)
    finally:
        channel.close()
        sys.exit(code)


def _run_stage(args: ServerArgs, model_file: str, rank: int, channel: StageChannel) -> int:
    from pipefill.kv.pool import PagePool
    from pipefill.model.loader import WeightSource
    from pipefill.runtime.loop import FirstStageLoop, run_guarded
    from pipefill.runtime.platform import place_stage
    from pipefill.runtime.stage import build_stage, stage_info
    from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig

    try:
        place_stage(rank, args.pp_size, args.num_threads)
        source = WeightSource(model_file)
        cfg = source.config
        info = stage_info(args, cfg.num_layers, rank)
        executor = build_stage(args, source, info)
    except Exception as e:  # noqa: BLE001 - start-up errors become one sentence
        log.debug("start-up failed", exc_info=True)
        channel.report("fatal", f"stage {rank} could not start: {e}")
        return 1
    pool = PagePool(executor.cache.k.shape[1] // args.page_size)
    scheduler = Scheduler(SchedulerConfig(
        page_size=args.page_size, chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        max_running_requests=args.max_running_requests, max_model_len=args.max_model_len,
        eos_token_ids=cfg.eos_token_ids, seed=args.seed), pool)
    loop = FirstStageLoop(executor, scheduler, channel)
    channel.report("ready", {"rank": rank, "num_pages": pool.num_pages,
                             "page_size": args.page_size})
    return run_guarded(f"stage {rank}", channel, loop.run)



if __name__ == "__main__":
    stage_entry(*pickle.loads(sys.stdin.buffer.read()))
