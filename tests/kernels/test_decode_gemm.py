"""The small-M decode GEMM (pipefill.kernels.decode_gemm) against float64, on every path this
CPU can execute, plus forced fallbacks. A path needing CPU flags this machine lacks is skipped;
one whose flags it has must run (a build that failed fails the tests: cpu_paths.py).

Tolerances: the kernels sum in float32 with FMAs, so a dot product of length K is off by at most
about K * 2^-24 * sum_k |x_k w_k| (the classic recursive-summation bound; we allow 2x), plus
one rounding for the bias. A bf16
output adds one rounding to bf16 (half an ulp: 2^-9 relative). The reference uses the inputs
and weights as the kernel sees them (rounded to bf16 where they are bf16), so the tolerance is
about summation only, not about bf16 quantization.
"""
import pytest
import torch
import torch.nn.functional as F

from pipefill.kernels import decode_gemm as dg
from pipefill.model.layers import linear

from cpu_paths import need as need_path, should_run

SHAPES = [(1, 576, 960), (1, 33, 37), (2, 64, 16), (3, 17, 31), (5, 1536, 576), (12, 96, 48),
          (13, 100, 100), (25, 7, 200), (32, 576, 130),
          # around the register tiles (8 rows AVX-512, 4 rows AVX2; groups of 48 columns, 3
          # vectors of 16 / 6 of 8): one row and column past and short of each, K = 1 and 2.
          (7, 49, 47), (8, 2, 49), (9, 1, 95), (16, 577, 97), (17, 64, 144), (4, 3, 8),
          (1, 1, 1)]  # (M, K, N)
PATHS = [("amx", torch.bfloat16, torch.bfloat16), ("avx512bf16", torch.bfloat16, torch.bfloat16),
         ("avx512", torch.float32, torch.float32), ("avx512", torch.float32, torch.bfloat16),
         ("avx512", torch.bfloat16, torch.bfloat16),
         ("avx2", torch.float32, torch.float32), ("avx2", torch.float32, torch.bfloat16),
         ("avx2", torch.bfloat16, torch.bfloat16)]  # (isa, activations, weights)


def only(isa: str) -> tuple[str, ...]:
    return tuple(i for i in dg.ISAS if i != isa)


def need(isa: str) -> None:
    need_path(isa, dg.isa_status()[isa], dg.ISA_CPU_FLAGS[isa])


def runs(isa: str) -> bool:
    """Whether the path runs here or ought to (this CPU has its flags)."""
    return should_run(dg.isa_status()[isa], dg.ISA_CPU_FLAGS[isa])


def need_a_path() -> None:
    """Skips where this CPU has no path's flags (the least path, avx2, needs the fewest)."""
    if not any(runs(i) for i in dg.ISAS):
        need("avx2")


def data(m, k, n, x_dtype, w_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    w = torch.randn(n, k, generator=g).to(w_dtype)
    b = torch.randn(n, generator=g)
    return x, w, b


def assert_close64(y, x, w, b):
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T + (0 if b is None else b.double())
    bound = 2 * x.shape[1] * 2.0 ** -24 * (xd.abs() @ wd.abs().T) + 1e-30
    if b is not None:  # adding the bias rounds once more (visible when K is tiny)
        bound = bound + 2.0 ** -24 * (ref.abs() + b.double().abs())
    if y.dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0 ** -8
    err = (y.double() - ref).abs()
    worst = int(((err - bound) / bound).argmax())
    assert (err <= bound).all(), f"error {err.view(-1)[worst]:.3g} > bound {bound.view(-1)[worst]:.3g}"


@pytest.mark.parametrize("isa,x_dtype,w_dtype", PATHS, ids=[f"{i}-x{str(a)[6:]}-w{str(b)[6:]}"
                                                          for i, a, b in PATHS])
def test_against_float64(isa, x_dtype, w_dtype):
    need(isa)
    for m, k, n in SHAPES:
        x, w, b = data(m, k, n, x_dtype, w_dtype)
        for bias in (None, b):
            p = dg.pack(w, bias, x_dtype, w_dtype, disable=only(isa))
            assert p is not None and p.isa == isa
            y = p(x)
            assert y.dtype == x_dtype and y.shape == (m, n)
            assert_close64(y, x, w, bias)
            out = torch.empty(m, n)  # float32 output from bf16 inputs (the LM head's logits)
            assert_close64(p(x, out=out), x, w, bias)


@pytest.mark.parametrize("isa,x_dtype,w_dtype", PATHS, ids=[f"{i}-x{str(a)[6:]}-w{str(b)[6:]}"
                                                          for i, a, b in PATHS])
def test_row_bits_do_not_depend_on_batch(isa, x_dtype, w_dtype):
    """A row alone and the same row inside any batch (any row tile, any position in it) give
    the same bits: each row's sum runs in one order whatever M (the batch-1 vs batch-8
    end-to-end test relies on it)."""
    need(isa)
    for k, n in ((300, 70), (577, 97), (64, 48)):
        x, w, b = data(29, k, n, x_dtype, w_dtype, seed=1)
        p = dg.pack(w, b, x_dtype, w_dtype, disable=only(isa))
        full = p(x)
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17):
            assert torch.equal(p(x[-m:]), full[-m:]), (k, n, m)
            assert torch.equal(p(x[3:3 + m]), full[3:3 + m]), (k, n, m)
        for i in (0, 7, 8, 28):
            assert torch.equal(p(x[i:i + 1]), full[i:i + 1]), (k, n, i)


def test_avx2_and_avx512_agree_bitwise():
    """Same arithmetic in the same order: the AVX2 path equals the AVX-512F path."""
    need("avx2")
    need("avx512")
    for w_dtype in (torch.float32, torch.bfloat16):
        for m, k, n in ((9, 257, 45), (1, 576, 100), (6, 33, 130)):  # both AVX2 tile widths
            x, w, b = data(m, k, n, torch.float32, w_dtype, seed=2)
            a = dg.pack(w, b, torch.float32, w_dtype, disable=only("avx2"))(x)
            c = dg.pack(w, b, torch.float32, w_dtype, disable=only("avx512"))(x)
            assert torch.equal(a, c), (m, k, n)


def test_forced_fallbacks_pick_the_next_path_then_torch():
    need_a_path()
    usable = [i for i in dg.ISAS if runs(i)]
    isa, _ = dg.choose_isa(torch.bfloat16, torch.bfloat16)
    assert isa == usable[0]
    # float32 activations never take the bf16 dot-product path (it would round them).
    assert dg.choose_isa(torch.float32, torch.bfloat16)[0] not in dg.BF16_ONLY
    isa, why = dg.choose_isa(torch.bfloat16, torch.bfloat16, disable=dg.ISAS)
    assert isa is None and "disabled by caller" in why
    x, w, b = data(4, 40, 24, torch.float32, torch.float32)
    assert dg.pack(w, b, torch.float32, disable=dg.ISAS) is None
    # linear() without a packed copy (or with more rows than max_rows) is torch's F.linear.
    assert torch.equal(linear(x, w, b, None), F.linear(x, w, b))
    small = dg.pack(w, b, torch.float32, max_rows=2)
    assert torch.equal(linear(x, w, b, small), F.linear(x, w, b))
    assert_close64(linear(x[:2], w, b, small), x[:2], w, b)


def test_float16_is_not_packed_and_bad_shapes_are_refused():
    assert dg.choose_isa(torch.float16, torch.float16)[0] is None
    need_a_path()
    x, w, _ = data(2, 32, 16, torch.float32, torch.float32)
    p = dg.pack(w, None, torch.float32)
    with pytest.raises(ValueError, match=r"expected \[M, 32\]"):
        p(torch.zeros(2, 31))
    with pytest.raises(TypeError):
        p(torch.zeros(2, 32, dtype=torch.float16))
    assert p(torch.zeros(0, 32)).shape == (0, 16)
    strided = torch.randn(3, 64)[:, ::2]  # not contiguous along K: copied first
    assert_close64(p(strided), strided, w, None)


def _usable_paths():
    return [(i, a, b) for i, a, b in PATHS if runs(i)]


def test_bound_call_equals_the_plain_call_bit_for_bit():
    """PackedLinear.bind(x, out)() runs the kernel on the same arguments as p(x, out=out): the
    same bits, on every path here, with and without bias, float32 output from bf16 inputs, rows
    of x further apart than K (a column slice of a wider buffer); a later call reads x's new
    values and writes the same out."""
    need_a_path()
    for isa, x_dtype, w_dtype in _usable_paths():
        for m, k, n in ((1, 576, 96), (5, 33, 37), (9, 100, 130)):
            x, w, b = data(m, k, n, x_dtype, w_dtype, seed=3)
            for bias, out_dtype in ((None, x_dtype), (b, x_dtype), (b, torch.float32)):
                p = dg.pack(w, bias, x_dtype, w_dtype, disable=only(isa))
                wide = torch.zeros(m, k + 5, dtype=x_dtype)
                xs = wide[:, 2:2 + k]
                xs.copy_(x)
                out = torch.full((m, n), float("nan"), dtype=out_dtype)
                bound = p.bind(xs, out)
                assert bound() is out
                assert torch.equal(out, p(x, out=torch.empty(m, n, dtype=out_dtype))), \
                    (isa, m, k, n)
                xs.mul_(-0.5)  # new values in the bound buffer
                bound()
                assert torch.equal(out, p(xs.contiguous(), out=torch.empty_like(out))), \
                    (isa, m, k, n)


def test_bind_refuses_buffers_the_kernel_cannot_take():
    need_a_path()
    x, w, _ = data(3, 32, 16, torch.float32, torch.float32)
    p = dg.pack(w, None, torch.float32)
    out = torch.empty(3, 16)
    bad = {
        "x width": (torch.zeros(3, 31), out),
        "x 1-D": (torch.zeros(32), out),
        "out width": (x, torch.empty(3, 17)),
        "out rows": (x, torch.empty(2, 16)),
        "x float16": (x.half(), out),
        "out float64": (x, out.double()),
        "x not contiguous along K": (torch.zeros(3, 64)[:, ::2], out),
        "out not contiguous along N": (x, torch.empty(3, 32)[:, ::2]),
        "out rows overlap": (x, torch.empty(1, 16).expand(3, 16)),
        "x not a tensor": (x.tolist(), out),
    }
    for what, (a, o) in bad.items():
        with pytest.raises(ValueError, match="bind"):
            p.bind(a, o)
            pytest.fail(f"bind accepted: {what}")
    both = torch.empty(3, 48)
    with pytest.raises(ValueError, match="overlaps"):  # out written while x is read
        p.bind(both[:, :32], both[:, 32:])
    for isa in dg.BF16_ONLY:
        if not runs(isa):
            continue
        pb = dg.pack(w, None, torch.bfloat16, torch.bfloat16, disable=only(isa))
        assert pb.isa == isa
        with pytest.raises(ValueError, match="bfloat16 x"):
            pb.bind(x, out)
        pb.bind(x.bfloat16(), out)  # float32 output from bf16 inputs: fine


def test_bound_call_keeps_its_buffers_alive():
    import gc
    import weakref
    need_a_path()
    x, w, b = data(4, 64, 50, torch.float32, torch.float32, seed=4)
    p = dg.pack(w, b, torch.float32)
    want = p(x)
    xb, out = x.clone(), torch.empty(4, 50)
    refs = [weakref.ref(xb), weakref.ref(out)]
    bound = p.bind(xb, out)
    del xb, out, p
    gc.collect()
    assert all(r() is not None for r in refs)
    assert torch.equal(bound(), want)
    del bound
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("w_dtype", (torch.float32, torch.bfloat16), ids=("wfloat32", "wbfloat16"))
def test_avx2_row_tiles_give_the_same_bits_for_every_batch_size(w_dtype):
    """The AVX2 path cuts M into row tiles (bf16 weights: 5 + 5 + ... then 3 + 3 or 4 + 3 rows
    of 16 or 24 columns; float32: 4 + 4 + ... rows of 24) and a single row into 48 columns: for
    every M = 1..17, N short of and past each column tile and an odd and even K (one K chunk and
    several), each row equals the row computed alone, and the whole batch equals the AVX-512F
    path (same arithmetic, so the same bits as before the tiles changed)."""
    need("avx2")
    both = runs("avx512")
    for k, n in ((75, 61), (200, 100), (33, 16), (66, 8)):  # N: 48 + 13, 2 x 48 + 4, 16, 8
        x, w, b = data(17, k, n, torch.float32, w_dtype, seed=3)
        p = dg.pack(w, b, torch.float32, w_dtype, disable=only("avx2"))
        alone = torch.cat([p(x[i:i + 1]) for i in range(17)])
        q = dg.pack(w, b, torch.float32, w_dtype, disable=only("avx512")) if both else None
        for m in range(1, 18):
            y = p(x[:m])
            assert torch.equal(y, alone[:m]), (k, n, m)
            assert q is None or torch.equal(y, q(x[:m])), (k, n, m)
            out = torch.empty(m, n, dtype=torch.bfloat16)  # the bf16 store of every tile
            assert torch.equal(p(x[:m], out=out), alone[:m].to(torch.bfloat16)), (k, n, m)


def test_amx_pads_k_to_whole_tiles_and_agrees_with_the_vector_path():
    """The AMX path packs K up to a multiple of 32 (zeros) and reads x through a zero-padded
    copy of whole 16-row tiles: K short of, at and past a tile, M across row tiles up to the
    32 of --decode-gemm-max-rows; within the float32-summation bound of the vdpbf16ps path
    (other order, so not the same bits)."""
    need("amx")
    for m, k, n in ((1, 31, 48), (15, 32, 50), (16, 33, 96), (31, 95, 1), (32, 576, 144)):
        x, w, b = data(m, k, n, torch.bfloat16, torch.bfloat16, seed=5)
        p = dg.pack(w, b, torch.bfloat16, torch.bfloat16, disable=only("amx"))
        assert p.packed.shape == (-(-n // dg.BLOCK), -(-k // 32) * 16, dg.BLOCK, 2)
        y = p(x, out=torch.empty(m, n))
        assert_close64(y, x, w, b)
        if runs("avx512bf16"):
            v = dg.pack(w, b, torch.bfloat16, torch.bfloat16, disable=only("avx512bf16"))
            assert_close64(v(x, out=torch.empty(m, n)), x, w, b)


def test_bench_decode_gemm_times_every_row_count(capsys):
    """`pipefill bench decode-gemm`: one table row per (shape, M), M = 1 the baseline of the
    ratios; the M values are timed in turn (interleaved rounds), each a median of 5."""
    from pipefill.bench import decode_gemm as bench
    need_a_path()
    isa = next(i for i in ("avx512bf16", "avx512", "avx2") if runs(i))
    dtype = "bfloat16" if isa == "avx512bf16" else "float32"
    assert bench.main(["--rows", "1,3", "--shapes", "o_proj", "--min-s", "0.02", "--threads",
                       "1", "--isa", isa, "--dtype", dtype]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| o_proj")]
    assert [r[3].strip() for r in rows] == ["1", "3"]
    assert rows[0][5].strip() == "1.00" and float(rows[1][4]) > 0


def test_interleaved_timing_visits_every_case_each_round():
    from pipefill.bench import decode_gemm as bench
    seen = []

    class Fake:
        def __call__(self, x, out):
            seen.append(int(x))
    times = bench.time_interleaved([Fake()], [(torch.tensor(1), None), (torch.tensor(2), None)],
                                   min_s=0.0, rounds=3)
    assert len(times) == 2 and all(t >= 0 for t in times)
    # a warm-up call per case (per copy, up to two), then rounds alternating between the cases
    assert seen == [1, 2] + [1, 2] * 3
