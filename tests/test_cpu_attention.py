"""The vector attention kernels (avx512bf16, avx512, avx2) against a float64 reference, their
cache packing, repeatability across thread counts, and the engine end to end (HF parity,
--kv-cache-dtype, forced fallbacks by hiding CPU flags). Kernels this CPU cannot run are
skipped with the reason."""
import random

import pytest
import torch

from pipefill.kernels import cpu_attention as ca
from pipefill.kernels.amx_attention import reference_attention

_STATUS = {isa: ca.kernel_available(isa) for isa in ca.ISAS}


def needs(isa):
    ok, why = _STATUS[isa]
    return pytest.mark.skipif(not ok, reason=f"{isa} kernel cannot run here: {why}")


# (isa, q dtype, cache dtype): the bf16 kernel takes bf16 only; the float32 kernels take both.
COMBOS = [pytest.param("avx512bf16", torch.bfloat16, torch.bfloat16, marks=needs("avx512bf16"))]
for _isa in ("avx512", "avx2"):
    for _qd, _kd in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                     (torch.bfloat16, torch.bfloat16)):
        COMBOS.append(pytest.param(_isa, _qd, _kd, marks=needs(_isa)))

# (prefix L, chunk C, group G, kv heads, head dim, page size)
SHAPES = [
    (0, 1, 1, 1, 64, 64),      # first token alone
    (0, 37, 3, 3, 64, 64),     # prefix 0, chunk not a multiple of 16
    (100, 1, 3, 3, 64, 64),    # decode at a prefix that is not page-aligned
    (130, 77, 4, 2, 128, 64),  # D = 128
    (0, 300, 8, 1, 64, 32),    # G = 8, page size 32
    (1000, 200, 3, 3, 64, 64),
    (64, 64, 1, 2, 128, 128),  # page-aligned prefix and chunk
    (517, 3, 8, 2, 64, 64),
]


def _setup(L, C, G, hkv, D, ps, kv_dtype, q_dtype, seed=0, spike=False):
    gen = torch.Generator().manual_seed(seed)
    n = L + C
    npages = (n + ps - 1) // ps + 3
    kc = torch.full((npages, hkv, ps, D), float("nan"), dtype=kv_dtype)  # unwritten = NaN
    vc = torch.full_like(kc, float("nan"))
    table = torch.randperm(npages, generator=gen).to(torch.int32)  # shuffled pages
    k = torch.randn(n, hkv, D, generator=gen).to(kv_dtype)
    v = torch.randn(n, hkv, D, generator=gen).to(kv_dtype)
    q = torch.randn(C, hkv * G, D, generator=gen).to(q_dtype)
    if spike:  # late keys with large logits exercise the lazy rescale
        k[n // 2:] *= 6
    if L:
        ca.write_kv(kc, vc, k[:L], v[:L], table, 0)
    return q, k, v, kc, vc, table


def _tolerance(ref, q_dtype):
    if q_dtype == torch.float32:
        return 5e-6 * max(1.0, ref.abs().max().item())
    # bf16 output: the rounding of the result itself, plus bf16 probabilities.
    return 1.5 * (ref.to(torch.bfloat16).double() - ref).abs().max().item() + 2e-3


@pytest.mark.parametrize("isa,q_dtype,kv_dtype", COMBOS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}-C{}-G{}-H{}-D{}-ps{}".format(*s))
def test_kernel_matches_float64(isa, q_dtype, kv_dtype, shape):
    L, C, G, hkv, D, ps = shape
    q, k, v, kc, vc, table = _setup(L, C, G, hkv, D, ps, kv_dtype, q_dtype)
    out = ca.chunk_attention(isa, q, kc, vc, table, L, D ** -0.5, k_new=k[L:], v_new=v[L:])
    assert out.dtype == q_dtype and out.shape == q.shape
    ref = reference_attention(q.double(), k.double(), v.double(), L, D ** -0.5)
    err = (out.double() - ref).abs().max().item()
    assert err <= _tolerance(ref, q_dtype), (isa, shape, err)


@pytest.mark.parametrize("isa,q_dtype,kv_dtype", COMBOS)
def test_lazy_rescale_and_small_qtile(isa, q_dtype, kv_dtype):
    L, C, G, hkv, D, ps = 700, 150, 3, 1, 64, 64
    q, k, v, kc, vc, table = _setup(L, C, G, hkv, D, ps, kv_dtype, q_dtype, spike=True)
    ref = reference_attention(q.double(), k.double(), v.double(), L, D ** -0.5)
    for qtile in (1, 5, 0):
        out = ca.chunk_attention(isa, q, kc, vc, table, L, D ** -0.5, k_new=k[L:], v_new=v[L:],
                                 qtile=qtile)
        assert (out.double() - ref).abs().max().item() <= _tolerance(ref, q_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_write_read_roundtrip(kv_dtype):
    if not any(ok for ok, _ in _STATUS.values()):
        pytest.skip("no vector kernel runs here")
    q, k, v, kc, vc, table = _setup(150, 20, 1, 2, 64, 64, kv_dtype, torch.float32)
    ca.write_kv(kc, vc, k[150:], v[150:], table, 150)
    rk, rv = ca.read_kv(kc, vc, table, 170)
    assert torch.equal(rk, k) and torch.equal(rv, v)


@pytest.mark.parametrize("isa,q_dtype,kv_dtype", COMBOS)
def test_bit_identical_across_threads(isa, q_dtype, kv_dtype):
    L, C, G, hkv, D, ps = 300, 200, 3, 3, 64, 64
    q, k, v, kc, vc, table = _setup(L, C, G, hkv, D, ps, kv_dtype, q_dtype)
    ca.write_kv(kc, vc, k[L:], v[L:], table, L)
    saved = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 8, 2):
            torch.set_num_threads(n)
            outs.append(ca.chunk_attention(isa, q, kc, vc, table, L, D ** -0.5))
    finally:
        torch.set_num_threads(saved)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_bad_arguments_are_sentences():
    isa = next((i for i in ("avx512", "avx2") if _STATUS[i][0]), None)
    if isa is None:
        pytest.skip("no float32 vector kernel runs here")
    q, k, v, kc, vc, table = _setup(0, 4, 1, 1, 64, 64, torch.float32, torch.float32)
    with pytest.raises(RuntimeError, match="page_table"):
        ca.chunk_attention(isa, q, kc, vc, table[:0], 64, 0.125)
    with pytest.raises(ValueError, match="unknown kernel"):
        ca.chunk_attention("sse2", q, kc, vc, table, 0, 0.125)
    if _STATUS["avx512bf16"][0]:
        with pytest.raises(RuntimeError, match="needs bfloat16"):
            ca.chunk_attention("avx512bf16", q, kc, vc, table, 0, 0.125, k_new=k, v_new=v)


def test_hidden_flags_make_a_kernel_unavailable():
    for isa in ca.ISAS:
        hidden = ca.cpu_flags() - set(ca.REQUIRED_CPU_FLAGS[isa][:1])
        ok, why = ca.kernel_available(isa, frozenset(hidden))
        assert not ok and ca.REQUIRED_CPU_FLAGS[isa][0] in why
    assert ca.best_kernel(frozenset()) is None
