"""The vector attention kernels (avx512bf16, avx512, avx2) over a quantized KV cache (int8,
fp8_e4m3; token-major rows of codes and a float32 scale, kernels/kv_quant.py): the kernel
widens each step's codes exactly and applies the row scales to the scores and probabilities,
so it agrees with a float64 attention over the dequantized values (code x scale, unrounded)
within the q dtype's rounding, like the same kernel over a packed cache does. Prefill chunks over a cached prefix, batched decode of
sequences of different lengths (split KV past 2048 keys), GQA groups, head dims 64 and 128,
page sizes 32 and 64. Kernels needing CPU flags this machine lacks are skipped;
one whose flags it has must run."""
import pytest
import torch

from pipefill.kernels import cpu_attention as ca
from pipefill.kernels.amx_attention import reference_attention
from pipefill.kernels.kv_quant import dequantize, quantize, stored_dim

from cpu_paths import should_run, skip_without_flags

_STATUS = {isa: ca.kernel_available(isa) for isa in ca.ISAS}
QUANT = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
# Whether each kernel runs here or ought to (this CPU has its flags: a build that failed then
# fails the tests that run it, cpu_paths.py).
_RUNS = {isa: should_run(_STATUS[isa], ca.REQUIRED_CPU_FLAGS[isa]) for isa in ca.ISAS}


def needs(isa):
    return skip_without_flags(isa, _STATUS[isa], ca.REQUIRED_CPU_FLAGS[isa])


# (isa, q dtype): the bf16 kernel takes bf16 q only; the float32 kernels take both.
COMBOS = [pytest.param("avx512bf16", torch.bfloat16, marks=needs("avx512bf16"))]
for _isa in ("avx512", "avx2"):
    for _qd in (torch.float32, torch.bfloat16):
        COMBOS.append(pytest.param(_isa, _qd, marks=needs(_isa)))

# (prefix L, chunk C, group G, kv heads, head dim, page size)
SHAPES = [
    (0, 37, 3, 3, 64, 64),     # no prefix, chunk not a multiple of 16
    (100, 1, 3, 3, 64, 64),    # one token at an unaligned prefix
    (130, 77, 4, 2, 128, 64),  # D = 128
    (200, 300, 8, 1, 64, 32),  # G = 8, page size 32 (a step spans pages)
    (2500, 1, 3, 3, 64, 64),   # one token past the split threshold (split KV)
    (3001, 5, 4, 2, 128, 32),  # a small chunk, split KV, D = 128, page size 32
]


def _pages(n, ps, gen):
    npages = (n + ps - 1) // ps + 3
    return npages, torch.randperm(npages, generator=gen).to(torch.int32)  # shuffled pages


def _quant_cache(npages, ps, hkv, D, dtype, gen):
    """A quantized layer cache whose unwritten rows hold random codes and huge scales."""
    rows = torch.randint(-127, 128, (npages * ps, hkv, stored_dim(D, dtype)), generator=gen,
                         dtype=torch.int8)
    rows.view(torch.uint8)[..., :D].clamp_(max=0x7e)  # no fp8 NaN codes
    rows[..., D:].view(torch.float32).fill_(1e30)
    return rows.view(dtype)


def _dequantized(cache, table, n, ps, dtype):
    """Tokens [0, n) of a quantized cache as torch's dequantize gives them: [n, H, D]."""
    pos = torch.arange(n)
    slots = table.long()[pos // ps] * ps + pos % ps
    rows = cache.view(torch.uint8)[slots].view(cache.dtype)  # no float8 index kernel on CPU
    return dequantize(rows, dtype)


def _tolerance(ref, q_dtype):
    if q_dtype == torch.float32:
        return 5e-6 * max(1.0, ref.abs().max().item())
    return 1.5 * (ref.to(torch.bfloat16).double() - ref).abs().max().item() + 2e-3


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("quant", QUANT)
@pytest.mark.parametrize("isa,q_dtype", COMBOS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}-C{}-G{}-H{}-D{}-ps{}".format(*s))
def test_chunk_over_quantized_cache(isa, q_dtype, quant, shape):
    L, C, G, hkv, D, ps = shape
    gen = torch.Generator().manual_seed(L + C)
    n = L + C
    npages, table = _pages(n, ps, gen)
    kq = _quant_cache(npages, ps, hkv, D, QUANT[quant], gen)
    vq = _quant_cache(npages, ps, hkv, D, QUANT[quant], gen)
    k = torch.randn(n, hkv, D, generator=gen)
    v = torch.randn(n, hkv, D, generator=gen)
    q = torch.randn(C, hkv * G, D, generator=gen).to(q_dtype)
    if L:
        ca.write_kv(kq, vq, k[:L], v[:L], table, 0, page_size=ps)
    out = ca.chunk_attention(isa, q, kq, vq, table, L, D ** -0.5, k_new=k[L:].to(q_dtype),
                             v_new=v[L:].to(q_dtype), page_size=ps)
    assert out.dtype == q_dtype and out.shape == q.shape
    keys = _dequantized(kq, table, n, ps, torch.float32).double()  # code x scale, one rounding
    values = _dequantized(vq, table, n, ps, torch.float32).double()
    ref = reference_attention(q.double(), keys, values, L, D ** -0.5)
    assert (out.double() - ref).abs().max().item() <= _tolerance(ref, q_dtype), (isa, quant, shape)


DECODE_LENS = [100, 0, 2100, 63, 1]  # unaligned, empty, split KV, a step edge, one key


@pytest.mark.parametrize("quant", QUANT)
@pytest.mark.parametrize("isa,q_dtype", COMBOS)
@pytest.mark.parametrize("G,hkv,D", [(3, 3, 64), (1, 2, 128), (4, 2, 64), (2, 1, 128)])
def test_batched_decode_over_quantized_cache(isa, q_dtype, quant, G, hkv, D):
    """One decode step of sequences of different lengths: each new row quantized exactly as
    kv_quant.quantize does, and the attention equal to the per-sequence chunk calls (bits) and
    to float64 over the dequantized values within rounding."""
    lens = DECODE_LENS if D == 64 else DECODE_LENS[:3]
    ps, dtype = 64, QUANT[quant]
    gen = torch.Generator().manual_seed(D + G)
    need = [L // ps + 1 for L in lens]
    npages = sum(need) + 2
    perm = torch.randperm(npages, generator=gen).to(torch.int32)
    tables = [perm[sum(need[:b]):sum(need[:b + 1])].clone() for b in range(len(lens))]
    kq = _quant_cache(npages, ps, hkv, D, dtype, gen)
    vq = _quant_cache(npages, ps, hkv, D, dtype, gen)
    for L, table in zip(lens, tables):
        if L:
            ca.write_kv(kq, vq, torch.randn(L, hkv, D, generator=gen),
                        torch.randn(L, hkv, D, generator=gen), table, 0, page_size=ps)
    B = len(lens)
    q = torch.randn(B, hkv * G, D, generator=gen).to(q_dtype)
    k = torch.randn(B, hkv, D, generator=gen).to(q_dtype)
    v = torch.randn(B, hkv, D, generator=gen).to(q_dtype)
    scale = D ** -0.5
    kq_ref, vq_ref = kq.clone(), vq.clone()
    ref = torch.empty_like(q)
    for b, L in enumerate(lens):
        ca.chunk_attention(isa, q[b:b + 1], kq_ref, vq_ref, tables[b], L, scale,
                           k_new=k[b:b + 1], v_new=v[b:b + 1], out=ref[b:b + 1], page_size=ps)
    out = torch.full_like(q, float("nan"))
    ca.decode_attention(isa, q, k, v, kq, vq, *ca.decode_tables(tables, lens), scale, out,
                        page_size=ps)
    as_bytes = (lambda t: t.view(torch.uint8))
    assert torch.equal(as_bytes(kq), as_bytes(kq_ref)) and torch.equal(as_bytes(vq), as_bytes(vq_ref))
    assert torch.equal(_bits(out), _bits(ref))
    for b, L in enumerate(lens):
        slot = int(tables[b][L // ps]) * ps + L % ps
        assert torch.equal(as_bytes(kq[slot]), as_bytes(quantize(k[b], dtype)))
        keys = _dequantized(kq, tables[b], L + 1, ps, torch.float32).double()
        values = _dequantized(vq, tables[b], L + 1, ps, torch.float32).double()
        want = reference_attention(q[b:b + 1].double(), keys, values, L, scale)
        assert (out[b:b + 1].double() - want).abs().max().item() <= _tolerance(want, q_dtype)


@pytest.mark.parametrize("quant", QUANT)
@pytest.mark.parametrize("isa,q_dtype", COMBOS)
def test_sharp_decode_over_quantized_cache(isa, q_dtype, quant):
    """A decode query whose softmax is peaked (q x 8: a few keys hold most of the weight, the
    rest span many octaves below them) and keys with rows of very different scales: the
    register decode paths round q and the weights against their largest values, so this is
    where they would lose most; still float64 attention within q's rounding."""
    L, G, hkv, D, ps = 700, 3, 3, 64, 64
    gen = torch.Generator().manual_seed(11)
    npages, table = _pages(L + 1, ps, gen)
    kq = _quant_cache(npages, ps, hkv, D, QUANT[quant], gen)
    vq = _quant_cache(npages, ps, hkv, D, QUANT[quant], gen)
    spread = torch.exp(torch.randn(L + 1, hkv, 1, generator=gen) * 2)  # row scales over ~e^+-6
    k = torch.randn(L + 1, hkv, D, generator=gen) * spread
    v = torch.randn(L + 1, hkv, D, generator=gen) * spread
    ca.write_kv(kq, vq, k, v, table, 0, page_size=ps)
    q = (torch.randn(1, hkv * G, D, generator=gen) * 8).to(q_dtype)
    out = ca.chunk_attention(isa, q, kq, vq, table, L, D ** -0.5, page_size=ps)
    keys = _dequantized(kq, table, L + 1, ps, torch.float32).double()
    values = _dequantized(vq, table, L + 1, ps, torch.float32).double()
    ref = reference_attention(q.double(), keys, values, L, D ** -0.5)
    assert (out.double() - ref).abs().max().item() <= _tolerance(ref, q_dtype)


@pytest.mark.parametrize("quant", QUANT)
def test_decode_quantizes_like_torch_on_awkward_rows(quant):
    """Rows of zeros, ties at half a step, values past fp8's range and subnormal codes: the
    kernel's quantization of a decode row is kv_quant.quantize's, byte for byte."""
    isa = next((i for i in ("avx512", "avx2") if _RUNS[i]), None)
    if isa is None:
        pytest.skip("no float32 vector kernel runs here")
    dtype, D, ps = QUANT[quant], 64, 32
    rows = torch.zeros(6, 1, D)
    rows[1, 0] = torch.arange(D) - 31.5  # ties at half a step for int8
    rows[2, 0] = torch.linspace(-1e4, 1e4, D)
    rows[3, 0, 0] = 448.0
    rows[3, 0, 1:] = torch.logspace(-6, 0, D - 1)  # fp8 subnormal codes
    rows[4, 0] = torch.randn(D, generator=torch.Generator().manual_seed(3)) * 1e-30
    rows[5, 0, ::2] = -3.0
    kq = torch.zeros((ps * 8, 1, D + 4), dtype=dtype)
    vq = torch.zeros_like(kq)
    tables = [torch.tensor([i], dtype=torch.int32) for i in range(6)]
    q = torch.randn(6, 1, D)
    out = torch.empty_like(q)
    ca.decode_attention(isa, q, rows, rows, kq, vq, *ca.decode_tables(tables, [5] * 6), 0.125,
                        out, page_size=ps)
    for b in range(6):
        got = kq[b * ps + 5].view(torch.uint8)
        assert torch.equal(got, quantize(rows[b], dtype).view(torch.uint8)), b


def test_quantized_cache_needs_its_page_size():
    isa = next((i for i in ca.ISAS if _RUNS[i]), None)
    if isa is None:
        pytest.skip("no vector kernel runs here")
    kq = torch.zeros((128, 1, 68), dtype=torch.int8)
    q = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    table = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="page_size must be a positive multiple of 32"):
        ca.chunk_attention(isa, q, kq, kq.clone(), table, 3, 0.125)
    with pytest.raises(ValueError, match="needs its page_size"):
        ca.write_kv(kq, kq.clone(), q.float(), q.float(), table, 0)


@pytest.mark.parametrize("quant", QUANT)
@pytest.mark.parametrize("isa,q_dtype", COMBOS)
def test_every_code_widens_exactly(isa, q_dtype, quant):
    """One key per KV head whose value row holds 64 of the 256 codes (fp8: every code but the
    two NaNs, subnormals and negative zero included): the output is that row, code x scale,
    bit for bit on the float32 kernels (p = 1 and the scale applied once) and within bf16
    rounding on bf16 ones."""
    dtype, D, ps, hkv = QUANT[quant], 64, 32, 4
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).reshape(hkv, D)
    if quant == "fp8_e4m3":
        codes[codes & 0x7f == 0x7f] = 0x00
    rows = torch.zeros(ps, hkv, D + 4, dtype=torch.uint8)
    rows[0, :, :D] = codes
    rows[0, :, D:] = torch.tensor([0.75, 3.0, 1e-3, 40.0]).view(torch.uint8).reshape(hkv, 4)
    vq = rows.view(dtype)
    kq = torch.zeros_like(rows).view(dtype)
    q = torch.zeros(1, hkv, D, dtype=q_dtype)
    out = ca.chunk_attention(isa, q, kq, vq, torch.zeros(1, dtype=torch.int32), 0, 0.125,
                             page_size=ps)
    want = dequantize(vq.view(torch.uint8)[0].view(dtype), torch.float32)
    if q_dtype == torch.float32:
        assert torch.equal(out[0], want)
    else:
        assert ((out[0].float() - want).abs() <= 2 ** -7 * want.abs()).all()  # two roundings
