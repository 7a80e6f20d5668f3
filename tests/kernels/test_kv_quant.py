"""The quantized KV cache's rows (pipefill/kernels/kv_quant.py; ARCHITECTURE.md, 'The KV
room'): int8 and fp8_e4m3 round trips within their stated bounds, the scale in the row's last
4 bytes, the sdpa attention path equal to attention over the dequantized values (prefill
chunks, decode, a sliding window), and a stored page that records its layout."""
from __future__ import annotations

import zlib

import pytest
import torch

from pipefill.kernels.kv_quant import (SCALE_BYTES, as_stored, dequantize, load, quantize,
                                       scales_of, store, stored_dim)
from pipefill.kv.cache import KVCache, token_slots
from pipefill.kv.storage_format import check_header, encode_header
from pipefill.model.attention import (SeqMeta, native_decode_isa, paged_attention,
                                      resolve_kv_dtype)

from cpu_paths import need

QDTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def rows(seed: int, shape=(37, 3, 64)) -> torch.Tensor:
    """Random rows with an outlier channel and an all-zero row (the corners of the scale)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 5] *= 20
    x[0, 0] = 0
    return x


@pytest.mark.parametrize("name", QDTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 16])
def test_round_trip_within_the_stated_bound(name, head_dim):
    dtype = QDTYPES[name]
    x = rows(head_dim, (37, 3, head_dim))
    q = quantize(x, dtype)
    assert q.dtype == dtype and q.shape == (37, 3, stored_dim(head_dim, dtype))
    assert q.shape[-1] == head_dim + SCALE_BYTES
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:
        assert torch.allclose(scales_of(q), (amax / 127).clamp_min(1e-38))
        bound = amax / 254 * (1 + 1e-6)
    else:
        scale = amax / 448
        bound = torch.maximum(x.abs() / 16, scale * 2**-10) * (1 + 1e-6)
    err = (dequantize(q) - x).abs()
    assert (err <= bound).all(), (err - bound).max()
    assert dequantize(q)[0, 0].abs().max() == 0  # the zero row stays zero
    # Quantizing what came back gives the same codes and scales (up to the scale's rounding).
    again = quantize(dequantize(q), dtype)
    codes = slice(0, head_dim)
    assert torch.equal(again[..., codes].view(torch.uint8), q[..., codes].view(torch.uint8))
    torch.testing.assert_close(scales_of(again), scales_of(q), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", QDTYPES)
def test_store_and_load_through_slots_and_bf16(name):
    dtype = QDTYPES[name]
    cache = torch.zeros(64, 3, stored_dim(64, dtype), dtype=dtype)
    x = rows(1, (10, 3, 64)).to(torch.bfloat16)
    slots = torch.tensor([3, 9, 10, 40, 41, 42, 43, 50, 60, 63])
    store(cache, slots, x)
    back = load(cache, slots, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back, as_stored(x, dtype))
    store(cache, slice(20, 30), x)
    assert torch.equal(load(cache, slice(20, 30), torch.float32), dequantize(quantize(x, dtype)))
    assert resolve_kv_dtype(name, torch.float32) == dtype


def _attention_case(kv_dtype, prefix: int, new: int, window=None, native=None):
    """paged_attention over a quantized cache (decode rows on the int8 kernel's `native` path
    when given) against the same call over a float32 cache holding the dequantized values (the
    new tokens rounded through the cache too)."""
    H, Hq, D, page = 2, 4, 64, 16
    g = torch.Generator().manual_seed(prefix * 131 + new)
    total = prefix + new
    num_pages = -(-total // page) + 2
    table = list(range(num_pages))[::-1][:-(-total // page)]  # not consecutive: index slots
    q = torch.randn(new, Hq, D, generator=g)
    k_all, v_all = torch.randn(2, total, H, D, generator=g)
    quant = KVCache(1, num_pages, page, H, D, kv_dtype)
    plain = KVCache(1, num_pages, page, H, D, torch.float32)
    out = {}
    for cache in (quant, plain):
        kc, vc = cache.k[0], cache.v[0]
        k_in, v_in = k_all, v_all
        if cache is plain:  # what the quantized cache will hold
            k_in, v_in = as_stored(k_all, kv_dtype), as_stored(v_all, kv_dtype)
        if prefix:
            pre = SeqMeta(0, prefix, 0, token_slots(table, 0, prefix, page),
                          token_slots(table, 0, prefix, page), torch.tensor(table))
            paged_attention(torch.zeros(prefix, Hq, D), k_in[:prefix], v_in[:prefix], kc, vc,
                            [pre], 0.125, window)
        seq = SeqMeta(0, new, prefix, token_slots(table, prefix, total, page),
                      token_slots(table, 0, total, page), torch.tensor(table))
        out[cache is quant] = paged_attention(q, k_in[prefix:], v_in[prefix:], kc, vc, [seq],
                                              0.125, window,
                                              native if cache is quant else None)
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,native", [("int8", None), ("fp8_e4m3", None), ("int8", "best")])
@pytest.mark.parametrize("prefix,new,window", [(0, 40, None), (35, 29, None), (70, 1, None),
                                               (50, 20, 24), (60, 1, 24), (10, 1, 24)])
def test_sdpa_path_attends_to_the_dequantized_values(name, native, prefix, new, window):
    if native == "best":
        native = native_decode_isa(torch.int8)
        if native is None:  # the scalar path needs no flags: it must run (cpu_paths.py)
            from pipefill.kernels import kv_quant_attention as qa
            need("scalar", qa.isa_status()["scalar"], qa.ISA_CPU_FLAGS["scalar"])
    _attention_case(QDTYPES[name], prefix, new, window, native)


def test_a_stored_page_records_its_layout():
    """A quantized page is read only into a quantized cache of the same dtype and shape; a
    header whose layout byte says plain values (what an int8 page could never be) is refused,
    as is an int8 page offered to an fp8 cache."""
    page = quantize(rows(3, (2, 3, 16, 2, 64)), torch.int8)
    payload = page.contiguous().view(torch.uint8).numpy().tobytes()
    header = encode_header("k", page, zlib.crc32(payload))
    assert check_header(header, "k", torch.empty_like(page)) == zlib.crc32(payload)
    assert check_header(header, "k", torch.empty(page.shape, dtype=torch.float8_e4m3fn)) is None
    plain = bytearray(header)
    plain[10] = 0  # the layout byte (after magic, version, key length, dtype, ndim)
    body = bytes(plain[:-4])
    plain[-4:] = zlib.crc32(body).to_bytes(4, "little")
    assert check_header(bytes(plain), "k", torch.empty_like(page)) is None


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("head_dim,lens,bf16", [(64, [1], False), (64, [301, 5, 64], False),
                                                (16, [77], False), (128, [130, 9], True),
                                                (20, [45, 2], False)])
def test_native_int8_decode_equals_attention_over_the_dequantized_rows(isa, head_dim, lens, bf16):
    """The C++ decode kernel (every path this CPU runs; a D that is not a multiple of the
    vector width takes its scalar tail), one call for a batch of sequences, against torch's
    attention over each one's dequantized rows, on scattered slots with grouped query heads;
    a slice of consecutive rows reads as their index."""
    from pipefill.kernels.kv_quant_attention import (ISA_CPU_FLAGS, decode_attention,
                                                     isa_status, slot_index)
    need(isa, isa_status()[isa], ISA_CPU_FLAGS[isa])
    H, Hq = 2, 6
    g = torch.Generator().manual_seed(sum(lens) + head_dim)
    k_cache = quantize(torch.randn(400, H, head_dim, generator=g) * 3, torch.int8)
    v_cache = quantize(torch.randn(400, H, head_dim, generator=g), torch.int8)
    reads = [torch.randperm(400, generator=g)[:n] for n in lens]
    reads[0] = slice(3, 3 + lens[0])
    q = torch.randn(len(lens), Hq, head_dim, generator=g)
    q = q.to(torch.bfloat16) if bf16 else q
    got = decode_attention(q, k_cache, v_cache, *slot_index(reads), 0.3, isa)
    assert got.dtype == q.dtype and got.shape == q.shape
    for b, read in enumerate(reads):
        keys, values = (dequantize(c[read]) for c in (k_cache, v_cache))
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b:b + 1].float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            scale=0.3, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(got[b:b + 1].float(), want, rtol=1e-2 if bf16 else 1e-5,
                                   atol=1e-2 if bf16 else 1e-5)
