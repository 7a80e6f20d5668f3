"""The vector attention kernels with unequal query groups per KV head (q_first: a TP rank
holding part of a KV head's query heads, as SmolLM2's 9 heads over 3 KV heads split 5:4):
chunks and decode rows against a float64 reference (a bf16 and an int8 cache too), the
batched decode step equal to
per-sequence chunks bit for bit, and bad maps refused with a sentence."""
import pytest
import torch

from pipefill.kernels import cpu_attention as ca
from pipefill.kernels.amx_attention import reference_attention

from cpu_paths import skip_without_flags

ISA = ca.best_kernel(bf16_dot=False)
# Skipped where this CPU lacks the flags of every float32 kernel (avx2, the least, needs the
# fewest); where it has them a kernel must run (cpu_paths.py): its test fails on ISA None.
pytestmark = skip_without_flags("avx2", (ISA is not None, "no vector attention kernel runs"),
                                ca.REQUIRED_CPU_FLAGS["avx2"])

# Rank 0 of 9 heads over 3 KV heads at a 5:4 split: query heads 0-2 on KV 0, 3-4 on KV 1;
# rank 1: head 5 on KV 1, heads 6-8 on KV 2.
GROUPS = [(3, 2), (1, 3)]


def _setup(L, C, q_per_kv, D=64, ps=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hkv, n = len(q_per_kv), L + C
    npages = (n + ps - 1) // ps + 2
    kc = torch.full((npages, hkv, ps, D), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    table = torch.randperm(npages, generator=gen).to(torch.int32)
    k, v = torch.randn(n, hkv, D, generator=gen), torch.randn(n, hkv, D, generator=gen)
    q = torch.randn(C, sum(q_per_kv), D, generator=gen)
    if L:
        ca.write_kv(kc, vc, k[:L], v[:L], table, 0)
    return q, k, v, kc, vc, table


def _reference(q, k, v, L, q_per_kv):
    """Every query head over its own KV head's keys (KV heads repeated per query head)."""
    kv_of_q = torch.repeat_interleave(torch.arange(len(q_per_kv)), torch.tensor(q_per_kv))
    return reference_attention(q.double(), k.double()[:, kv_of_q], v.double()[:, kv_of_q], L,
                               q.shape[-1] ** -0.5)


@pytest.mark.parametrize("q_per_kv", GROUPS)
@pytest.mark.parametrize("L,C", [(0, 45), (70, 33), (2100, 1)], ids=["first", "prefix",
                                                                    "split-decode"])
def test_unequal_groups_match_float64(q_per_kv, L, C):
    q, k, v, kc, vc, table = _setup(L, C, q_per_kv)
    first = ca.query_head_offsets(q_per_kv)
    out = ca.chunk_attention(ISA, q, kc, vc, table, L, 0.125, k_new=k[L:], v_new=v[L:],
                             q_first=first)
    ref = _reference(q, k, v, L, q_per_kv)
    assert (out.double() - ref).abs().max().item() < 5e-6 * max(1.0, ref.abs().max().item())


@skip_without_flags("avx512bf16", ca.kernel_available("avx512bf16"),
                    ca.REQUIRED_CPU_FLAGS["avx512bf16"])
@pytest.mark.parametrize("q_per_kv", GROUPS)
def test_bf16_kernel_takes_unequal_groups(q_per_kv):
    L, C = 70, 33
    q, k, v, kc, vc, table = _setup(L, C, q_per_kv)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    kc, vc = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    ca.write_kv(kc, vc, k[:L], v[:L], table, 0)
    out = ca.chunk_attention("avx512bf16", q, kc, vc, table, L, 0.125, k_new=k[L:],
                             v_new=v[L:], q_first=ca.query_head_offsets(q_per_kv))
    ref = _reference(q, k, v, L, q_per_kv)
    rounding = (ref.to(torch.bfloat16).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 1.5 * rounding + 2e-3


@pytest.mark.parametrize("q_per_kv", GROUPS)
def test_int8_cache_takes_unequal_groups(q_per_kv):
    """A quantized (token-major) cache: the same map, against float64 over its dequantized
    values, a prefill chunk after a prefix and a split-KV decode row."""
    from pipefill.kernels.kv_quant import dequantize, stored_dim
    gen, hkv, ps, D = torch.Generator().manual_seed(5), len(q_per_kv), 64, 64
    for L, C in [(70, 33), (2100, 1)]:
        n = L + C
        table = torch.randperm(n // ps + 2, generator=gen).to(torch.int32)
        kq, vq = (torch.zeros(len(table) * ps, hkv, stored_dim(D, torch.int8), dtype=torch.int8)
                  for _ in range(2))
        k, v = torch.randn(n, hkv, D, generator=gen), torch.randn(n, hkv, D, generator=gen)
        q = torch.randn(C, sum(q_per_kv), D, generator=gen)
        ca.write_kv(kq, vq, k, v, table, 0, page_size=ps)
        out = ca.chunk_attention(ISA, q, kq, vq, table, L, 0.125, page_size=ps,
                                 q_first=ca.query_head_offsets(q_per_kv))
        pos = torch.arange(n)
        slots = table.long()[pos // ps] * ps + pos % ps
        keys, values = (dequantize(c[slots], torch.float32) for c in (kq, vq))
        ref = _reference(q, keys, values, L, q_per_kv)
        assert (out.double() - ref).abs().max().item() < 5e-6 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("q_per_kv", GROUPS)
def test_batched_decode_equals_chunks_bit_for_bit(q_per_kv):
    lens, D = [40, 2100, 0], 64
    first = ca.query_head_offsets(q_per_kv)
    hkv, hq = len(q_per_kv), sum(q_per_kv)
    gen = torch.Generator().manual_seed(3)
    q0, k0, v0, kc, vc, table = _setup(2200, 1, q_per_kv)  # one shared cache of 70 pages
    tables = [table[:2], table[2:69], table[69:70]]
    for b, L in enumerate(lens):
        if L:
            ca.write_kv(kc, vc, k0[:L], v0[:L], tables[b], 0)
    q, k, v = (torch.randn(3, h, D, generator=gen) for h in (hq, hkv, hkv))
    ref, kc_ref, vc_ref = torch.empty_like(q), kc.clone(), vc.clone()
    for b, L in enumerate(lens):
        ca.chunk_attention(ISA, q[b:b + 1], kc_ref, vc_ref, tables[b], L, 0.125,
                           k_new=k[b:b + 1], v_new=v[b:b + 1], out=ref[b:b + 1], q_first=first)
    out = torch.full_like(q, float("nan"))
    ca.decode_attention(ISA, q, k, v, kc, vc, *ca.decode_tables(tables, lens), 0.125, out,
                        q_first=first)
    assert torch.equal(out, ref)
    assert torch.equal(kc.view(torch.int32), kc_ref.view(torch.int32))  # unwritten: NaN


@pytest.mark.parametrize("offsets, sentence", [
    ([0, 3, 5, 5], "expected a contiguous int32"),  # one more than the 2 KV heads
    ([0, 5, 5], "kv head 1 has no query head"),
    ([0, 3, 4], "q_first must run from 0 to the 5 q heads"),
])
def test_bad_maps_are_sentences(offsets, sentence):
    q, k, v, kc, vc, table = _setup(0, 4, (3, 2))
    with pytest.raises(RuntimeError, match=sentence):
        ca.chunk_attention(ISA, q, kc, vc, table, 0, 0.125, k_new=k, v_new=v,
                           q_first=torch.tensor(offsets, dtype=torch.int32))


def test_amx_is_refused_for_unequal_groups():
    from pipefill.model.attention import choose_backend
    with pytest.raises(ValueError, match="unequal query groups .* which the AMX kernel does not"):
        choose_backend("amx", torch.bfloat16, 64, 64, torch.device("cpu"),
                       unequal_groups=True)
