"""Gemma's fused ops (pipefill.kernels.fused_ops: rms_norm, norm_add_rms_norm, qk_norm_rope_,
gelu_tanh_mul) against float64 references and against the kernels they fuse, on every kernel
build this CPU runs (avx512, avx512bf16, avx2).

* rms_norm: within float32's rounding of a float64 norm (bf16: 1 ulp), in place too, and the
  bits of add_rms_norm's norm of a float32 row;
* norm_add_rms_norm: the bits of rms_norm (in place) then add_rms_norm, and within rounding
  of the float64 sandwich;
* qk_norm_rope_: the bits of rms_norm per head then rope_, on a strided q/k view of a qkv
  matrix (v untouched), head dims 48 (rope's masked tail), 64 and 256, and close to float64;
* gelu_tanh_mul: within 2e-6 (relative) of float64 g sigmoid(2y) u where the result is not
  tiny, 1 bf16 ulp in bf16, close to torch's F.gelu(approximate="tanh") in float32, inf/NaN
  handled, and the same bits at any thread count.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import test_fused_ops as base
from pipefill.kernels import fused_ops as fo
from test_fused_ops import (DTYPES, EPS, assert_matches, norm_case, rope_case, rope_reference,
                            ulp_distance)

pytestmark = base.pytestmark


@pytest.fixture(params=base._variants())
def variant(request):
    """Runs the test once per kernel build this CPU supports (avx512, avx512bf16, avx2)."""
    default = fo.kernel_variant()
    assert fo._select_variant(request.param)
    yield request.param
    fo._select_variant(default)


def norm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 RMSNorm of x's last dim, rounded once to x's dtype."""
    xd = x.double()
    scale = torch.rsqrt(xd.square().mean(-1, keepdim=True) + EPS)
    return (xd * scale * weight.double()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", (64, 640))
@pytest.mark.parametrize("T", (0, 1, 7, 300))
def test_rms_norm(variant, T, H, dtype):
    g = torch.Generator().manual_seed(T + H)
    x = (torch.randn(T, H, generator=g) * 3).to(dtype)
    weight = torch.rand(H, generator=g) + 0.5
    before = x.clone()
    out = fo.rms_norm(x, weight, EPS)
    assert torch.equal(x, before) and out.dtype == dtype
    assert_matches(out, norm_reference(x, weight))
    assert fo.rms_norm(x, weight, EPS, out=x) is x  # in place: the same bits
    assert torch.equal(x, out)


def test_rms_norm_of_float32_rows_is_add_rms_norms_norm(variant):
    residual, _, weight = norm_case(33, 640, torch.float32)
    assert torch.equal(fo.rms_norm(residual, weight, EPS),
                       fo.add_rms_norm(residual, None, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", (1, 9, 300))
def test_norm_add_rms_norm(variant, T, dtype):
    residual, hidden, weight = norm_case(T, 640, dtype, seed=T)
    post = torch.rand(640) + 0.5
    res_a, hid_a = residual.clone(), hidden.clone()
    out_a = fo.norm_add_rms_norm(res_a, hid_a, post, weight, EPS)
    res_b, hid_b = residual.clone(), hidden.clone()
    fo.rms_norm(hid_b, post, EPS, out=hid_b)
    out_b = fo.add_rms_norm(res_b, hid_b, weight, EPS)
    for a, b in ((out_a, out_b), (res_a, res_b), (hid_a, hid_b)):
        assert_matches(a, b, exact=True)
    assert_matches(hid_a, norm_reference(hidden, post))
    assert torch.equal(res_a, residual + hid_a.float())
    assert_matches(out_a, norm_reference(res_a, weight).to(dtype))


def qk_reference(qk: torch.Tensor, num_q: int, wq, wk, cos, sin) -> torch.Tensor:
    """Per-head float64 norm rounded to qk's dtype, then rope_reference (float32, rounded)."""
    normed = torch.cat([norm_reference(qk[:, :num_q], wq), norm_reference(qk[:, num_q:], wk)], 1)
    return rope_reference(normed, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", (48, 64, 256))
@pytest.mark.parametrize("T", (0, 1, 5))
def test_qk_norm_rope(variant, T, D, dtype):
    num_q, num_k = 4, 1
    qkv, cos, sin = rope_case(T, num_q + num_k, D, dtype, kv_heads=1, seed=D)
    g = torch.Generator().manual_seed(D)
    wq, wk = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    qk = qkv[:, :(num_q + num_k) * D].view(T, num_q + num_k, D)
    before, v = qk.clone(), qkv[:, (num_q + num_k) * D:].clone()
    # The kernels it fuses, on a copy: rms_norm of each head, then rope_ of all.
    fused = qk.clone()
    for heads, w in ((slice(0, num_q), wq), (slice(num_q, num_q + num_k), wk)):
        rows = fused[:, heads].reshape(-1, D)
        fused[:, heads] = fo.rms_norm(rows, w, EPS).view(T, heads.stop - heads.start, D)
    fo.rope_(fused, cos, sin)
    assert fo.qk_norm_rope_(qk, num_q, wq, wk, EPS, cos, sin) is qk
    assert_matches(qk.contiguous(), fused, exact=True)
    assert torch.equal(qkv[:, (num_q + num_k) * D:], v)  # v untouched
    if T and dtype == torch.float32:
        ref = qk_reference(before.double(), num_q, wq, wk, cos, sin).float()
        torch.testing.assert_close(qk, ref, rtol=1e-5, atol=1e-5)


def gelu_reference(gu: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(g) * u in float64 as g * sigmoid(2y) * u (no cancellation for negative g)."""
    inter = gu.shape[1] // 2
    g, u = gu[:, :inter].double(), gu[:, inter:].double()
    y = math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)
    return g * torch.sigmoid(2 * y) * u


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter", [(0, 16), (1, 48), (7, 160), (3, 2048)])
def test_gelu_tanh_mul(variant, T, inter, dtype):
    g = torch.Generator().manual_seed(T + inter)
    gu = (torch.randn(T, 2 * inter, generator=g) * 3).to(dtype)
    before = gu.clone()
    out = fo.gelu_tanh_mul(gu)
    assert out.shape == (T, inter) and out.dtype == dtype and torch.equal(gu, before)
    if dtype == torch.float32:  # see the accuracy test for the bound
        torch.testing.assert_close(out, gelu_reference(gu).float(), rtol=5e-6, atol=1e-6)
    else:
        assert_matches(out, gelu_reference(gu).to(dtype))


def test_gelu_tanh_mul_fp32_accuracy_and_torch(variant):
    g = torch.linspace(-12, 12, 64_000)
    gu = torch.stack([g.view(-1, 64), torch.ones(1000, 64)], 1).reshape(1000, 128)
    exact = gelu_reference(gu)
    out = fo.gelu_tanh_mul(gu).double()
    big = exact.abs() > 1e-30
    # z = 2y rounds with |z| x 2^-24 relative, which exp multiplies: the far tail drifts most.
    near = big & (g.view(1000, 64).abs() <= 5)
    rel = (out - exact).abs() / exact.abs().clamp_min(1e-300)
    assert rel[near].max().item() < 2e-6 and rel[big].max().item() < 2e-5
    ours_vs_torch = (out - F.gelu(g, approximate="tanh").view(1000, 64).double()).abs()
    assert ours_vs_torch.max().item() < 1e-5  # torch's 1 + tanh loses bits for g < 0


def test_gelu_tanh_mul_out_and_extremes(variant):
    gu = torch.randn(4, 64) * 3
    gu[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -90.0, 150.0, -150.0])
    gu[1, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e38])
    for dtype in DTYPES:
        x = gu.to(dtype)
        out = torch.full((4, 32), 7.0, dtype=dtype)
        assert fo.gelu_tanh_mul(x, out=out) is out
        ref = gelu_reference(x).to(dtype)  # gelu(-inf): NaN, as torch's
        assert torch.equal(out.isnan(), ref.isnan())
        ok = ~ref.isnan()
        if dtype == torch.bfloat16:
            assert ulp_distance(out[ok], ref[ok]).max().item() <= 1
        else:
            torch.testing.assert_close(out[ok], ref[ok], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_across_thread_counts(variant, dtype):
    saved = torch.get_num_threads()
    residual0, hidden0, weight = norm_case(512, 640, dtype, seed=5)
    qkv0, cos, sin = rope_case(512, 5, 256, dtype, kv_heads=1)
    w256 = torch.rand(256) + 0.5
    gu = (torch.randn(512, 4096) * 3).to(dtype)
    results = []
    try:
        for n in (1, 2, 8):
            torch.set_num_threads(n)
            residual, hidden, qkv = residual0.clone(), hidden0.clone(), qkv0.clone()
            normed = fo.norm_add_rms_norm(residual, hidden, weight, weight, EPS)
            fo.qk_norm_rope_(qkv[:, :5 * 256].view(512, 5, 256), 4, w256, w256, EPS, cos, sin)
            results.append((residual, hidden, normed, qkv, fo.gelu_tanh_mul(gu)))
    finally:
        torch.set_num_threads(saved)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_matches(a, b, exact=True)


def test_argument_errors():
    if not fo.fused_available()[0]:
        pytest.skip("fused ops unavailable")
    x, w = torch.randn(2, 64), torch.rand(64)
    with pytest.raises(TypeError, match="weight: expected contiguous float32"):
        fo.rms_norm(x, w.double(), EPS)
    with pytest.raises(TypeError, match="out: expected torch.float32"):
        fo.rms_norm(x, w, EPS, out=torch.empty(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must be a multiple of 16"):
        fo.rms_norm(torch.randn(2, 40), torch.rand(40), EPS)
    with pytest.raises(TypeError, match="hidden_weight: expected contiguous float32 \\[64\\]"):
        fo.norm_add_rms_norm(x.clone(), x.clone(), torch.rand(32), w, EPS)
    qk = torch.randn(2, 3, 64)
    with pytest.raises(ValueError, match="num_q_heads 4 outside"):
        fo.qk_norm_rope_(qk, 4, w, w, EPS, torch.randn(2, 32), torch.randn(2, 32))
    with pytest.raises(ValueError, match="cos: expected \\[2, 32\\]"):
        fo.qk_norm_rope_(qk, 2, w, w, EPS, torch.randn(3, 32), torch.randn(2, 32))
    with pytest.raises(ValueError, match="width 2I must be a multiple of 32"):
        fo.gelu_tanh_mul(torch.randn(2, 48))
