"""The quantized KV cache's rows (ARCHITECTURE.md, 'The KV room', quantized pages).

With --kv-cache-dtype int8 or fp8_e4m3 a cache row (one token of one KV head) holds head_dim
codes followed by the row's float32 scale in the last 4 bytes, all in one tensor of the code
dtype: [..., head_dim + 4]. A page is then still one contiguous block of its tokens' rows, so
everything that copies pages as bytes (the host and storage tiers, PD transfer, the radix
tree's shared pages) carries the scales with the codes and needs no second tensor.

Writes quantize (`store`), reads dequantize into the compute dtype (`load`); `as_stored` is
what the cache gives back for values just written, so a chunk attends to its own keys exactly
as a later chunk will read them.

Error per value (scale s = the row's max |x| / qmax): int8 rounds to the nearest step, so
|x - x'| <= s / 2 = max|x| / 254; fp8_e4m3 keeps 3 mantissa bits, so |x - x'| <= |x| / 16 for
codes in the normal range and <= s * 2**-10 below it.
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 scale per token and KV head, after the codes
QUANT_KV_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_TINY = torch.finfo(torch.float32).tiny  # an all-zero row keeps a positive scale


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def copyable(t: torch.Tensor) -> torch.Tensor:
    """t, or for an fp8 cache its bytes (same shape): torch's CPU index_copy_ has no float8
    kernel, and pages move as bytes anyway."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def stored_dim(head_dim: int, dtype: torch.dtype) -> int:
    """Values per cache row: head_dim, plus the scale's bytes for a quantized cache."""
    if not is_quantized(dtype):
        return head_dim
    assert head_dim % SCALE_BYTES == 0, "the scale must stay 4-byte aligned in the row"
    return head_dim + SCALE_BYTES


def scales_of(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales of quantized rows [..., head_dim + 4] as a [..., 1] view."""
    return rows[..., -SCALE_BYTES:].view(torch.float32)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> rows [..., head_dim + 4] of `dtype`: codes of
    x / s rounded to nearest, then s = max |x| / qmax of the row in float32."""
    qmax = _QMAX[dtype]
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / qmax).clamp_min(_TINY)
    codes = (xf / scale).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        codes = codes.round_()
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=dtype, device=x.device)
    out[..., :x.shape[-1]] = codes.to(dtype)
    scales_of(out).copy_(scale)
    return out


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantized rows [..., head_dim + 4] -> values [..., head_dim] in `dtype` (the product
    codes x scale is taken in float32, then rounded once to `dtype`)."""
    codes = rows[..., :rows.shape[-1] - SCALE_BYTES]
    return (codes.float() * scales_of(rows)).to(dtype)


def store(cache: torch.Tensor, slots, x: torch.Tensor) -> None:
    """x [n, H, D] into one layer's cache rows `slots` (a slice or an index tensor)."""
    cache[slots] = quantize(x, cache.dtype) if is_quantized(cache.dtype) else x.to(cache.dtype)


def load(cache: torch.Tensor, slots, dtype: torch.dtype) -> torch.Tensor:
    """One layer's cache rows `slots` as values [n, H, D] in `dtype`."""
    rows = cache[slots]
    return dequantize(rows, dtype) if is_quantized(cache.dtype) else rows.to(dtype)


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache will give it back (in x's dtype): x itself when the cache keeps x's
    dtype, else rounded through the cache's dtype (quantized: codes and scale)."""
    if cache_dtype == x.dtype:
        return x
    if is_quantized(cache_dtype):
        return dequantize(quantize(x, cache_dtype), x.dtype)
    return x.to(cache_dtype).to(x.dtype)
