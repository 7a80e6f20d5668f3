"""The fused elementwise ops against the engine's eager torch code, ms per call (median), on
SmolLM2-135M shapes: `python -m pipefill.bench.fused_ops`."""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from pipefill.kernels.fused_ops import (add_rms_norm, fused_available, kernel_variant, rope_,
                                        silu_mul)
from pipefill.model.rope import apply_rope_


def _time_ms(fn, reps: int) -> float:
    fn()
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return 1e3 * ts[len(ts) // 2]


def bench(T: int = 2048, threads: tuple[int, ...] = (1, 2), reps: int = 30) -> list[tuple]:
    """ms per call (median) of the engine's eager torch code vs the fused ops, SmolLM2-135M
    shapes (H 576, 9 q / 3 kv heads of 64, I 1536), bf16. Prints and returns the rows."""
    ok, why = fused_available()
    if not ok:
        raise RuntimeError(f"fused ops unavailable: {why}")
    H, Hq, Hkv, D, I, eps = 576, 9, 3, 64, 1536, 1e-5  # noqa: E741
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(bf)
    freqs = torch.arange(T, dtype=torch.float32)[:, None] * torch.rand(D // 2, generator=g)
    cos32, sin32 = freqs.cos().contiguous(), freqs.sin().contiguous()
    cos16, sin16 = cos32.to(bf)[:, None, :], sin32.to(bf)[:, None, :]
    gu = torch.randn(T, 2 * I, generator=g).to(bf)
    out_silu = torch.empty(T, I, dtype=bf)
    residual = torch.randn(T, H, generator=g)
    hidden = (0.01 * torch.randn(T, H, generator=g)).to(bf)
    w = torch.rand(H, generator=g) + 0.5

    def rope_torch():
        apply_rope_(qkv[:, :Hq * D].view(T, Hq, D), cos16, sin16)
        apply_rope_(qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D), cos16, sin16)

    def rope_fused():
        rope_(qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), cos32, sin32)

    cases = [
        ("rope q+k (bf16)", rope_torch, rope_fused),
        ("silu*mul (bf16)", lambda: F.silu(gu[:, :I]).mul_(gu[:, I:]), lambda: silu_mul(gu)),
        ("silu*mul out=", None, lambda: silu_mul(gu, out=out_silu)),
        ("add+rms_norm", lambda: F.rms_norm(residual.add_(hidden), (H,), w, eps).to(bf),
         lambda: add_rms_norm(residual, hidden, w, eps)),
    ]
    rows = []
    saved = torch.get_num_threads()
    try:
        print(f"T={T}, SmolLM2-135M shapes, kernels {kernel_variant()}, "
              f"ms per call (median of {reps})")
        print(f"{'op':18s} {'thr':>3s} {'torch':>8s} {'fused':>8s} {'speedup':>8s}")
        for n in threads:
            torch.set_num_threads(n)
            for name, ref, ours in cases:
                t_ref = _time_ms(ref, reps) if ref else float("nan")
                t_ours = _time_ms(ours, reps)
                rows.append((name, n, t_ref, t_ours))
                if ref:
                    print(f"{name:18s} {n:3d} {t_ref:8.3f} {t_ours:8.3f} {t_ref / t_ours:7.2f}x")
                else:
                    print(f"{name:18s} {n:3d} {'-':>8s} {t_ours:8.3f}")
    finally:
        torch.set_num_threads(saved)
    return rows


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    t0 = time.perf_counter()
    print("fused_available:", fused_available(), f"({time.perf_counter() - t0:.2f} s)")
    bench()
