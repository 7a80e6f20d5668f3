"""The stored form of one KV page, shared by every L3 backend (file, mooncake):

  fixed part  magic "PFKV", version u16, key length u16, dtype code u8, ndim u8, layout u8,
              1 pad, payload bytes u64, payload CRC-32 u32
  then        shape (ndim x i64), key (utf-8), header CRC-32 u32 (over everything before it)
  then        payload (the tensor's bytes, C order)

CRC-32 (zlib): in the standard library, several GB/s, and made to catch what happens to
stored bytes (torn writes, truncation, bit flips). Not a defence against a forger: whoever can
write the directory can write any cache entry anyway. Key, shape and dtype in the header catch
a foreign or stale page even when its bytes are intact.

The layout byte says what a row of the payload holds: 0 plain values (the KV dtype's), 1 codes
of a quantized cache followed by their float32 scale (--kv-cache-dtype int8 or fp8_e4m3;
pipefill/kernels/kv_quant.py). It was a pad byte, always 0, before quantized caches existed,
so older plain pages still read, and a page is read only into a cache of its own layout.
"""
from __future__ import annotations

import struct
import zlib

import torch

from pipefill.kernels.kv_quant import is_quantized

MAGIC, VERSION = b"PFKV", 1
_FIXED = struct.Struct("<4sHHBBBxQI")
LAYOUT_PLAIN, LAYOUT_SCALED_ROWS = 0, 1
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3, "float8_e4m3fn": 4,
               "float8_e5m2": 5, "int8": 6, "uint8": 7}


def encode_header(key: str, page: torch.Tensor, payload_crc: int) -> bytes:
    kb = key.encode()
    dtype = DTYPE_CODES[str(page.dtype).removeprefix("torch.")]
    body = (_FIXED.pack(MAGIC, VERSION, len(kb), dtype, page.dim(), _layout(page.dtype),
                        page.nbytes, payload_crc)
            + struct.pack(f"<{page.dim()}q", *page.shape) + kb)
    return body + struct.pack("<I", zlib.crc32(body))


def header_length(fixed: bytes) -> int | None:
    """Total header bytes, from its first `_FIXED.size` bytes; None if they are not ours."""
    if len(fixed) < _FIXED.size:
        return None
    magic, version, key_len, _, ndim, _, _, _ = _FIXED.unpack_from(fixed)
    if magic != MAGIC or version != VERSION:
        return None
    return _FIXED.size + 8 * ndim + key_len + 4


def check_header(header, key: str, out: torch.Tensor) -> int | None:
    """The payload CRC when `header` (bytes-like, exactly one header) is intact and describes
    the page `key` with the shape and dtype of `out`; else None."""
    n = header_length(bytes(header[:_FIXED.size]))
    if n is None or n != len(header):
        return None
    body = bytes(header[:-4])
    if struct.unpack("<I", bytes(header[-4:]))[0] != zlib.crc32(body):
        return None
    _, _, key_len, dtype, ndim, layout, nbytes, crc = _FIXED.unpack_from(body)
    shape = struct.unpack_from(f"<{ndim}q", body, _FIXED.size)
    stored_key = body[_FIXED.size + 8 * ndim:].decode(errors="replace")
    want_dtype = DTYPE_CODES.get(str(out.dtype).removeprefix("torch."))
    if (stored_key != key or dtype != want_dtype or layout != _layout(out.dtype)
            or tuple(shape) != tuple(out.shape) or nbytes != out.nbytes):
        return None
    return crc


def _layout(dtype: torch.dtype) -> int:
    return LAYOUT_SCALED_ROWS if is_quantized(dtype) else LAYOUT_PLAIN


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return memoryview(t.view(-1).view(torch.uint8).numpy())
