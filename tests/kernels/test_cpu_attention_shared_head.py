"""A KV head shared by two TP ranks and split by keys at decode (decode_attention's `shared`,
merge_gathered): 9 query heads over 3 KV heads as two ranks hold them at a 5:4 split, each
rank attending with the straddled group's three query heads over its half of that head's
split parts; the merged rows and every other row equal one call over all three KV heads bit
for bit, and each rank's cache gets the new token of both its heads. Bad arguments are
sentences."""
import pytest
import torch

from pipefill.kernels import cpu_attention as ca

from cpu_paths import skip_without_flags

ISA = ca.best_kernel(bf16_dot=False)
# Skipped where this CPU lacks the flags of every float32 kernel (avx2 needs the fewest);
# where it has them a kernel must run (cpu_paths.py): its tests fail on ISA None.
pytestmark = skip_without_flags("avx2", (ISA is not None, "no vector attention kernel runs"),
                                ca.REQUIRED_CPU_FLAGS["avx2"])

D, PS = 64, 32
# Rank r holds KV heads KV[r] and attends with query heads QUERIES[r] (its own and the
# straddled group's other ones); the shared head is its local KV head SHARED[r].
KV = [slice(0, 2), slice(1, 3)]
QUERIES = [slice(0, 6), slice(3, 9)]
SHARED = [1, 0]


def _cache(lens, dtype, seed=0):
    """One packed cache of 3 KV heads holding every sequence's first lens[b] tokens."""
    gen = torch.Generator().manual_seed(seed)
    pages = [(L + 1 + PS - 1) // PS for L in lens]
    kc = torch.full((sum(pages) + 1, 3, PS, D), float("nan"), dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    perm = torch.randperm(sum(pages), generator=gen).to(torch.int32)
    tables, start = [], 0
    for L, n in zip(lens, pages):
        tables.append(perm[start:start + n])
        start += n
        k, v = (torch.randn(L, 3, D, generator=gen).to(dtype) for _ in range(2))
        ca.write_kv(kc, vc, k, v, tables[-1], 0)
    q = torch.randn(len(lens), 9, D, generator=gen).to(dtype)
    k, v = (torch.randn(len(lens), 3, D, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, kc, vc, tables


def _split_decode(q, k, v, kc, vc, tables, lens):
    """The two ranks' decode steps, their partials gathered (stacked here) and merged."""
    step = ca.decode_tables(tables, lens)
    parts = ca.decode_parts(step[1], 2)  # each rank's cache holds 2 KV heads
    first = parts // 2  # rank 0 takes parts [0, first), rank 1 the rest
    counts = torch.stack([first, parts - first])
    slots = int(counts.max())
    outs, partials, caches = [], [], []
    for r in range(2):
        ranges = torch.stack([torch.zeros_like(first), first] if r == 0 else [first, parts], 1)
        partial = torch.zeros(len(lens), slots, 3, D + 2)
        cache = (kc[:, KV[r]].contiguous(), vc[:, KV[r]].contiguous())
        out = torch.full_like(q[:, QUERIES[r]], float("nan"))
        ca.decode_attention(ISA, q[:, QUERIES[r]].contiguous(), k[:, KV[r]].contiguous(),
                            v[:, KV[r]].contiguous(), *cache, *step, 0.125, out,
                            shared=(SHARED[r], ranges.contiguous(), partial))
        outs.append(out), partials.append(partial), caches.append(cache)
    gathered = torch.stack(partials)
    for r in range(2):
        ca.merge_gathered(gathered, counts, outs[r], SHARED[r] * 3)
    return outs, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_head_split_by_keys_equals_one_call(dtype):
    lens = [2100, 5000, 4097]  # 3, 5 and 5 parts of 1,024 keys
    q, k, v, kc, vc, tables = _cache(lens, dtype)
    ref, kc_ref, vc_ref = torch.empty_like(q), kc.clone(), vc.clone()
    ca.decode_attention(ISA, q, k, v, kc_ref, vc_ref, *ca.decode_tables(tables, lens), 0.125, ref)
    outs, caches = _split_decode(q, k, v, kc, vc, tables, lens)
    for r in range(2):
        assert torch.equal(outs[r], ref[:, QUERIES[r]])
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # NaN where unwritten
        for got, want in zip(caches[r], (kc_ref, vc_ref)):
            assert torch.equal(got.view(bits), want[:, KV[r]].contiguous().view(bits))


def test_split_parts_follow_the_one_part_size():
    """The glue is built with cpu_attention.DECODE_KV_PART (what the planner and the shared
    head's rule read without a build): more than two parts' keys are split, into parts of it."""
    part = ca.DECODE_KV_PART
    assert ca.built_kv_part() == part
    keys = torch.tensor([1, 2 * part, 2 * part + 1, 3 * part, 3 * part + 1, 7 * part])
    assert ca.decode_parts(keys - 1, 2).tolist() == [1, 1, 3, 3, 4, 7]
    # One KV head (one work item unsplit): halves of whole 64-key steps from 257 keys on, up
    # to the same parts past 2 * part keys.
    keys = torch.tensor([256, 257, 512, 2 * part, 2 * part + 1, 3 * part + 1])
    assert ca.decode_parts(keys - 1, 1).tolist() == [1, 2, 2, 2, 3, 4]


def test_bad_shared_arguments_are_sentences():
    lens = [100]
    q, k, v, kc, vc, tables = _cache(lens, torch.float32)
    step = ca.decode_tables(tables, lens)
    out = torch.empty_like(q)
    partial = torch.zeros(1, 1, 3, D + 2)
    with pytest.raises(RuntimeError, match="too few to be split into parts"):
        ca.decode_attention(ISA, q, k, v, kc, vc, *step, 0.125, out,
                            shared=(1, torch.tensor([[0, 1]]), partial))
    with pytest.raises(RuntimeError, match="is not one of the 3 kv heads"):
        ca.decode_attention(ISA, q, k, v, kc, vc, *step, 0.125, out,
                            shared=(3, torch.tensor([[0, 1]]), partial))
    with pytest.raises(RuntimeError, match="shared_out: expected a contiguous float32"):
        ca.decode_attention(ISA, q, k, v, kc, vc, *step, 0.125, out,
                            shared=(1, torch.tensor([[0, 1]]), partial[..., :D]))
    with pytest.raises(RuntimeError, match="needs equal query groups"):
        ca.decode_attention(ISA, q[:, :8], k, v, kc, vc, *step, 0.125, out[:, :8],
                            q_first=ca.query_head_offsets((3, 3, 2)),
                            shared=(1, torch.tensor([[0, 1]]), partial))
    lens = [3000]
    q, k, v, kc, vc, tables = _cache(lens, torch.float32)
    with pytest.raises(RuntimeError, match=r"is not a range of at most 1 of its 3 parts"):
        ca.decode_attention(ISA, q, k, v, kc, vc, *ca.decode_tables(tables, lens), 0.125, out,
                            shared=(1, torch.tensor([[0, 2]]), partial))
