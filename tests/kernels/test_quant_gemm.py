"""GGUF blocks kept quantized (pipefill.kernels.gguf_blocks, kernels.quant_gemm): the float64
reference dequantization against the gguf package, and the quantized decode GEMM against
float64 on every path this CPU runs (the others skipped with cpuid's reason), plus the torch
path that runs where no kernel builds.

Tolerance: the kernels dequantize each weight to float32 with the bits of the gguf package's
dequantization (checked exactly below), then sum K float32 products in float32 (lanes, then a
reduction of the lanes): a dot product of length K is off from the exact one over those
float32 weights by at most about K * 2^-24 * sum_k |x_k w_k| (the recursive-summation bound;
we allow 2x), and the float32 weights are off from the float64 reference by at most 2 ulps
each (Q4_1's q d + m is two roundings), 2^-22 * sum_k |x_k w_k| more. A bf16 output adds
half a bf16 ulp (2^-8 relative: 8 significant bits). The reference multiplies the activations the kernel sees
(bf16 widened exactly), so no activation quantization enters the bound.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipefill.kernels import quant_gemm as qg
from pipefill.kernels.gguf_blocks import BLOCK_TYPES, dequantize_reference, quantize_reference

Q4_0, Q4_1, Q8_0 = 2, 3, 8
# (M, K, N): K a multiple of the 32-weight block but not of 256; N odd; around the row tiles
# (8 rows on AVX-512, 4 on AVX2).
SHAPES = [(1, 576, 97), (1, 32, 1), (2, 96, 7), (3, 288, 49), (4, 64, 33), (5, 160, 3),
          (7, 224, 11), (8, 32, 5), (9, 576, 13), (16, 96, 9), (17, 1536, 5), (33, 320, 7)]
PATHS = ["avx512", "avx2", "scalar", "torch"]


def blocks(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed + 31 * qtype + n + k)
    w = g.standard_normal((n, k)) * 0.05 + (0.01 if qtype == Q4_1 else 0)
    return quantize_reference(w, qtype)


def linear_on(path: str, parts, k: int, bias=None) -> qg.QuantLinear:
    if path != "torch":
        ok, why = qg.isa_status()[path]
        if not ok:
            pytest.skip(f"{path} cannot run here: {why}")
    lin = qg.QuantLinear.from_parts(parts, k, bias, max_rows=64,
                                    disable=tuple(i for i in qg.ISAS if i != path))
    assert lin.isa == path
    return lin


def reference(x: torch.Tensor, parts, bias=None) -> tuple[np.ndarray, np.ndarray]:
    """(exact y in float64, its error scale sum_k |x_k w_k|) over the blocks' exact values."""
    w = np.concatenate([dequantize_reference(raw, qtype) for raw, qtype in parts])
    xf = x.double().numpy()
    y = xf @ w.T + (0 if bias is None else bias.double().numpy())
    return y, np.abs(xf) @ np.abs(w).T


def assert_close(y: torch.Tensor, ref: np.ndarray, scale: np.ndarray, k: int) -> None:
    bound = (2 * k * 2.0 ** -24 + 2.0 ** -22) * scale + 1e-30
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * np.abs(ref)
    err = np.abs(y.double().numpy() - ref)
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst ratio {(err / bound).max()}"


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0])
def test_reference_matches_the_gguf_package(qtype):
    """Layouts checked against gguf.quants.dequantize (float32 there): the float64 reference
    rounds to its values exactly, and so does the kernels' own dequantization."""
    import gguf
    raw = blocks(qtype, 19, 160)
    pkg = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
    ref = dequantize_reference(raw, qtype)
    assert np.array_equal(ref.astype(np.float32), pkg)
    lin = qg.QuantLinear.from_parts([(raw, qtype)], 160)
    assert np.array_equal(lin.dequantize(torch.float32).numpy(), pkg)
    assert torch.equal(lin.dequantize(torch.bfloat16), torch.from_numpy(pkg).bfloat16())


def test_reference_on_the_default_models_blocks():
    """The default model's own Q4_1 and Q8_0 tensors, dequantized by the reference, equal the
    gguf package's values (a real file's blocks, not only our quantizer's)."""
    import gguf
    from pipefill.model.loader import resolve_model_path
    try:
        reader = gguf.GGUFReader(resolve_model_path(None))
    except ValueError as e:
        pytest.skip(str(e))
    seen = set()
    for t in reader.tensors:
        qtype = int(t.tensor_type)
        if qtype in BLOCK_TYPES and qtype not in seen:
            seen.add(qtype)
            raw = np.asarray(t.data[:64])
            assert np.array_equal(dequantize_reference(raw, qtype).astype(np.float32),
                                  gguf.quants.dequantize(raw, t.tensor_type))
    assert seen == {Q4_1, Q8_0}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_against_float64(path, qtype, dtype):
    for m, k, n in SHAPES:
        parts = [(blocks(qtype, n, k), qtype)]
        lin = linear_on(path, parts, k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)).to(dtype)
        y = lin(x)
        assert y.dtype == dtype and y.shape == (m, n)
        assert_close(y, *reference(x, parts), k)


@pytest.mark.parametrize("path", PATHS)
def test_mixed_types_bias_strides_and_bind(path):
    """A stacked matrix of three block types (as q/k/v of a Q4_K_M-style file), with a bias,
    x a column slice of a wider tensor, float32 out of bf16 x, and the bound call."""
    k = 224
    parts = [(blocks(Q4_1, 9, k), Q4_1), (blocks(Q8_0, 5, k), Q8_0), (blocks(Q4_0, 3, k), Q4_0),
             (blocks(Q4_0, 2, k, seed=1), Q4_0)]
    bias = torch.randn(19)
    lin = linear_on(path, parts, k, bias)
    assert [p.offset for p in lin.parts] == [0, 9, 14] and lin.out_features == 19
    assert lin.nbytes == sum(raw.size for raw, _ in parts)
    for m in (1, 6, 33):
        wide = torch.randn(m, k + 40)
        x = wide[:, 40:]
        ref, scale = reference(x, parts, bias)
        assert_close(lin(x), ref, scale, k)
        xb = x.bfloat16()
        out = torch.empty(m, 19)
        assert_close(lin(xb, out=out), *reference(xb, parts, bias), k)
        xc, oc = x.contiguous(), torch.full((m, 19), float("nan"))
        bound = lin.bind(xc, oc)
        assert bound() is oc
        assert_close(oc, ref, scale, k)


@pytest.mark.parametrize("path", PATHS)
def test_prefill_is_linear_on_the_dequantized_matrix(path):
    k = 96
    parts = [(blocks(Q4_1, 11, k), Q4_1), (blocks(Q8_0, 4, k), Q8_0)]
    lin = linear_on(path, parts, k, torch.randn(15))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(70, k).to(dtype)
        want = F.linear(x, lin.dequantize(dtype), lin.bias.to(dtype))
        assert torch.equal(lin.prefill(x), want)


def test_bad_shapes_are_refused():
    raw = blocks(Q4_1, 3, 64)
    with pytest.raises(ValueError, match="cannot stay quantized"):
        qg.QuantLinear.from_parts([(raw, Q4_1)], 48)
    with pytest.raises(ValueError, match="bytes"):
        qg.QuantLinear.from_parts([(raw[:, :30], Q4_1)], 64)
    with pytest.raises(ValueError, match="cannot stay quantized"):
        qg.QuantLinear.from_parts([(raw, 12)], 64)  # Q4_K: not read in blocks yet
    lin = qg.QuantLinear.from_parts([(raw, Q4_1)], 64)
    with pytest.raises(ValueError, match="expected"):
        lin(torch.randn(2, 63))
