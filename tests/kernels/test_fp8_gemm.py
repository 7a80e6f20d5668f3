"""FP8 e4m3 weights with 128 x 128 block scales kept quantized (kernels.fp8_blocks,
kernels.quant_gemm.QuantLinear.from_fp8): every path this CPU runs (AVX-512, AVX2 + F16C,
scalar; those needing flags this CPU lacks skipped, cpu_paths.py) and the torch path, against torch's own
``weight.to(float32) * scale``.

Tolerance: every path's weights are torch's float32 values bit for bit (checked below with
one-hot activations and on the dequantized copies), so the GEMM differs from the float64 sum
over those weights by float32 summation only: at most about K * 2^-24 * sum_k |x_k w_k| (the
recursive-summation bound; we allow 2x). A bf16 output adds half a bf16 ulp (2^-8 relative).
Shapes: K and N not multiples of 128 (the last block of a row and of the grid partial), K not
a multiple of 32 (the kernels' step), K below 32, M around the row tiles (8 on AVX-512, 4 on
AVX2).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipefill.kernels import fp8_blocks
from pipefill.kernels import quant_gemm as qg

from cpu_paths import need

PATHS = ["avx512", "avx2", "scalar", "torch"]
# (M, K, N)
SHAPES = [(1, 300, 257), (2, 128, 129), (3, 31, 5), (4, 1000, 3), (5, 129, 130), (8, 256, 7),
          (9, 200, 9), (17, 77, 11), (33, 384, 5)]
NAN_CODES = (0x7F, 0xFF)


def codes(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random e4m3 codes [n, k] of every finite value (subnormals and zeros included)."""
    g = torch.Generator().manual_seed(seed + 7 * n + k)
    raw = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32)
    raw = torch.where((raw & 0x7F) == 0x7F, raw - 1, raw)  # no NaN code
    return raw.to(torch.uint8).view(torch.float8_e4m3fn)


def scales(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Scales of many magnitudes and full mantissas (products that round)."""
    g = torch.Generator().manual_seed(seed + 1000 + n + k)
    shape = fp8_blocks.grid_shape(n, k)
    return torch.rand(shape, generator=g) * 10.0 ** torch.randint(-5, 0, shape, generator=g)


def linear_on(path: str, parts, k: int, bias=None) -> qg.QuantLinear:
    if path != "torch":
        need(path, qg.fp8_isa_status()[path], qg.FP8_CPU_FLAGS[path])
    lin = qg.QuantLinear.from_fp8(parts, k, bias, max_rows=64,
                                  disable=tuple(i for i in qg.ISAS if i != path))
    assert lin.isa == path and lin.types == "FP8_E4M3"
    return lin


def weights(parts) -> torch.Tensor:
    """torch's float32 weights: the reference every path must hold."""
    return torch.cat([w.float() * fp8_blocks.expand(s, w.shape[1],
                                                    torch.arange(w.shape[0]) // 128)
                      for w, s in parts])


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T + (0 if bias is None else bias.double())
    bound = 2 * x.shape[1] * 2.0 ** -24 * (xd.abs() @ wd.abs().T) + 1e-30
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * ref.abs()
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst ratio {(err / bound).max()}"


def test_reference_is_torchs_float8():
    """fp8_blocks.dequantize is torch's widening times the block's scale, for all 256 codes
    (NaN at 0x7f/0xff), and quantize round-trips within e4m3's half ulp (2^-4 relative)."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 256)
    scale = torch.tensor([[0.5, 3.0]])
    got = fp8_blocks.dequantize(every, scale)
    want = every.view(torch.float8_e4m3fn).float() * torch.tensor([0.5] * 128 + [3.0] * 128)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan()[0, list(NAN_CODES)].all()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    w = torch.randn(130, 300) * torch.linspace(0.01, 2, 300)
    q, s = fp8_blocks.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    back = fp8_blocks.dequantize(q, s)
    assert ((back - w).abs() <= 2.0 ** -4 * w.abs() + 2.0 ** -9 * s.max()).all()


@pytest.mark.parametrize("path", PATHS)
def test_every_path_holds_torchs_weights(path):
    """One-hot rows of x pick single weights out of the decode GEMM (w x 1 plus zeros: no
    rounding): every finite code at every position of a row, two partial blocks; so are the
    prefill copies (float32, and bf16 rounded to nearest even)."""
    k, n = 300, 130
    parts = [(codes(n, k), scales(n, k))]
    w = weights(parts)
    lin = linear_on(path, parts, k)
    eye = torch.eye(k)
    for k0 in range(0, k, 40):
        assert torch.equal(lin(eye[k0:k0 + 40]), w[:, k0:k0 + 40].T), k0
    assert torch.equal(lin.dequantize(torch.float32), w)
    assert torch.equal(lin.dequantize(torch.bfloat16), w.bfloat16())


@pytest.mark.parametrize("path", PATHS)
def test_gemm_against_float64(path):
    for m, k, n in SHAPES:
        parts = [(codes(n, k, m), scales(n, k, m))]
        lin = linear_on(path, parts, k)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)).to(dtype)
            y = lin(x)
            assert y.dtype == dtype and y.shape == (m, n)
            assert_close(y, x, weights(parts))


@pytest.mark.parametrize("path", PATHS)
def test_stacked_reordered_bias_and_bind(path):
    """q/k/v-like stacking of matrices whose rows are not multiples of 128 (each row keeps
    its own grid's scales), a row permutation as the DeepSeek family's rope reorder, a bias,
    x a column slice, float32 out of bf16 x, the bound call and the prefill copy."""
    k = 200
    parts = [(codes(rows, k, i), scales(rows, k, i)) for i, rows in enumerate((130, 70, 5))]
    order = torch.randperm(205, generator=torch.Generator().manual_seed(3))
    lin = linear_on(path, parts, k).take_rows(order)
    w = weights(parts)[order]
    bias = torch.randn(205)
    lin.bias = bias
    assert lin.shape == (205, 200)
    assert lin.nbytes == 205 * 200 + 4 * (2 * 2 + 1 * 2 + 1 * 2) + 4 * 205
    for m in (1, 6, 33):
        wide = torch.randn(m, k + 40)
        x = wide[:, 40:]
        assert_close(lin(x), x, w, bias)
        out = torch.empty(m, 205)
        assert_close(lin(x.bfloat16(), out=out), x.bfloat16().float(), w, bias)
        xc, oc = x.contiguous(), torch.full((m, 205), float("nan"))
        assert lin.bind(xc, oc)() is oc
        assert_close(oc, x, w, bias)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(70, k).to(dtype)
        assert torch.equal(lin.prefill(x), F.linear(x, w.to(dtype), bias.to(dtype)))


@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
def test_nan_codes_do_not_crash_and_subnormals_survive_flush_to_zero(path):
    """e4m3fn's NaN codes (never written by a quantizer) read as +-480 on the kernel paths;
    the subnormal codes keep their values with the thread's FTZ/DAZ on (vcvtph2ps does not
    flush half subnormals; the scalar path's table is integer-built)."""
    raw = torch.tensor([[0x7F, 0xFF, 0x01, 0x07, 0x81, 0x3C]], dtype=torch.uint8)
    scale = torch.ones(1, 1)
    lin = linear_on(path, [(raw.view(torch.float8_e4m3fn), scale)], 6)
    want = torch.tensor([480.0, -480.0, 2.0 ** -9, 7 * 2.0 ** -9, -(2.0 ** -9), 1.5])
    assert torch.equal(lin.dequantize(torch.float32)[0], want)
    assert torch.equal(lin(torch.eye(6))[:, 0], want)
    torch.set_flush_denormal(True)
    try:
        assert torch.equal(lin.dequantize(torch.float32)[0], want)
    finally:
        torch.set_flush_denormal(False)


def test_bad_shapes_are_refused():
    w = codes(130, 64)
    with pytest.raises(ValueError, match=r"expected \[2, 1\], got \[1, 1\]"):
        qg.QuantLinear.from_fp8([(w, torch.ones(1, 1))], 64)
    with pytest.raises(ValueError, match="expected float8_e4m3fn"):
        qg.QuantLinear.from_fp8([(w.float(), torch.ones(2, 1))], 64)
    with pytest.raises(ValueError, match="expected float8_e4m3fn"):
        qg.QuantLinear.from_fp8([(w, torch.ones(2, 1))], 65)
    lin = qg.QuantLinear.from_fp8([(w, torch.ones(2, 1))], 64)
    with pytest.raises(ValueError, match="expected"):
        lin(torch.randn(2, 63))
    gguf_like = qg.QuantLinear.from_fp8([(w, torch.ones(2, 1))], 64, bias=torch.zeros(130))
    with pytest.raises(ValueError, match="without a bias"):
        gguf_like.take_rows(torch.arange(130))
    assert np.isfinite(lin.dequantize().numpy()).all()
