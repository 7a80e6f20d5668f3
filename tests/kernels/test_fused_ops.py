"""The fused elementwise CPU ops (pipefill.kernels.fused_ops) against their torch references."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pipefill.kernels import fused_ops as fo

from cpu_paths import skip_without_flags

_OK, _WHY = fo.fused_available()
# Skipped where this CPU lacks the least build's flags; where it has them the ops must run.
pytestmark = skip_without_flags("the fused ops", (_OK, _WHY), fo.REQUIRED_CPU_FLAGS)

DTYPES = (torch.bfloat16, torch.float32)
TS = (0, 1, 7, 2048)
EPS = 1e-5


def _variants() -> list[str]:
    if not _OK:
        return ["none"]
    default = fo.kernel_variant()
    out = [v for v in ("avx512", "avx512bf16", "avx2") if fo._select_variant(v)]
    fo._select_variant(default)
    return out


@pytest.fixture(params=_variants())
def variant(request):
    """Runs the test once per kernel build this CPU supports (avx512, avx512bf16, avx2)."""
    default = fo.kernel_variant()
    assert fo._select_variant(request.param)
    yield request.param
    fo._select_variant(default)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between two bf16 tensors (0 for +0 vs -0)."""
    def ordered(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (ordered(a) - ordered(b)).abs()


def assert_matches(out: torch.Tensor, ref: torch.Tensor, *, exact: bool = False) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if exact:  # bit for bit
        if out.dtype == torch.bfloat16:
            out, ref = out.view(torch.int16), ref.view(torch.int16)
        assert torch.equal(out, ref)
        return
    if out.numel() == 0:
        return
    if out.dtype == torch.bfloat16:
        d = ulp_distance(out, ref)
        assert d.max().item() <= 1, f"max {d.max().item()} bf16 ulps"
        if d.numel() >= 10_000:  # a 1-ulp difference needs a near-tie: rare
            assert (d == 0).float().mean().item() > 0.99
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------ add_rms_norm

def norm_case(T, H, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    residual = torch.randn(T, H, generator=g) * 2
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = torch.rand(H, generator=g) + 0.5
    return residual, hidden, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", (64, 576))
@pytest.mark.parametrize("T", TS)
def test_add_rms_norm(variant, T, H, dtype):
    residual, hidden, weight = norm_case(T, H, dtype)
    expected_residual = residual + hidden.float()
    ref = F.rms_norm(expected_residual, (H,), weight, EPS).to(dtype)
    ptr = residual.data_ptr()
    out = fo.add_rms_norm(residual, hidden, weight, EPS)
    assert residual.data_ptr() == ptr
    assert torch.equal(residual, expected_residual)  # updated in place, exactly
    assert out.dtype == dtype and (T == 0 or out.data_ptr() != residual.data_ptr())
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_add(variant, dtype):
    residual, _, weight = norm_case(33, 576, dtype)
    before = residual.clone()
    out = fo.add_rms_norm(residual, None, weight, EPS, dtype=dtype)
    assert torch.equal(residual, before)
    assert_matches(out, F.rms_norm(before, (576,), weight, EPS).to(dtype))
    assert fo.add_rms_norm(residual, None, weight, EPS).dtype == torch.float32


def test_add_rms_norm_out_and_strided_rows(variant):
    T, H = 50, 576
    big = torch.randn(T, H + 64)
    residual = big[:, :H]  # row stride H + 64
    hidden = torch.randn(T, 2 * H).bfloat16()[:, H:]
    weight = torch.rand(H) + 0.5
    out = torch.empty(T, H, dtype=torch.bfloat16)
    expected_residual = residual + hidden.float()
    ref = F.rms_norm(expected_residual, (H,), weight, EPS).bfloat16()
    tail = big[:, H:].clone()
    assert fo.add_rms_norm(residual, hidden, weight, EPS, out=out) is out
    assert torch.equal(residual, expected_residual) and torch.equal(big[:, H:], tail)
    assert_matches(out, ref)


def test_add_rms_norm_large_t(variant):
    residual, hidden, weight = norm_case(100_000, 64, torch.bfloat16, seed=3)
    expected_residual = residual + hidden.float()
    out = fo.add_rms_norm(residual, hidden, weight, EPS)
    assert torch.equal(residual, expected_residual)
    assert_matches(out, F.rms_norm(expected_residual, (64,), weight, EPS).bfloat16())


# ------------------------------------------------------------------------------ rope_

def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope_case(T, N, D, dtype, kv_heads=2, seed=0):
    """A fused qkv matrix [T, (N + kv_heads) * D]; x = its first N heads (a strided view)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (N + kv_heads) * D, generator=g).to(dtype)
    pos = torch.arange(T, dtype=torch.float32) + 1000
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = pos[:, None] * inv[None, :]
    return qkv, freqs.cos(), freqs.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", (16, 64, 128))
@pytest.mark.parametrize("N", (4, 12))
@pytest.mark.parametrize("T", TS)
def test_rope(variant, T, N, D, dtype):
    qkv, cos, sin = rope_case(T, N, D, dtype)
    x = qkv[:, :N * D].view(T, N, D)
    if T > 1:
        assert x.stride(0) != N * D  # a real strided view
    ref = rope_reference(x, cos, sin)
    rest = qkv[:, N * D:].clone()
    assert fo.rope_(x, cos, sin) is x
    assert_matches(x.contiguous(), ref, exact=True)  # same fp32 formula, rounded once
    assert torch.equal(qkv[:, N * D:], rest)  # the v columns are untouched


def test_rope_middle_heads_and_3d_cos(variant):
    # k heads in the middle of a fused qkv matrix; cos/sin shaped [T, 1, D/2].
    T, Hq, Hkv, D = 33, 9, 3, 64
    qkv, cos, sin = rope_case(T, Hq + Hkv, D, torch.bfloat16, kv_heads=Hkv)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    ref = rope_reference(k, cos, sin)
    before = qkv.clone()
    fo.rope_(k, cos[:, None, :].contiguous(), sin[:, None, :].contiguous())
    assert torch.equal(k, ref)
    assert torch.equal(qkv[:, :Hq * D], before[:, :Hq * D])
    assert torch.equal(qkv[:, (Hq + Hkv) * D:], before[:, (Hq + Hkv) * D:])


def test_rope_large_t(variant):
    qkv, cos, sin = rope_case(100_000, 1, 16, torch.bfloat16, kv_heads=1)
    x = qkv[:, :16].view(-1, 1, 16)
    ref = rope_reference(x, cos, sin)
    fo.rope_(x, cos, sin)
    assert torch.equal(x, ref)


# ------------------------------------------------------------------------------ silu_mul

def silu_reference(gu: torch.Tensor) -> torch.Tensor:
    I = gu.shape[1] // 2  # noqa: E741
    return (F.silu(gu[:, :I].float()) * gu[:, I:].float()).to(gu.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("I", (16, 48, 128, 1536))
@pytest.mark.parametrize("T", TS)
def test_silu_mul(variant, T, I, dtype):  # noqa: E741
    g = torch.Generator().manual_seed(T + I)
    gu = (torch.randn(T, 2 * I, generator=g) * 3).to(dtype)
    before = gu.clone()
    out = fo.silu_mul(gu)
    assert out.shape == (T, I) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(gu, before)
    assert_matches(out, silu_reference(gu))


def test_silu_mul_out_and_extremes(variant):
    T, I = 5, 64  # noqa: E741
    gu = torch.randn(T, 2 * I) * 3
    gu[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -90.0, 150.0, -150.0])
    gu[1, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e38])
    for dtype in DTYPES:
        x = gu.to(dtype)
        out = torch.full((T, I), 7.0, dtype=dtype)
        assert fo.silu_mul(x, out=out) is out
        ref = silu_reference(x)
        assert torch.equal(out.isnan(), ref.isnan())
        ok = ~ref.isnan()
        if dtype == torch.bfloat16:
            assert ulp_distance(out[ok], ref[ok]).max().item() <= 1
        else:
            torch.testing.assert_close(out[ok], ref[ok], rtol=1e-6, atol=1e-7)


def test_silu_mul_fp32_accuracy(variant):
    g = torch.linspace(-100, 100, 64_000)
    gu = torch.stack([g.view(-1, 64), torch.ones(1000, 64)], 1).reshape(1000, 128)
    exact = (g.double() / (1 + torch.exp(-g.double()))).view(1000, 64)
    out = fo.silu_mul(gu)
    nz = exact.abs() > 1e-30
    rel = ((out.double() - exact).abs() / exact.abs())[nz]
    assert rel.max().item() < 5e-7


def test_silu_mul_large_t(variant):
    gu = torch.randn(100_000, 32).bfloat16()
    assert_matches(fo.silu_mul(gu), silu_reference(gu))


# ------------------------------------------------------------------------------ threads, errors

@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_across_thread_counts(variant, dtype):
    saved = torch.get_num_threads()
    residual0, hidden, weight = norm_case(2048, 576, dtype, seed=5)
    qkv0, cos, sin = rope_case(2048, 12, 64, dtype, kv_heads=3)
    gu = (torch.randn(2048, 3072) * 3).to(dtype)
    results = []
    try:
        for n in (1, 2, 8):
            torch.set_num_threads(n)
            residual, qkv = residual0.clone(), qkv0.clone()
            normed = fo.add_rms_norm(residual, hidden, weight, EPS)
            fo.rope_(qkv[:, :12 * 64].view(2048, 12, 64), cos, sin)
            results.append((residual, normed, qkv, fo.silu_mul(gu)))
    finally:
        torch.set_num_threads(saved)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


def test_argument_errors():
    w = torch.ones(24)
    with pytest.raises(ValueError, match="multiple of 16"):
        fo.add_rms_norm(torch.zeros(3, 24), torch.zeros(3, 24), w, EPS)
    with pytest.raises(TypeError, match="residual"):
        fo.add_rms_norm(torch.zeros(3, 32).bfloat16(), None, torch.ones(32), EPS)
    with pytest.raises(TypeError, match="weight"):
        fo.add_rms_norm(torch.zeros(3, 32), None, torch.ones(32).bfloat16(), EPS)
    with pytest.raises(ValueError, match="hidden"):
        fo.add_rms_norm(torch.zeros(3, 32), torch.zeros(4, 32), torch.ones(32), EPS)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        fo.add_rms_norm(torch.zeros(3, 32), torch.zeros(3, 32).half(), torch.ones(32), EPS)
    with pytest.raises(ValueError, match="multiple of 16"):
        fo.rope_(torch.zeros(2, 3, 24), torch.zeros(2, 12), torch.zeros(2, 12))
    with pytest.raises(ValueError, match="last dim"):
        fo.rope_(torch.zeros(2, 32, 3).transpose(1, 2), torch.zeros(2, 16), torch.zeros(2, 16))
    with pytest.raises(TypeError, match="cos"):
        fo.rope_(torch.zeros(2, 3, 32), torch.zeros(2, 16).bfloat16(), torch.zeros(2, 16))
    with pytest.raises(ValueError, match="sin"):
        fo.rope_(torch.zeros(2, 3, 32), torch.zeros(2, 16), torch.zeros(3, 16))
    with pytest.raises(ValueError, match="multiple of 32"):
        fo.silu_mul(torch.zeros(2, 40))
    with pytest.raises(ValueError, match="last dim"):
        fo.silu_mul(torch.zeros(64, 2).t())
    with pytest.raises(TypeError, match="out"):
        fo.silu_mul(torch.zeros(2, 64), out=torch.zeros(2, 32).bfloat16())


def test_force_disable():
    assert fo.fused_available(force_disable=True)[0] is False
    assert fo.fused_available() == (_OK, _WHY)


def test_build_failure_reports_unavailable(tmp_path):
    # An unusable compiler and an empty cache: fused_available() says why, never raises.
    env = {**os.environ, "HOME": str(tmp_path), "CXX": "/bin/false"}
    code = ("from pipefill.kernels import fused_ops as f; ok, why = f.fused_available(); "
            "print(ok); print(why)\n"
            "try:\n f.silu_mul(__import__('torch').zeros(1, 32))\n"
            "except RuntimeError as e: print('raised', e)")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "False" and "not usable" in lines[1], r.stdout
    assert lines[2].startswith("raised pipefill fused ops unavailable"), r.stdout


# ------------------------------------------------------------------------------ --hide-cpu-flags

@pytest.mark.parametrize("hide", ["", "avx512_bf16", "avx512vl", "avx512f", "avx512bw,avx512_bf16",
                                  "fma", "avx2", "avx2,avx512f"])
def test_hidden_flags_select_a_smaller_build(hide):
    """flags = usable_cpu_flags(--hide-cpu-flags) picks the best build those flags allow (a CPU
    without a flag never runs a build that needs it), or none: then the engine keeps torch ops."""
    from pipefill.base.platform import usable_cpu_flags
    flags = usable_cpu_flags(hide)
    runnable = _variants()  # the builds cpuid allows here
    want = next((v for v, need in fo.VARIANT_CPU_FLAGS.items()
                 if v in runnable and set(need) <= flags), None)
    default = fo.kernel_variant()
    gu = torch.randn(33, 2 * 64, generator=torch.Generator().manual_seed(1))
    try:
        ok, why = fo.fused_available(flags=flags)
        if want is None:
            assert not ok and "lacks" in why, why
            return
        assert ok, why
        assert fo.kernel_variant() == want
        for need in fo.VARIANT_CPU_FLAGS[fo.kernel_variant()]:
            assert need in flags
        assert_matches(fo.silu_mul(gu), F.silu(gu[:, :64]) * gu[:, 64:])
    finally:
        fo._select_variant(default)
    assert fo.fused_available() == (_OK, _WHY) and fo.kernel_variant() == default
