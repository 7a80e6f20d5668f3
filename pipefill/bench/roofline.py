"""FLOP counts of a prefill and the machine's measured matmul peak, for achieved-TF/s figures;
the deployment planner's description of this CPU from the same measurements."""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from pipefill.base.platform import cpu_name, dtype_name
from pipefill.model.config import ModelConfig
from pipefill.planner.hardware import THIS_CPU, Hardware, Link


def prefill_flops(cfg: ModelConfig, num_tokens: int, prefix_len: int = 0) -> dict[str, float]:
    """Linear layers of every token plus the lm_head of the last one, and causal attention
    (QK^T and PV, 2 FLOPs per multiply-add) of tokens [prefix_len, prefix_len + num_tokens).
    This is the whole model's work, as HF does it; pipefill's last layer skips the attention
    and MLP of rows no logit reads (StageModel.trims), so its TF/s count that work as done."""
    h = cfg.hidden_size
    per_token = sum(2 * (cfg.attention_weights + cfg.mlp_weights(i))
                    for i in range(cfg.num_layers))
    linear = per_token * num_tokens + 2 * h * cfg.vocab_size
    # Query i (absolute position p) sees p + 1 keys.
    end = prefix_len + num_tokens
    keys_seen = (end * (end + 1) - prefix_len * (prefix_len + 1)) / 2
    attention = cfg.num_layers * 2 * cfg.attention_width * keys_seen
    return {"linear": float(linear), "attention": float(attention),
            "total": float(linear + attention),
            "experts": float(expert_flops(cfg, num_tokens * sum(map(cfg.is_sparse,
                                                                     range(cfg.num_layers)))))}


def expert_flops(cfg: ModelConfig, token_layers: int) -> int:
    """FLOPs of the routed experts (gate, up and down of each of top-k) over `token_layers`
    (token, sparse layer) pairs: 0 for a dense model."""
    if cfg.moe is None:
        return 0
    return 2 * cfg.expert_weights * cfg.moe.top_k * token_layers


def matmul_peak_flops(dtype: torch.dtype, seconds: float = 2.0) -> float:
    """Best FLOP/s of plain matmuls (a square one and model-shaped ones) on this process's
    threads, through torch's F.linear and, where it runs, oneDNN with a reordered weight
    (kernels.prefill_gemm: faster than MKL's float32 sgemm on AMD CPUs): the roofline that
    achieved figures are compared against."""
    from pipefill.kernels.prefill_gemm import OneDnnLinear, onednn_status
    shapes = [(2048, 2048, 2048), (4096, 576, 1536), (4096, 1536, 576)]
    onednn = onednn_status()[0] and dtype in (torch.float32, torch.bfloat16)
    best = 0.0
    with torch.inference_mode():
        for m, k, n in shapes:
            a = torch.randn(m, k, dtype=dtype)
            b = torch.randn(n, k, dtype=dtype)
            calls = [lambda: F.linear(a, b)]
            if onednn:
                calls.append(lambda lin=OneDnnLinear.reorder(b, None, m): lin(a))
            for call in calls:
                call()
                deadline = time.perf_counter() + seconds / len(shapes) / len(calls)
                while time.perf_counter() < deadline:
                    t0 = time.perf_counter()
                    call()
                    best = max(best, 2 * m * k * n / (time.perf_counter() - t0))
    return best


def copy_bandwidth(seconds: float = 0.5, num_bytes: int = 256 << 20) -> float:
    """Best bytes/s this process's threads move copying a buffer larger than the caches (a
    copy reads and writes each byte: both count)."""
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best, deadline = 0.0, time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * num_bytes / (time.perf_counter() - t0))
        if time.perf_counter() > deadline:
            return best


def this_cpu(seconds: float = 2.0) -> Hardware:
    """The planner's description of this machine (`pipefill plan --hardware this-cpu`), one
    device per usable core, measured on one thread: the matmul peak per dtype, the copy
    bandwidth, the RAM's share of a core. Stages and TP ranks talk through shared memory:
    a message is a write and a read of that bandwidth, after about 20 microseconds (a spin
    and a gloo header). Its efficiency is 1: the FLOP/s are a measured matmul rate already,
    not a datasheet's; comparing its predictions with measured prefills says how much of it
    a prefill reaches (README, 'Planning a deployment'). A chunk costs a stage 40 ms besides
    its operations: the README's PP1 prefill of 16,384 tokens on one Zen 4 thread took 0.37 s
    longer in 16 chunks than in 8 (an estimate from one sitting each, not a measurement of
    this machine)."""
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops = {dtype_name(d): matmul_peak_flops(d, seconds / 3)
                 for d in (torch.bfloat16, torch.float32)}
        bandwidth = copy_bandwidth(seconds / 3)
    finally:
        torch.set_num_threads(threads)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    shm = Link(bandwidth / 2, 20e-6)
    return Hardware(name=THIS_CPU, flops=flops, memory_bytes=ram / cores,
                    memory_bandwidth=bandwidth, devices_per_node=cores, intra_node=shm,
                    inter_node=shm, efficiency=1.0, chunk_overhead=40e-3,
                    devices_are_cores=True,
                    source=f"{cpu_name()}, measured now on one thread per core")
