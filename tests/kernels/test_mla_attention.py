"""The latent (MLA) decode attention kernel (kernels/mla_attention.py) against model/mla.py's
absorbed attention in torch, on every path this CPU runs (each forced in turn): bfloat16 and
float32 caches, odd latent widths and head counts that are not multiples of the 16-head tile,
one call for a batch of sequences of different lengths (long ones cut into parts and merged),
scattered slots, and through latent_attention beside a prefill chunk."""
import pytest
import torch

from pipefill.kernels import mla_attention
from pipefill.kernels.kv_quant_attention import slot_index
from pipefill.model.attention import SeqMeta
from pipefill.model.mla import (LatentAttention, LatentUp, absorbed, absorbed_decode,
                                decode_index, latent_attention, read_latent, write_latent)

from cpu_paths import need

SLOTS = 6000
TABLE = torch.zeros(1, dtype=torch.int32)  # page tables: not read on these paths


def _usable(isa: str) -> None:
    need(isa, mla_attention.isa_status()[isa], mla_attention.ISA_CPU_FLAGS[isa])


def _best() -> str:
    """The path decode takes here; the scalar one needs no flags, so one must run."""
    isa = mla_attention.decode_isa()
    if isa is None:
        _usable("scalar")
    return isa


def _setup(heads, nope, rope, v, rank, lens, dtype, seed):
    """A random layer, a cache of random latents in `dtype`, each sequence's read slots (the
    first a slice, the others scattered) and its query row."""
    gen = torch.Generator().manual_seed(seed)
    width = rank + rope
    half = (width + 1) // 2
    k_cache = (torch.randn(SLOTS, 1, half, generator=gen)).to(dtype)
    v_cache = (torch.randn(SLOTS, 1, half, generator=gen)).to(dtype)
    reads = [torch.randperm(SLOTS, generator=gen)[:n] for n in lens]
    reads[0] = slice(7, 7 + lens[0])
    up = LatentUp(torch.randn(heads * (nope + v), rank, generator=gen) * 0.1, heads, nope, v)
    q_nope = torch.randn(len(lens), heads, nope, generator=gen)
    q_pe = torch.randn(len(lens), heads, rope, generator=gen)
    return up, k_cache, v_cache, reads, q_nope, q_pe, width


def _decode_index(reads, lens):
    """The kernel's (slots, offsets) for one decode row per sequence (mla.decode_index)."""
    seqs = [SeqMeta(b, 1, n - 1, slice(0, 0), read, TABLE)
            for b, (read, n) in enumerate(zip(reads, lens))]
    return decode_index(seqs, {})[1]


@pytest.mark.parametrize("isa", mla_attention.ISAS)
@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,nope,rope,v,rank,lens", [
    (3, 10, 6, 14, 21, [1]),                    # an odd latent (27), one token
    (3, 10, 6, 14, 22, [45, 2, 300]),           # 300 tokens: two parts
    (20, 8, 4, 6, 30, [5000, 33]),              # 20 heads (two tiles); 5000: 16 parts
    (16, 128, 64, 128, 512, [1, 257, 64]),      # DeepSeek-V2-Lite's shapes
])
def test_kernel_equals_absorbed_in_torch(isa, cache, heads, nope, rope, v, rank, lens):
    _usable(isa)
    up, k_cache, v_cache, reads, q_nope, q_pe, width = _setup(heads, nope, rope, v, rank, lens,
                                                              cache, sum(lens) + heads)
    got = absorbed_decode(q_nope, q_pe, k_cache, v_cache, _decode_index(reads, lens), up, 0.3,
                          isa)
    assert got.shape == (len(lens), heads, v) and got.dtype == torch.float32
    for b, read in enumerate(reads):
        latent = read_latent(k_cache, v_cache, read, width, torch.float32)
        want = absorbed(q_nope[b:b + 1], q_pe[b:b + 1], latent, up, 0.3)
        # float32 sums in another order: scores of ~25 (576-term dots) carry ~1e-5 of it
        # into the softmax.
        torch.testing.assert_close(got[b:b + 1], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", mla_attention.ISAS)
def test_kernel_in_bfloat16_compute(isa):
    """bf16 queries and cache (a bf16 model; avx512bf16 multiplies bf16 pairs): within bf16
    rounding of torch's bf16 path. An odd latent (63 + 16), 20 heads, an odd token count."""
    _usable(isa)
    lens = [700, 3]
    up, k_cache, v_cache, reads, q_nope, q_pe, width = _setup(20, 32, 16, 24, 63, lens,
                                                              torch.bfloat16, 5)
    up = LatentUp(up.kv_b.to(torch.bfloat16), 20, 32, 24)
    q_nope, q_pe = q_nope.to(torch.bfloat16), q_pe.to(torch.bfloat16)
    got = absorbed_decode(q_nope, q_pe, k_cache, v_cache, _decode_index(reads, lens), up, 0.2,
                          isa)
    assert got.dtype == torch.bfloat16
    for b, read in enumerate(reads):
        latent = read_latent(k_cache, v_cache, read, width, torch.bfloat16)
        want = absorbed(q_nope[b:b + 1], q_pe[b:b + 1], latent, up, 0.2)
        torch.testing.assert_close(got[b:b + 1].float(), want.float(), rtol=3e-2, atol=3e-2)


def test_raw_kernel_is_softmax_over_the_latents():
    """decode_attention itself: softmax(q . latent * scale) times the latents' first rank
    values, on the best path here."""
    isa = _best()
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(100, 1, 9, generator=gen), torch.randn(100, 1, 9, generator=gen)
    read = torch.randperm(100, generator=gen)[:37]
    q = torch.randn(1, 5, 17, generator=gen)
    got = mla_attention.decode_attention(q, k_cache, v_cache, *slot_index([read]), 12, 0.4, isa)
    latent = read_latent(k_cache, v_cache, read, 17, torch.float32)
    want = torch.softmax(q[0] @ latent.T * 0.4, dim=-1) @ latent[:, :12]
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


def test_decode_rows_on_the_kernel_beside_a_prefill_chunk():
    """latent_attention with a kernel path: the step's one-row sequences in one call, a
    prefill chunk's rows in torch, each row where it belongs; the same as torch alone, layer
    after layer of one forward."""
    isa = _best()
    gen = torch.Generator().manual_seed(11)
    up = LatentUp(torch.randn(3 * 24, 22, generator=gen) * 0.3, 3, 10, 14)
    k_cache, v_cache = torch.zeros(400, 1, 14), torch.zeros(400, 1, 14)
    slots = torch.randperm(400, generator=gen)
    a, b, c = slots[:50], slots[50:80], slots[80:200]  # decode, prefill chunk, decode
    for s in (a, b, c):
        write_latent(k_cache, v_cache, torch.randn(len(s), 28, generator=gen),
                     [SeqMeta(0, len(s), 0, s, s, TABLE)])
    seqs = [SeqMeta(0, 1, 49, a[49:], a, TABLE), SeqMeta(1, 10, 20, b[20:], b, TABLE),
            SeqMeta(11, 1, 119, c[119:], c, TABLE)]
    q_nope, q_pe = torch.randn(12, 3, 10, generator=gen), torch.randn(12, 3, 6, generator=gen)
    torch_only = latent_attention(q_nope, q_pe, k_cache, v_cache, seqs, up, 28, 0.3)
    derived = {}  # one forward's: the second layer reuses the first's slot index
    for _ in range(2):
        kernel = latent_attention(q_nope, q_pe, k_cache, v_cache, seqs, up, 28, 0.3,
                                  LatentAttention(decode_isa=isa), derived)
        torch.testing.assert_close(kernel, torch_only, rtol=1e-5, atol=1e-5)
    assert len(derived) == 1


def test_hidden_cpu_flags_rule_paths_out():
    """--hide-cpu-flags: the paths that need a hidden flag are not chosen (the baseline build
    never needs one); with every path disabled, torch attends."""
    assert mla_attention.hidden_isas(None) == ()
    assert mla_attention.hidden_isas(frozenset({"avx2", "fma"})) == ("avx512bf16", "avx512")
    assert mla_attention.hidden_isas(frozenset({"avx512f", "avx512bw", "avx512vl", "avx2",
                                                "fma"})) == ("avx512bf16",)
    assert set(mla_attention.hidden_isas(frozenset())) == {"avx512bf16", "avx512", "avx2"}
    assert mla_attention.decode_isa(mla_attention.ISAS) is None


def test_a_stage_takes_the_path_its_flags_allow():
    """choose_latent_attention (what build_stage gives a latent model): the best path the
    trusted CPU flags allow; torch under --attention-backend sdpa or for a cache the kernel
    does not read; --mla-prefill-attention carried to the prefill."""
    from pipefill.base.platform import usable_cpu_flags
    from pipefill.config.sections import Kernels
    from pipefill.model.mla import choose_latent_attention
    cpu = torch.device("cpu")
    auto = Kernels("auto", "torch", 32, "auto", "", "absorbed")
    best = choose_latent_attention(auto, torch.bfloat16, cpu, usable_cpu_flags())
    assert best == LatentAttention("absorbed", mla_attention.decode_isa())
    smaller = choose_latent_attention(auto, torch.float32, cpu, usable_cpu_flags("avx512f"))
    assert smaller.decode_isa in ("avx2", "scalar", None)
    sdpa = Kernels("sdpa", "torch", 32, "auto", "", "auto")
    assert choose_latent_attention(sdpa, torch.float32, cpu).decode_isa is None
    assert choose_latent_attention(auto, torch.float16, cpu).decode_isa is None
