"""The fused AMX chunk attention (pipefill.kernels.amx_attention) against float64 attention."""
from __future__ import annotations

import math

import pytest
import torch

from pipefill.kernels import amx_attention as amx

from cpu_paths import skip_without_flags

# Skipped where this CPU lacks AMX's flags; where it has them the kernel must run (cpu_paths.py).
needs_amx = skip_without_flags("AMX attention", amx.amx_available(), amx.REQUIRED_CPU_FLAGS)

POISON = float("nan")


def make_case(L, C, hkv, G, D, *, page_size=64, shuffle=False, seed=0, spare_pages=3,
              garbage=True, spike=False):
    """Random q/k/v, a packed cache holding tokens [0, L + C) and its page table."""
    gen = torch.Generator().manual_seed(seed)
    n = L + C
    npages = math.ceil(n / page_size)
    total = npages + spare_pages
    cache = amx.AmxKVCache(1, total, page_size, hkv, D)
    if garbage:  # unwritten slots hold NaN: the kernel must never let them reach the output
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
    perm_gen = torch.Generator().manual_seed(seed + 12345)  # independent of the data
    order = torch.randperm(total, generator=perm_gen) if shuffle else torch.arange(total)
    table = order[:npages].to(torch.int32)
    k = torch.randn(n, hkv, D, generator=gen).bfloat16()
    v = torch.randn(n, hkv, D, generator=gen).bfloat16()
    q = torch.randn(C, hkv * G, D, generator=gen).bfloat16()
    if spike:  # the last C // 3 keys get a logit ~ +30 for every query: forces the lazy rescale
        q[:, :, 0] = 4.0
        k[n - max(1, C // 3):, :, 0] = 60.0
    kc, vc = cache.layer(0)
    if L:
        amx.write_kv(kc, vc, k[:L], v[:L], table, 0)
    amx.write_kv(kc, vc, k[L:], v[L:], table, L)
    return q, k, v, kc, vc, table


def run_kernel(q, kc, vc, table, L, scale, **kw):
    out = torch.full_like(q, POISON)
    res = amx.chunk_attention(q, kc, vc, table, L, scale, out=out, **kw)
    assert res.data_ptr() == out.data_ptr()
    return out


def check_close(out, q, k, v, L, scale, tol=1e-2):
    ref = amx.reference_attention(q, k, v, L, scale)
    assert not torch.isnan(out).any(), "NaN (or unwritten poisoned rows) in the output"
    err = (out.double() - ref).abs().max().item()
    rel = err / ref.abs().max().item()
    assert rel < tol, f"relative error {rel:.3e} (abs {err:.3e})"
    return rel


def test_force_disable():
    ok, why = amx.amx_available(force_disable=True)
    assert ok is False and "disabled" in why
    saved = amx.FORCE_DISABLE
    try:
        amx.FORCE_DISABLE = True
        ok, why = amx.amx_available()
        assert ok is False and why
    finally:
        amx.FORCE_DISABLE = saved


def test_available_returns_reason():
    ok, why = amx.amx_available()
    assert isinstance(ok, bool) and isinstance(why, str) and why


def test_geometry_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        amx.AmxKVCache(1, 4, 48, 1, 64)
    with pytest.raises(ValueError, match="head_dim"):
        amx.AmxKVCache(1, 4, 64, 1, 96)


# (L, C): decode, L = 0, C not a multiple of the 32-token tile, L not a multiple of the page.
SHAPES = [(0, 1), (0, 7), (0, 32), (0, 33), (5, 1), (63, 1), (64, 1), (1000, 1), (5, 7),
          (31, 33), (64, 64), (100, 50), (127, 129), (200, 300), (1000, 77), (0, 300)]


@needs_amx
@pytest.mark.parametrize("L,C", SHAPES)
def test_shapes_gqa3_d64(L, C):
    q, k, v, kc, vc, table = make_case(L, C, 3, 3, 64, shuffle=True, seed=L * 7 + C)
    out = run_kernel(q, kc, vc, table, L, 64 ** -0.5)
    check_close(out, q, k, v, L, 64 ** -0.5)


@needs_amx
@pytest.mark.parametrize("G", [1, 3, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("L,C", [(0, 45), (70, 1), (150, 97)])
def test_gqa_and_head_dim(G, D, L, C):
    q, k, v, kc, vc, table = make_case(L, C, 2, G, D, seed=G * 100 + D + L)
    out = run_kernel(q, kc, vc, table, L, D ** -0.5)
    check_close(out, q, k, v, L, D ** -0.5)


@needs_amx
@pytest.mark.parametrize("page_size", [32, 96, 128])
def test_page_sizes(page_size):
    q, k, v, kc, vc, table = make_case(333, 90, 3, 3, 64, page_size=page_size, shuffle=True)
    check_close(run_kernel(q, kc, vc, table, 333, 0.125), q, k, v, 333, 0.125)


@needs_amx
def test_lazy_rescale_spike():
    q, k, v, kc, vc, table = make_case(700, 150, 3, 3, 64, spike=True)
    check_close(run_kernel(q, kc, vc, table, 700, 0.125), q, k, v, 700, 0.125)


@needs_amx
def test_write_kv_roundtrip_and_chunked_prefill():
    """Chunks written one after another (the engine's chunked prefill), attended after each."""
    hkv, G, D, ps = 3, 3, 64, 64
    chunks = [100, 1, 37, 64, 200, 1]
    n = sum(chunks)
    gen = torch.Generator().manual_seed(1)
    npages = math.ceil(n / ps)
    cache = amx.AmxKVCache(2, npages + 2, ps, hkv, D)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    table = torch.randperm(npages + 2, generator=gen)[:npages].to(torch.int32)
    k = torch.randn(n, hkv, D, generator=gen).bfloat16()
    v = torch.randn(n, hkv, D, generator=gen).bfloat16()
    q = torch.randn(n, hkv * G, D, generator=gen).bfloat16()
    kc, vc = cache.layer(1)
    L = 0
    for C in chunks:
        # k_new/v_new given: chunk_attention writes them first
        out = torch.full((C, hkv * G, D), POISON, dtype=torch.bfloat16)
        amx.chunk_attention(q[L:L + C], kc, vc, table, L, 0.125, k_new=k[L:L + C],
                            v_new=v[L:L + C], out=out)
        check_close(out, q[L:L + C], k[:L + C], v[:L + C], L, 0.125)
        L += C
    k_back, v_back = amx.read_kv(kc, vc, table, n)
    assert torch.equal(k_back, k) and torch.equal(v_back, v)


@needs_amx
def test_strided_inputs_and_fresh_output():
    """q and k_new/v_new as views into a fused qkv projection (non-contiguous tokens)."""
    hkv, G, D, L, C = 2, 4, 64, 90, 70
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(L + C, (hkv * G + 2 * hkv) * D, generator=gen).bfloat16()
    q_all = qkv[:, :hkv * G * D].view(L + C, hkv * G, D)
    k = qkv[:, hkv * G * D:(hkv * G + hkv) * D].view(L + C, hkv, D)
    v = qkv[:, (hkv * G + hkv) * D:].view(L + C, hkv, D)
    cache = amx.AmxKVCache(1, 4, 64, hkv, D)
    table = torch.tensor([3, 1, 2], dtype=torch.int32)
    kc, vc = cache.layer(0)
    amx.write_kv(kc, vc, k[:L], v[:L], table, 0)
    amx.write_kv(kc, vc, k[L:], v[L:], table, L)
    q = q_all[L:]
    assert not q.is_contiguous()
    out = amx.chunk_attention(q, kc, vc, table, L, 0.125)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    check_close(out, q, k, v, L, 0.125)


@needs_amx
def test_shuffled_pages_identical():
    kw = dict(L=500, C=130, hkv=3, G=3, D=64, seed=5)
    q, k, v, kc, vc, table = make_case(**kw, shuffle=False)
    q2, _, _, kc2, vc2, table2 = make_case(**kw, shuffle=True)
    assert not torch.equal(table, table2)
    a = run_kernel(q, kc, vc, table, 500, 0.125)
    b = run_kernel(q2, kc2, vc2, table2, 500, 0.125)
    assert torch.equal(a, b)


@needs_amx
def test_repeatable_and_oversubscribed():
    q, k, v, kc, vc, table = make_case(900, 200, 3, 3, 64, shuffle=True, seed=9)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        first = run_kernel(q, kc, vc, table, 900, 0.125)
        check_close(first, q, k, v, 900, 0.125)
        for threads in (2, 8):  # 8 threads on fewer cores: oversubscription stress
            torch.set_num_threads(threads)
            for _ in range(5):
                assert torch.equal(run_kernel(q, kc, vc, table, 900, 0.125), first)
    finally:
        torch.set_num_threads(saved)


@needs_amx
def test_bad_arguments():
    q, k, v, kc, vc, table = make_case(10, 10, 1, 1, 64)
    with pytest.raises(RuntimeError, match="page_table"):
        amx.chunk_attention(q, kc, vc, table[:0], 10, 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        amx.chunk_attention(q, kc, vc, torch.tensor([99], dtype=torch.int32), 10, 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        amx.chunk_attention(torch.zeros(3, 3, 64, dtype=torch.bfloat16),
                            *amx.AmxKVCache(1, 2, 64, 2, 64).layer(0), table, 0, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx.chunk_attention(q.float(), kc, vc, table, 10, 0.125)


@needs_amx
@pytest.mark.slow
@pytest.mark.parametrize("L", [2048, 16384])
def test_long_prefix_chunk(L):
    C, hkv, G, D = 2048, 3, 3, 64
    q, k, v, kc, vc, table = make_case(L, C, hkv, G, D, shuffle=True, seed=L, garbage=False)
    out = run_kernel(q, kc, vc, table, L, D ** -0.5)
    # float64 reference one kv head at a time to bound memory
    for g in range(hkv):
        hs = slice(g * G, (g + 1) * G)
        ref = amx.reference_attention(q[:, hs], k[:, g:g + 1], v[:, g:g + 1], L, D ** -0.5)
        rel = (out[:, hs].double() - ref).abs().max().item() / ref.abs().max().item()
        assert rel < 1e-2
