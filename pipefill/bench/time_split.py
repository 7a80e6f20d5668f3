"""Where a prefill's time goes: linear layers, attention, everything else.

Runs the engine's own stage code (one stage holding every layer, the same chunking) in this
process under torch.profiler, and sorts the operators' self time into the three buckets.
"""
from __future__ import annotations

import time


from pipefill.bench.roofline import expert_flops
from pipefill.chunking.policy import ChunkPolicy
from pipefill.chunking.startup import first_chunk_size
from pipefill.config import ServerArgs
from pipefill.kv.pool import PagePool
from pipefill.kv.window import window_pages_for
from pipefill.model.loader import WeightSource
from pipefill.model.moe import EXPERTS_RANGE
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
                      ChunkPolicy(first_chunk_size(args)),
                      window=window_pages_for(executor.cache, args.page_size,
                                              cfg.sliding_window))
    sched.add(NewRequest("split", prompt, SamplingParams(max_new_tokens=1)))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        while (plan := sched.schedule()) is not None:
            acts, _ = executor.forward(plan, None)
            sched.update(plan, executor.results(plan, acts))
        wall = time.perf_counter() - t0
    linear = attention = experts = 0.0
    for ev in prof.key_averages():
        if ev.key in LINEAR_OPS:
            linear += ev.self_cpu_time_total / 1e6
        elif ev.key in ATTENTION_OPS:
            attention += ev.self_cpu_time_total / 1e6
        elif ev.key == EXPERTS_RANGE:  # a range around the experts, their GEMMs included
            experts += ev.cpu_time_total / 1e6
    split = {"wall_s": wall, "linear_s": linear, "attention_s": attention,
             "other_s": max(0.0, wall - linear - attention)}
    if cfg.moe is not None:
        split["experts_s"] = experts
        split["expert_flops"] = expert_flops(cfg, expert_token_layers(executor.model,
                                                                      len(prompt)))
    del executor
    return split


def expert_token_layers(model, num_tokens: int) -> int:
    """(token, sparse layer) pairs a prefill of num_tokens routes on a single stage: every
    token in every sparse layer, but the last layer's last row only where it trims
    (StageModel.trims: the rows no logit reads skip its MLP)."""
    cfg, last = model.cfg, model.layer_start + model.num_layers - 1
    sparse = [i for i in range(model.layer_start, last + 1) if cfg.is_sparse(i)]
    trimmed = model.kv_writer is not None and cfg.is_sparse(last)
    return num_tokens * len(sparse) - (num_tokens - 1 if trimmed else 0)
