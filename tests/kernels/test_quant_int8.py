"""The quantized decode GEMM's integer path (kernels.quant_gemm, csrc/quant_int8_*.h): int8
activations in blocks of 32 times the GGUF blocks' codes, on every integer path this CPU runs
(those needing flags it lacks skipped, cpu_paths.py), for every block type, odd shapes (K not
a multiple of the 128-weight group for the 32-weight types, M = 1..33 around the 8- and 4-row
tiles).

Two references, both float64:

* the same quantized activations (quantize_activations: the codes and scales the kernel
  multiplies) times the blocks' exact weights: the kernel differs by float32 rounding only.
  Each of its terms is a block's exact integer dot product times d dx (one float32 product),
  or m times dx sum(q) (one more), added into float32 lanes (K / 128 chain links a lane) and
  reduced once (16 lanes): a relative error of at most about (K / 128 + 8) 2^-24 of the sum of
  the terms' magnitudes, which we bound by sum |x'| (|w - offset| + |offset|) per weight (the
  offset split off: Q4_1's m and the K types' mins, which the kernel adds apart). We allow
  (K / 32 + 32) 2^-24 of it.
* the float activations: each x differs from dx q by at most half dx (round to nearest; the
  float32 reciprocal and dx's own rounding add 127 2^-23 dx at most), so |y - y_float| is at
  most the first bound plus 0.501 sum_k |w_k| dx(k), the error llama.cpp's Q8 dot products
  have too.

The quantization itself is checked against numpy: dx = float32(amax) / 127 and q = x (1 / dx)
rounded to nearest even.
"""
import numpy as np
import pytest
import torch

from pipefill.kernels import quant_gemm as qg
from pipefill.kernels.gguf_blocks import BLOCK_TYPES, dequantize_reference, random_blocks

from cpu_paths import need, should_run
from test_quant_gemm import Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0, shapes

TYPES = [Q4_1, Q8_0, Q6_K, Q4_K, Q5_0, Q4_0, Q5_K]  # the default model's first, then Gemma 3's
ROWS16_TYPES = tuple(TYPES)  # held in the 16-row layout on the VNNI path


def usable(path: str) -> None:
    need(f"integer path {path}", qg.int8_status()[path], qg.INT8_CPU_FLAGS[path])


def linear(path: str, parts, k: int, bias=None, rows16: bool = True) -> qg.QuantLinear:
    """The layer on integer path `path`; the 32-weight types in the 16-row layout where the
    path takes it and `rows16`, else on the row-major kernels."""
    usable(path)
    lin = qg.QuantLinear.from_parts(parts, k, bias, max_rows=64, disable=tuple(
        f"int8-{p}" for p in qg.INT8_PATHS if p != path) + (() if rows16 else ("int8-rows16",)))
    assert lin.int8 == path and path in lin.decode_path
    assert all(bool(p.rows16) == (rows16 and p.qtype in ROWS16_TYPES) for p in lin.parts)
    return lin


def offsets(raw: np.ndarray, qtype: int) -> np.ndarray:
    """The offset part of every weight (Q4_1's m, the K types' -dmin min; 0 elsewhere):
    [N, K] float64, so that w - offset is the scaled code."""
    name, weights, size = BLOCK_TYPES[qtype]
    n = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(n, -1, size)
    half = lambda at: b[..., at:at + 2].copy().view(np.float16).astype(np.float64)  # noqa: E731
    if name == "Q4_1":
        return np.repeat(half(2), 32, axis=-1).reshape(n, -1)
    if name in ("Q4_K", "Q5_K"):
        s = b[..., 4:16]
        mid, hi = s[..., 4:8], s[..., 8:12]  # the mins' bits (bytes 0..3: the scales')
        mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1).astype(np.float64)
        return np.repeat(-half(2) * mn, 32, axis=-1).reshape(n, -1)
    return np.zeros((n, raw.shape[1] // size * weights))


def references(x: torch.Tensor, q: torch.Tensor, dx: torch.Tensor, parts, bias=None):
    """(y over the quantized activations, its error scale, y over the float activations, the
    activations' rounding bound), float64."""
    w = np.concatenate([dequantize_reference(raw, qt) for raw, qt in parts])
    off = np.concatenate([offsets(raw, qt) for raw, qt in parts])
    step = np.repeat(dx.double().numpy(), 32, axis=-1)  # dx of every k
    xq = q.double().numpy() * step
    b = 0 if bias is None else bias.double().numpy()
    y_q = xq @ w.T + b
    scale = np.abs(xq) @ (np.abs(w - off) + np.abs(off)).T
    y_f = x.double().numpy() @ w.T + b
    rounding = 0.501 * step @ np.abs(w).T
    return y_q, scale, y_f, rounding


def check(lin, x, parts, path, k, bias=None, out_dtype=None):
    q, dx = qg.quantize_activations(x.float(), path)
    y = lin(x) if out_dtype is None else lin(x, out=torch.empty(x.shape[0], lin.out_features,
                                                                    dtype=out_dtype))
    y_q, scale, y_f, rounding = references(x.float(), q, dx, parts, bias)
    bound = (k / 32 + 32) * 2.0 ** -24 * scale + 1e-30
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * np.abs(y_q)
    yd = y.double().numpy()
    err = np.abs(yd - y_q)
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst ratio {(err / bound).max()}"
    err_f = np.abs(yd - y_f)
    assert (err_f <= bound + rounding).all(), (err_f / (bound + rounding)).max()


@pytest.mark.parametrize("path", qg.INT8_PATHS)
def test_quantization_is_round_to_nearest_in_blocks_of_32(path):
    usable(path)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 320, generator=g) * torch.logspace(-3, 2, 320)
    x[1, 32:64] = 0  # an all-zero block: scale 0, codes 0
    x[2, :32] = -7.0  # amax from a negative value
    q, dx = qg.quantize_activations(x, path)
    blocks = x.numpy().reshape(5, 10, 32)
    amax = np.abs(blocks).max(-1)
    want_dx = amax.astype(np.float32) / np.float32(127)
    assert np.array_equal(dx.numpy(), want_dx)
    inv = np.where(want_dx != 0, np.float32(1) / np.where(want_dx != 0, want_dx, 1), 0)
    want_q = np.rint((blocks * inv[..., None].astype(np.float32)).astype(np.float32))
    assert np.array_equal(q.numpy().reshape(5, 10, 32), want_q.astype(np.int8))
    assert q.abs().max().item() <= 127 and (q[1, 32:64] == 0).all() and (q[2, :32] == -127).all()


@pytest.mark.parametrize("path", qg.INT8_PATHS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: BLOCK_TYPES[t][0])
def test_int8_gemm_against_float64(path, qtype):
    for m, k, n in shapes(qtype):  # K not whole groups of 128 for the 32-weight types
        g = np.random.default_rng(7 * m + k + n + qtype)
        parts = [(random_blocks(qtype, n, k, g), qtype)]
        lin = linear(path, parts, k, rows16=False)
        x = torch.from_numpy(g.standard_normal((m, k)).astype(np.float32))
        x[:, :32] *= 40  # blocks of very different scales
        check(lin, x, parts, path, k)
        check(lin, x.bfloat16(), parts, path, k, out_dtype=torch.bfloat16)


# Rows long enough for the 32-weight types' unit-lane layout (csrc/quant_int8_kernel.h): whole
# steps of 16 units (zmm) or 8 (ymm), then none, a half step (zmm) or a whole one for the rest;
# M around the row tiles. K = 544 stays on the group records on both paths (too much padding);
# K = 1408 (44 units) ends in a whole step of 12 units on zmm (masked loads on the last).
UNIT_LANE_SHAPES = [(1, 1088, 5), (4, 1280, 3), (8, 1056, 7), (9, 1024, 4), (16, 512, 3),
                    (3, 2080, 2), (5, 544, 3), (2, 1408, 3)]


@pytest.mark.parametrize("path", qg.INT8_PATHS)
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0, Q5_0, Q4_0], ids=lambda t: BLOCK_TYPES[t][0])
def test_int8_unit_lanes_against_float64(path, qtype):
    for m, k, n in UNIT_LANE_SHAPES:
        g = np.random.default_rng(5 * m + k + n + qtype)
        parts = [(random_blocks(qtype, n, k, g), qtype)]
        lin = linear(path, parts, k, rows16=False)
        x = torch.from_numpy(g.standard_normal((m, k)).astype(np.float32))
        x[:, -32:] *= 40  # the last unit (in the last step) of another scale
        check(lin, x, parts, path, k)


# (M, K, N) for the 16-row layout: N a multiple of 16 and not (the last group's padding rows,
# its outputs masked), M around the 8-row tiles, K from one block up to the SmolLM2 MLP's.
# Every tile height of the VNNI kernel (1-3: two dot-product chains a row; 4-8: one) alone and
# after whole tiles of 8 (12: 8 + 4).
ROWS16_SHAPES = [(1, 576, 576), (1, 32, 17), (2, 1536, 40), (3, 64, 16), (4, 96, 20),
                 (5, 64, 16), (6, 128, 33), (7, 32, 17), (8, 576, 33), (9, 320, 48),
                 (12, 96, 40), (17, 96, 31), (33, 160, 5)]
ROWS16_SHAPES_K = [(1, 768, 64), (1, 256, 17), (2, 1536, 40), (4, 256, 20), (7, 512, 17),
                   (8, 512, 33), (9, 256, 48), (12, 256, 33), (17, 512, 31), (33, 256, 5)]


@pytest.mark.parametrize("path", qg.INT8_PATHS)
@pytest.mark.parametrize("qtype", ROWS16_TYPES, ids=lambda t: BLOCK_TYPES[t][0])
def test_rows16_against_float64(path, qtype):
    """Each integer path's 16-row kernel (csrc/quant_int8_rows16.h on VNNI,
    quant_int8_rows16_avx2.h) on every block type: the same bounds as the row-major kernels
    (each output is one lane's K / 32 float32 terms). Q8_0's codes at -128 and 127 and the
    activations' at +-127 (the AVX2 kernel's int16 pairs at their largest)."""
    for m, k, n in ROWS16_SHAPES if BLOCK_TYPES[qtype][1] == 32 else ROWS16_SHAPES_K:
        g = np.random.default_rng(3 * m + k + n + qtype)
        raw = random_blocks(qtype, n, k, g)
        if qtype == Q8_0:  # whole blocks of the extreme codes
            raw.reshape(n, -1, 34)[:, ::3, 2:] = np.uint8(0x80)
            raw.reshape(n, -1, 34)[:, 1::3, 2:] = np.uint8(0x7f)
        parts = [(raw, qtype)]
        lin = linear(path, parts, k)
        x = torch.from_numpy(g.standard_normal((m, k)).astype(np.float32))
        x[:, -32:] *= 40
        x[:, :32] = torch.where(x[:, :32] < 0, -1.0, 1.0)  # codes +-127
        check(lin, x, parts, path, k)
        check(lin, x.bfloat16(), parts, path, k, out_dtype=torch.bfloat16)


# Prefill-sized M, odd (tiles of 8 rows and a partial one, 16-column groups and a partial one).
PREFILL_SHAPES = [(777, 352, 21), (1001, 608, 35)]
PREFILL_SHAPES_K = [(600, 768, 21), (1003, 512, 17)]


@pytest.mark.parametrize("path", qg.INT8_PATHS)
@pytest.mark.parametrize("qtype", ROWS16_TYPES, ids=lambda t: BLOCK_TYPES[t][0])
def test_rows16_prefill_rows_against_float64(path, qtype):
    """Prefill (more rows than max_rows) on the integer path, as QuantLinear.prefill takes it
    by default: the bounds of test_rows16_against_float64 at prefill row counts, float32 and
    bf16 x, the columns split over two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for m, k, n in PREFILL_SHAPES if BLOCK_TYPES[qtype][1] == 32 else PREFILL_SHAPES_K:
            g = np.random.default_rng(m + k + n + qtype)
            parts = [(random_blocks(qtype, n, k, g), qtype)]
            lin = linear(path, parts, k)
            assert m > lin.max_rows and lin.int8_prefills(m, torch.float32)
            x = torch.from_numpy(g.standard_normal((m, k)).astype(np.float32))
            x[::7, -32:] *= 40  # rows of very different scales next to each other
            assert torch.equal(lin.prefill(x), lin(x))
            check(lin, x, parts, path, k)
            check(lin, x.bfloat16(), parts, path, k, out_dtype=torch.bfloat16)
    finally:
        torch.set_num_threads(threads)


def test_prefill_rows_past_the_integer_limit_are_dequantized():
    """Above int8_prefill_max_rows prefill dequantizes the matrix into x's dtype and runs
    torch's GEMM (the file's weights, float32 sums: float32 rounding only), and says so."""
    usable("avx512vnni")
    g = np.random.default_rng(8)
    parts = [(random_blocks(Q4_1, 40, 128, g), Q4_1)]
    lin = linear("avx512vnni", parts, 128)
    x = torch.from_numpy(g.standard_normal((100, 128)).astype(np.float32))
    assert "any number of rows (measured" in lin.prefill_rule(torch.float32)
    assert not lin.int8_prefills(513, torch.bfloat16) and lin.int8_prefills(512, torch.bfloat16)
    assert "up to 512 rows (measured" in lin.prefill_rule(torch.bfloat16)
    lin.int8_prefill_max_rows = 99  # --gguf-int8-prefill-max-rows
    assert not lin.int8_prefills(100, torch.float32) and lin.int8_prefills(99, torch.float32)
    assert "up to 99 rows (--gguf" in lin.prefill_rule(torch.float32)
    w = torch.from_numpy(dequantize_reference(*parts[0]))
    y = lin.prefill(x)
    assert torch.equal(y, lin.prefill_dequantized(x))
    torch.testing.assert_close(y.double(), x.double() @ w.T, rtol=1e-5, atol=1e-5)
    lin.int8_prefill_max_rows = 0
    assert "turned off" in lin.prefill_rule(torch.float32)


def test_prefill_for_pieces_takes_the_path_of_all_the_rows():
    """prefill_for(rows) called on pieces of those rows (the LM head's blocks of prompt
    logprob rows) gives what prefill gives them all at once: the integer path where all
    the rows take it, though a piece alone would too, else the dequantized copy, made once."""
    usable("avx512vnni")
    g = np.random.default_rng(9)
    parts = [(random_blocks(Q8_0, 48, 128, g), Q8_0)]
    lin = linear("avx512vnni", parts, 128)
    x = torch.from_numpy(g.standard_normal((100, 128)).astype(np.float32))
    for limit in (99, 100):  # 100 rows dequantize, then run the integer path
        lin.int8_prefill_max_rows = limit
        run = lin.prefill_for(100, torch.float32)
        pieces = torch.cat([run(x[at:at + 30]) for at in range(0, 100, 30)])
        whole = lin.prefill(x)
        torch.testing.assert_close(pieces, whole, rtol=1e-6, atol=1e-6)
        other = lin.prefill_dequantized(x) if limit == 100 else lin.prefill_int8(x)
        assert (pieces - other).abs().max() > 1e-4  # the two paths differ: the right one ran


def test_rows16_layer_keeps_the_files_weights():
    """A layer held in the 16-row layout: the same bytes (rows padded to 16), dequantized,
    looked up (rows) and reordered (take_rows) as the file's rows, and the same decode as the row-major kernels
    within the float32 rounding of their sums."""
    g = np.random.default_rng(5)
    raw = random_blocks(Q5_0, 37, 96, g)
    lin = linear("avx512vnni", [(raw, Q5_0)], 96)
    plain = linear("avx512vnni", [(raw, Q5_0)], 96, rows16=False)
    assert lin.nbytes == 48 * raw.shape[1] and lin.shape == (37, 96)
    assert torch.equal(lin.parts[0].file_rows(), torch.from_numpy(raw))
    for qtype in ROWS16_TYPES:  # prefill's copy, read from the layout in C++
        k = 3 * BLOCK_TYPES[qtype][1]
        raw_t = random_blocks(qtype, 37, k, g)
        held = linear("avx512vnni", [(raw_t, qtype)], k)
        row_major = linear("avx512vnni", [(raw_t, qtype)], k, rows16=False)
        ids = torch.tensor([[36, 0, 21], [21, 5, 16]])  # an embedding lookup on the layout
        many = torch.arange(37).flip(0).repeat(2)  # past GROUP_LOOKUP_ROWS: the ids' own bytes
        assert len(ids.view(-1)) <= qg.GROUP_LOOKUP_ROWS < len(many)
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(held.dequantize(dtype), row_major.dequantize(dtype)), qtype
            assert torch.equal(held.rows(ids, dtype), row_major.dequantize(dtype)[ids]), qtype
            assert torch.equal(held.rows(many, dtype), row_major.dequantize(dtype)[many])
        with pytest.raises(IndexError, match="out of range"):
            held.rows(torch.tensor([37]), torch.float32)
    order = torch.randperm(37, generator=torch.Generator().manual_seed(0))
    moved = lin.take_rows(order)
    assert moved.parts[0].rows16 == 37
    assert torch.equal(moved.dequantize(), plain.dequantize()[order])
    x = torch.from_numpy(g.standard_normal((4, 96)).astype(np.float32))
    torch.testing.assert_close(moved(x), plain(x)[:, order], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", qg.INT8_PATHS)
def test_int8_mixed_parts_bias_and_bind(path):
    """A layer of stacked matrices of several types (one call each, on out's columns), with a
    bias, called directly and through bind."""
    usable(path)
    k, m = 512, 6
    g = np.random.default_rng(3)
    parts = [(random_blocks(Q4_K, 9, k, g), Q4_K), (random_blocks(Q6_K, 5, k, g), Q6_K),
             (random_blocks(Q8_0, 7, k, g), Q8_0), (random_blocks(Q4_1, 3, k, g), Q4_1)]
    bias = torch.from_numpy(g.standard_normal(24).astype(np.float32))
    lin = linear(path, parts, k, bias)
    x = torch.from_numpy(g.standard_normal((m, k)).astype(np.float32))
    check(lin, x, parts, path, k, bias)
    out = torch.empty(m, 24)
    bound = lin.bind(x, out)
    assert torch.equal(bound(), lin(x))


@pytest.mark.parametrize("path", qg.INT8_PATHS)
def test_int8_bias_and_bf16_output_on_columns_split_over_threads(path):
    """N well above a task's columns (Q8_0 rows of 64 weights: 68 bytes, ~480 columns a task
    at least), on two threads: each task adds the bias to its own columns and rounds them."""
    usable(path)
    k, n, m = 64, 2500, 3
    g = np.random.default_rng(11)
    parts = [(random_blocks(Q8_0, n, k, g), Q8_0)]
    bias = torch.from_numpy(g.standard_normal(n).astype(np.float32))
    lin = linear(path, parts, k, bias)
    x = torch.from_numpy(g.standard_normal((m, k)).astype(np.float32))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check(lin, x.bfloat16(), parts, path, k, bias, out_dtype=torch.bfloat16)
        check(lin, x, parts, path, k, bias)
    finally:
        torch.set_num_threads(threads)


def test_paths_are_chosen_and_turned_off():
    """The integer path is the default where one runs; "int8" turns it off (the float path),
    as does disabling the float build it belongs to, and --hide-cpu-flags avx512_vnni hides
    the VNNI one."""
    raw = random_blocks(Q4_1, 4, 64, np.random.default_rng(0))
    best = qg.choose_int8()[0]
    assert best == next((p for p in qg.INT8_PATHS
                         if should_run(qg.int8_status()[p], qg.INT8_CPU_FLAGS[p])), None)
    assert qg.QuantLinear.from_parts([(raw, Q4_1)], 64).int8 == best
    assert qg.QuantLinear.from_parts([(raw, Q4_1)], 64, disable=("int8",)).int8 is None
    assert qg.choose_int8(("avx512", "avx2"))[0] is None
    assert qg.hidden_int8_paths("avx512_vnni") == ("int8-avx512vnni",)
    assert qg.choose_int8(qg.hidden_int8_paths("avx512_vnni"))[0] in (None, "avx2")
    assert "int8-avx512vnni" not in qg.hidden_int8_paths("avx512_bf16")
