"""Where a prefill's time goes: linear layers, attention, everything else.

Runs the engine's own stage code (one stage holding every layer, the same chunking) in this
process under torch.profiler, and sorts the operators' self time into the three buckets.
"""
from __future__ import annotations

import time


from pipefill.chunking.policy import ChunkPolicy
from pipefill.chunking.startup import first_chunk_size
from pipefill.config import ServerArgs
from pipefill.kv.pool import PagePool
from pipefill.model.loader import WeightSource
from pipefill.runtime.stage import StageInfo, build_stage
from pipefill.base.plan import NewRequest, SamplingParams
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig

LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul",
              "mkldnn::_linear_pointwise")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "pipefill::amx_attention",
                 "pipefill::cpu_attention")


def prefill_time_split(args: ServerArgs, source: WeightSource, prompt: list[int]) -> dict:
    cfg = source.config
    info = StageInfo(0, 1, range(cfg.num_layers))
    executor = build_stage(args.replace(pp_size=1), source, info)
    pool = PagePool(executor.cache.num_pages)
    sched = Scheduler(SchedulerConfig(args.page_size, args.max_prefill_tokens, 1,
                                      args.max_model_len), pool,
                      ChunkPolicy(first_chunk_size(args)))
    sched.add(NewRequest("split", prompt, SamplingParams(max_new_tokens=1)))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        while (plan := sched.schedule()) is not None:
            acts, _ = executor.forward(plan, None)
            sched.update(plan, executor.results(plan, acts))
        wall = time.perf_counter() - t0
    linear = attention = 0.0
    for ev in prof.key_averages():
        if ev.key in LINEAR_OPS:
            linear += ev.self_cpu_time_total / 1e6
        elif ev.key in ATTENTION_OPS:
            attention += ev.self_cpu_time_total / 1e6
    del executor
    return {"wall_s": wall, "linear_s": linear, "attention_s": attention,
            "other_s": max(0.0, wall - linear - attention)}
