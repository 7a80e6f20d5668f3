"""The vector attention kernels under a sliding window (the query at p sees keys (p - window,
p], Gemma 3's local layers) and at head dim 256, against a float64 reference: packed bf16 and
float32 caches and quantized int8 and fp8_e4m3 ones, prefill chunks and batched decode, every
ISA path this CPU runs. Windows shorter than a page, crossing page edges, chunks starting
mid-window, decode batches of mixed lengths, split KV past 2048 visible keys. The pages wholly
before a query's window hold NaN (freed window pages, ARCHITECTURE.md 'Window pages'): any
read of them would show in the output."""
import pytest
import torch

from pipefill.kernels import cpu_attention as ca
from pipefill.kernels.kv_quant import dequantize, stored_dim

from cpu_paths import should_run, skip_without_flags

_STATUS = {isa: ca.kernel_available(isa) for isa in ca.ISAS}
QUANT = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
# Whether each kernel runs here or ought to (this CPU has its flags: a build that failed then
# fails the tests that run it, cpu_paths.py).
_RUNS = {isa: should_run(_STATUS[isa], ca.REQUIRED_CPU_FLAGS[isa]) for isa in ca.ISAS}


def needs(isa):
    return skip_without_flags(isa, _STATUS[isa], ca.REQUIRED_CPU_FLAGS[isa])


# (isa, q dtype, cache dtype): the bf16 kernel takes bf16 only; the float32 kernels take both.
PACKED = [pytest.param("avx512bf16", torch.bfloat16, torch.bfloat16, marks=needs("avx512bf16"))]
QUANTIZED = [pytest.param("avx512bf16", torch.bfloat16, marks=needs("avx512bf16"))]
for _isa in ("avx512", "avx2"):
    PACKED += [pytest.param(_isa, torch.float32, torch.float32, marks=needs(_isa)),
               pytest.param(_isa, torch.bfloat16, torch.bfloat16, marks=needs(_isa))]
    QUANTIZED += [pytest.param(_isa, qd, marks=needs(_isa)) for qd in (torch.float32, torch.bfloat16)]

# (prefix L, chunk C, group G, kv heads, head dim, page size, window; 0: none)
SHAPES = [
    (0, 37, 4, 1, 256, 32, 20),      # window shorter than a page, chunk from token 0
    (100, 77, 4, 1, 256, 64, 50),    # chunk starting mid-window, windows crossing page edges
    (517, 3, 3, 2, 128, 32, 40),     # a few rows past many freed pages
    (300, 200, 1, 2, 64, 64, 512),   # window longer than the prefix: the first rows see all
    (1000, 1, 4, 1, 256, 64, 512),   # one token, Gemma 3's shape
    (3000, 1, 2, 1, 256, 32, 2600),  # one token, split KV over the window's keys only (slow)
    (130, 77, 4, 1, 256, 64, 0),     # head dim 256 without a window
]


def cases(items, name):
    """pytest params of `items`, named by `name`; those past 2,048 keys are slow."""
    return [pytest.param(c, id=name.format(*c), marks=[pytest.mark.slow] if c[0] > 2048 else [])
            for c in items]


SHAPE_CASES = cases(SHAPES, "L{}-C{}-G{}-H{}-D{}-ps{}-w{}")


def reference(q, k, v, prefix_len, scale, window):
    """float64 softmax(q k^T * scale) v under the causal (bottom-right) and window masks."""
    C, Hq, _ = q.shape
    n, Hkv, _ = k.shape
    qd = q.double().transpose(0, 1)
    kd = k.double().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
    vd = v.double().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
    pos = prefix_len + torch.arange(C).unsqueeze(1)
    key = torch.arange(n).unsqueeze(0)
    hidden = (key > pos) | ((key <= pos - window) if window else False)
    s = (qd @ kd.transpose(1, 2) * scale).masked_fill(hidden, float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(0, 1)


def first_live_page(prefix_len, window, ps):
    """The first page a query at prefix_len still needs: the window tables free the ones before."""
    return max(0, prefix_len - window + 1) // ps if window else 0


def poison_freed(table, prefix_len, window, ps, poison):
    """The table with the pages wholly before the window pointing at the NaN page."""
    table = table.clone()
    table[:first_live_page(prefix_len, window, ps)] = poison
    return table


def tolerance(ref, q_dtype):
    if q_dtype == torch.float32:
        return 5e-6 * max(1.0, ref.abs().max().item())
    return 1.5 * (ref.to(torch.bfloat16).double() - ref).abs().max().item() + 2e-3


def packed_setup(n, hkv, D, ps, kv_dtype, gen):
    """A packed cache of NaN pages, one more than a sequence of n tokens needs (the last
    one, never in a table, stands for a freed page), and a shuffled page table."""
    npages = (n + ps - 1) // ps + 2
    kc = torch.full((npages, hkv, ps, D), float("nan"), dtype=kv_dtype)
    perm = torch.randperm(npages - 1, generator=gen).to(torch.int32)
    return kc, kc.clone(), perm, npages - 1


def quant_setup(n, hkv, D, ps, dtype, gen):
    """As packed_setup over a quantized token-major cache whose rows start as NaN scales."""
    npages = (n + ps - 1) // ps + 2
    rows = torch.randint(-127, 128, (npages * ps, hkv, stored_dim(D, dtype)), generator=gen,
                         dtype=torch.int8)
    rows.view(torch.uint8)[..., :D].clamp_(max=0x7e)  # no fp8 NaN codes
    rows[..., D:].view(torch.float32).fill_(float("nan"))
    perm = torch.randperm(npages - 1, generator=gen).to(torch.int32)
    return rows.view(dtype), rows.clone().view(dtype), perm, npages - 1


def dequantized(cache, table, n, ps):
    pos = torch.arange(n)
    slots = table.long()[pos // ps] * ps + pos % ps
    return dequantize(cache.view(torch.uint8)[slots].view(cache.dtype), torch.float32)


@pytest.mark.parametrize("isa,q_dtype,kv_dtype", PACKED)
@pytest.mark.parametrize("shape", SHAPE_CASES)
def test_window_chunk_over_packed_cache(isa, q_dtype, kv_dtype, shape):
    L, C, G, hkv, D, ps, window = shape
    gen = torch.Generator().manual_seed(L + C + D)
    kc, vc, table, poison = packed_setup(L + C, hkv, D, ps, kv_dtype, gen)
    k = torch.randn(L + C, hkv, D, generator=gen).to(kv_dtype)
    v = torch.randn(L + C, hkv, D, generator=gen).to(kv_dtype)
    q = torch.randn(C, hkv * G, D, generator=gen).to(q_dtype)
    if L:
        ca.write_kv(kc, vc, k[:L], v[:L], table, 0)
    live = poison_freed(table, L, window, ps, poison)
    out = ca.chunk_attention(isa, q, kc, vc, live, L, D ** -0.5, k_new=k[L:], v_new=v[L:],
                             window=window)
    ref = reference(q, k, v, L, D ** -0.5, window)
    assert (out.double() - ref).abs().max().item() <= tolerance(ref, q_dtype), shape


@pytest.mark.parametrize("quant", QUANT)
@pytest.mark.parametrize("isa,q_dtype", QUANTIZED)
@pytest.mark.parametrize("shape", SHAPE_CASES)
def test_window_chunk_over_quantized_cache(isa, q_dtype, quant, shape):
    L, C, G, hkv, D, ps, window = shape
    gen = torch.Generator().manual_seed(L + C + D)
    kq, vq, table, poison = quant_setup(L + C, hkv, D, ps, QUANT[quant], gen)
    k = torch.randn(L + C, hkv, D, generator=gen)
    v = torch.randn(L + C, hkv, D, generator=gen)
    q = torch.randn(C, hkv * G, D, generator=gen).to(q_dtype)
    if L:
        ca.write_kv(kq, vq, k[:L], v[:L], table, 0, page_size=ps)
    live = poison_freed(table, L, window, ps, poison)
    out = ca.chunk_attention(isa, q, kq, vq, live, L, D ** -0.5, k_new=k[L:].to(q_dtype),
                             v_new=v[L:].to(q_dtype), page_size=ps, window=window)
    keys, values = (dequantized(c, table, L + C, ps) for c in (kq, vq))  # code x scale
    ref = reference(q, keys, values, L, D ** -0.5, window)
    assert (out.double() - ref).abs().max().item() <= tolerance(ref, q_dtype), (quant, shape)


# One decode step of sequences of mixed lengths under one window: none before it, inside it,
# at a page edge, far past it, and (window 2600) past the split threshold.
DECODE = [(64, 4, 1, 256, 32, [0, 5, 63, 64, 100, 700]),
          (40, 3, 2, 128, 64, [39, 40, 41, 300]),
          (2600, 2, 1, 256, 64, [3000, 100])]
DECODE_CASES = cases(DECODE, "w{}-G{}-H{}-D{}-ps{}")


def decode_case(window, G, hkv, D, ps, lens, setup, write, dtype, q_dtype, gen):
    """Sequences on their own pages of one cache, prefixes written, freed pages poisoned,
    and one step's q, k, v."""
    need = [L // ps + 1 for L in lens]
    kc, vc, perm, poison = setup(sum(need) * ps, hkv, D, ps, dtype, gen)
    tables, at, keys, values = [], 0, [], []
    for L, n in zip(lens, need):
        table = perm[at:at + n].clone()
        at += n
        keys.append(torch.randn(L + 1, hkv, D, generator=gen).to(q_dtype))
        values.append(torch.randn(L + 1, hkv, D, generator=gen).to(q_dtype))
        if L:
            write(kc, vc, keys[-1][:L], values[-1][:L], table)
        tables.append(table)
    live = [poison_freed(t, L, window, ps, poison) for t, L in zip(tables, lens)]
    q = torch.randn(len(lens), hkv * G, D, generator=gen).to(q_dtype)
    k = torch.stack([x[-1] for x in keys])
    v = torch.stack([x[-1] for x in values])
    return kc, vc, tables, live, q, k, v


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def check_decode(isa, q_dtype, case, lens, window, page_size, dequant):
    """decode_attention equals per-sequence chunk_attention calls to the bit, and float64
    within rounding."""
    kc, vc, tables, live, q, k, v = case
    D = q.shape[-1]
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = torch.empty_like(q)
    for b, L in enumerate(lens):
        ca.chunk_attention(isa, q[b:b + 1], kc_ref, vc_ref, live[b], L, D ** -0.5,
                           k_new=k[b:b + 1], v_new=v[b:b + 1], out=ref[b:b + 1],
                           page_size=page_size, window=window)
    out = torch.full_like(q, float("nan"))
    ca.decode_attention(isa, q, k, v, kc, vc, *ca.decode_tables(live, lens), D ** -0.5, out,
                        page_size=page_size, window=window)
    assert torch.equal(_bits(out), _bits(ref))
    for b, L in enumerate(lens):
        keys, values = dequant(kc, vc, tables[b], L + 1)
        exact = reference(q[b:b + 1], keys, values, L, D ** -0.5, window)
        assert (out[b:b + 1].double() - exact).abs().max().item() <= tolerance(exact, q.dtype), L


@pytest.mark.parametrize("isa,q_dtype,kv_dtype", PACKED)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_window_decode_batch_over_packed_cache(isa, q_dtype, kv_dtype, case):
    window, G, hkv, D, ps, lens = case
    gen = torch.Generator().manual_seed(window + D)
    data = decode_case(window, G, hkv, D, ps, lens, packed_setup,
                       lambda kc, vc, k, v, t: ca.write_kv(kc, vc, k, v, t, 0), kv_dtype,
                       q_dtype, gen)
    check_decode(isa, q_dtype, data, lens, window, 0,
                 lambda kc, vc, t, n: ca.read_kv(kc, vc, t, n))


@pytest.mark.parametrize("quant", QUANT)
@pytest.mark.parametrize("isa,q_dtype", QUANTIZED)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_window_decode_batch_over_quantized_cache(isa, q_dtype, quant, case):
    window, G, hkv, D, ps, lens = case
    gen = torch.Generator().manual_seed(window + D)
    data = decode_case(window, G, hkv, D, ps, lens, quant_setup,
                       lambda kc, vc, k, v, t: ca.write_kv(kc, vc, k, v, t, 0, page_size=ps),
                       QUANT[quant], q_dtype, gen)
    check_decode(isa, q_dtype, data, lens, window, ps,
                 lambda kc, vc, t, n: (dequantized(kc, t, n, ps), dequantized(vc, t, n, ps)))


def test_bad_window_is_a_sentence():
    isa = next((i for i in ("avx512", "avx2") if _RUNS[i]), None)
    if isa is None:
        pytest.skip("no float32 vector kernel runs here")
    gen = torch.Generator().manual_seed(0)
    kc, vc, table, _ = packed_setup(40, 1, 64, 32, torch.float32, gen)
    q = torch.randn(1, 1, 64)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ca.chunk_attention(isa, q, kc, vc, table, 3, 0.125, window=-1)
