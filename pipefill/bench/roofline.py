"""FLOP counts of a prefill and the machine's measured matmul peak, for achieved-TF/s figures."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from pipefill.model.config import ModelConfig


def prefill_flops(cfg: ModelConfig, num_tokens: int, prefix_len: int = 0) -> dict[str, float]:
    """Linear layers of every token plus the lm_head of the last one, and causal attention
    (QK^T and PV, 2 FLOPs per multiply-add) of tokens [prefix_len, prefix_len + num_tokens).
    This is the whole model's work, as HF does it; pipefill's last layer skips the attention
    and MLP of rows no logit reads (StageModel.trims), so its TF/s count that work as done."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    projections = (h * (q + 2 * kv) + q * h if cfg.mla is None
                   else cfg.mla.projection_weights(h, cfg.num_heads))
    per_token = sum(2 * (projections + mlp_weights(cfg, i)) for i in range(cfg.num_layers))
    linear = per_token * num_tokens + 2 * h * cfg.vocab_size
    # Query i (absolute position p) sees p + 1 keys.
    end = prefix_len + num_tokens
    keys_seen = (end * (end + 1) - prefix_len * (prefix_len + 1)) / 2
    attention = cfg.num_layers * 2 * cfg.attention_width * keys_seen
    return {"linear": float(linear), "attention": float(attention),
            "total": float(linear + attention),
            "experts": float(expert_flops(cfg, num_tokens * sum(map(cfg.is_sparse,
                                                                     range(cfg.num_layers)))))}


def mlp_weights(cfg: ModelConfig, layer: int) -> int:
    """Weights one token multiplies by in a layer's MLP: the dense SwiGLU, or a sparse layer's
    router, its top-k routed experts and the shared expert."""
    h, moe = cfg.hidden_size, cfg.moe
    if not cfg.is_sparse(layer):
        return 3 * h * cfg.intermediate_size
    return h * (moe.num_experts + 3 * moe.top_k * moe.expert_width + 3 * moe.shared_width)


def expert_flops(cfg: ModelConfig, token_layers: int) -> int:
    """FLOPs of the routed experts (gate, up and down of each of top-k) over `token_layers`
    (token, sparse layer) pairs: 0 for a dense model."""
    if cfg.moe is None:
        return 0
    return 2 * 3 * cfg.hidden_size * cfg.moe.expert_width * cfg.moe.top_k * token_layers


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
