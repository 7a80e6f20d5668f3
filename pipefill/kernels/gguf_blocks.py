"""GGUF block formats that the quantized decode GEMM (kernels.quant_gemm) reads as they are in
the file, and their dequantization in float64 (the tests' reference).

A quantized matrix [N, K] in a GGUF file is N rows of K / 32 blocks; each block holds 32
weights as small integers with a float16 scale (and offset). A nibble byte j of a 4-bit block
holds element j (low nibble) and element j + 16 (high nibble):

| type | bytes | fields | weight |
|---|---|---|---|
| Q4_0 | 18 | d (f16), 16 nibble bytes q | (q - 8) d |
| Q4_1 | 20 | d (f16), m (f16), 16 nibble bytes q | q d + m |
| Q8_0 | 34 | d (f16), 32 int8 q | q d |

Other types (the K-quants, Q5_0, ...) are not read in blocks yet: their matrices stay
dequantized.
"""
from __future__ import annotations

import numpy as np

BLOCK = 32  # weights per block
# GGML type id -> (name, bytes per block)
BLOCK_TYPES = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34)}


def type_name(qtype: int) -> str:
    return BLOCK_TYPES[qtype][0] if qtype in BLOCK_TYPES else f"ggml type {qtype}"


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of k weights (k a multiple of BLOCK)."""
    return k // BLOCK * BLOCK_TYPES[qtype][1]


def supports(qtype: int, k: int) -> bool:
    """Whether a [N, k] matrix of this type can stay in blocks (a known type, whole blocks)."""
    return qtype in BLOCK_TYPES and k % BLOCK == 0 and k > 0


def dequantize_reference(raw: np.ndarray, qtype: int) -> np.ndarray:
    """uint8 [N, row_bytes] blocks -> float64 [N, K], computed from the fields alone (float16
    scales widened exactly; integer parts exact), so it is the exact value of every weight."""
    name, size = BLOCK_TYPES[qtype]
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)  # [N, nb, 1]
    if name == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).astype(np.float64)
        return (q * d).reshape(n, -1)
    nibbles = blocks[..., 4:] if name == "Q4_1" else blocks[..., 2:]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).astype(np.float64)
    if name == "Q4_0":
        return ((q - 8) * d).reshape(n, -1)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)
    return (q * d + m).reshape(n, -1)


def quantize_reference(w: np.ndarray, qtype: int) -> np.ndarray:
    """float [N, K] -> uint8 [N, row_bytes] blocks of qtype (round to nearest, as ggml's
    reference quantizers; for tests that need blocks of chosen shapes)."""
    name, size = BLOCK_TYPES[qtype]
    n, k = w.shape
    x = w.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    out = np.zeros((n, k // BLOCK, size), dtype=np.uint8)
    if name == "Q4_1":
        lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
        d = ((hi - lo) / 15).astype(np.float16)
        inv = np.where(d != 0, 1 / np.where(d != 0, d.astype(np.float32), 1), 0)
        q = np.clip(np.round((x - lo) * inv), 0, 15).astype(np.uint8)
        out[..., 2:4] = lo.astype(np.float16).view(np.uint8)
    else:
        amax_i = np.abs(x).argmax(-1)[..., None]
        amax = np.take_along_axis(x, amax_i, -1)  # signed, as ggml's Q4_0
        d = (amax / -8 if name == "Q4_0" else np.abs(amax) / 127).astype(np.float16)
        inv = np.where(d != 0, 1 / np.where(d != 0, d.astype(np.float32), 1), 0)
        if name == "Q4_0":
            q = np.clip(np.round(x * inv) + 8, 0, 15).astype(np.uint8)
        else:
            out[..., 2:] = np.clip(np.round(x * inv), -127, 127).astype(np.int8).view(np.uint8)
    out[..., 0:2] = d.view(np.uint8)
    if name != "Q8_0":
        start = 4 if name == "Q4_1" else 2
        out[..., start:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(n, -1)
