"""GGUF block formats that the quantized decode GEMM (kernels.quant_gemm) reads as they are in
the file, and their dequantization in float64 (the tests' reference).

A quantized matrix [N, K] in a GGUF file is N rows of K / W blocks of W weights each, small
integers with float16 scales (csrc/quant_gemm_kernel.h spells out every byte):

| type | W | bytes | weight |
|---|---|---|---|
| Q4_0 | 32 | 18 | (q - 8) d; 4-bit q |
| Q4_1 | 32 | 20 | q d + m |
| Q5_0 | 32 | 22 | (q - 16) d; 5-bit q (a plane of fifth bits beside the nibbles) |
| Q8_0 | 32 | 34 | q d; int8 q |
| Q4_K | 256 | 144 | (d sc) q - (dmin mn); eight sub-blocks of 32 with 6-bit sc, mn |
| Q5_K | 256 | 176 | as Q4_K with 5-bit q |
| Q6_K | 256 | 210 | (d sc) (q - 32); 6-bit q, an int8 sc per 16 weights |

Other types (Q2_K, Q3_K, the IQ types, ...) are not read in blocks: their matrices stay
dequantized.
"""
from __future__ import annotations

import numpy as np

# GGML type id -> (name, weights per block, bytes per block)
BLOCK_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
               8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
               14: ("Q6_K", 256, 210)}
QUANTIZABLE = ("Q4_0", "Q4_1", "Q8_0")  # the types quantize_reference writes


def type_name(qtype: int) -> str:
    return BLOCK_TYPES[qtype][0] if qtype in BLOCK_TYPES else f"ggml type {qtype}"


def block_weights(qtype: int) -> int:
    return BLOCK_TYPES[qtype][1]


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of k weights (k a multiple of the type's block)."""
    _, weights, size = BLOCK_TYPES[qtype]
    return k // weights * size


def supports(qtype: int, k: int) -> bool:
    """Whether a [N, k] matrix of this type can stay in blocks (a known type, whole blocks)."""
    return qtype in BLOCK_TYPES and k > 0 and k % block_weights(qtype) == 0


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of every block, widened exactly: [..., 1]."""
    return blocks[..., at:at + 2].copy().view(np.float16).astype(np.float64)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2, n]: low nibbles, then high nibbles."""
    return np.stack([b & 0xF, b >> 4], axis=-2)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes [..., 12] -> the eight 6-bit (scale, min) pairs, [..., 8] each."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc.astype(np.float64), mn.astype(np.float64)


def _codes_32(blocks: np.ndarray, name: str) -> np.ndarray:
    """The 32-weight types' integer codes before their zero point: [n, nb, 32]."""
    if name == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8).astype(np.int64)
    start = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[name]
    q = _nibbles(blocks[..., start:]).reshape(*blocks.shape[:-1], 32).astype(np.int64)
    if name == "Q5_0":
        fifth = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")
        q |= fifth.astype(np.int64) << 4
    return q


def _dequantize_k(blocks: np.ndarray, name: str) -> np.ndarray:
    """The K types' weights: [n, nb, 256] float64."""
    if name == "Q6_K":
        low = _nibbles(blocks[..., 0:128].reshape(*blocks.shape[:-1], 2, 64))  # [.., 2, 2, 64]
        low = low.reshape(*blocks.shape[:-1], 2, 4, 32)  # half, group (ql lo/hi x nibble), 32
        high = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 1, 32)
        high = (high >> np.array([0, 2, 4, 6]).reshape(4, 1)) & 3
        q = (low.astype(np.int64) | (high.astype(np.int64) << 4)) - 32
        sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float64)  # one per 16
        d = _half(blocks, 208) * sc
        return (q.reshape(*blocks.shape[:-1], 16, 16) * d[..., None]).reshape(
            *blocks.shape[:-1], 256)
    sc, mn = _k_scales(blocks[..., 4:16])
    start = 16 if name == "Q4_K" else 48
    q = _nibbles(blocks[..., start:start + 128].reshape(*blocks.shape[:-1], 4, 32))
    q = q.reshape(*blocks.shape[:-1], 8, 32).astype(np.int64)  # sub-block s = 2 chunk + nibble
    if name == "Q5_K":
        planes = np.unpackbits(blocks[..., 16:48, None], axis=-1, bitorder="little")  # [.., 32, 8]
        q |= np.moveaxis(planes, -1, -2).astype(np.int64) << 4
    w = q * (_half(blocks, 0) * sc)[..., None] - (_half(blocks, 2) * mn)[..., None]
    return w.reshape(*blocks.shape[:-1], 256)


def dequantize_reference(raw: np.ndarray, qtype: int) -> np.ndarray:
    """uint8 [N, row_bytes] blocks -> float64 [N, K], computed from the fields alone (float16
    scales widened exactly, integer parts exact; each product exact in float64), so it is the
    value of every weight that ggml's float32 arithmetic rounds."""
    name, weights, size = BLOCK_TYPES[qtype]
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1, size)
    if weights == 256:
        return _dequantize_k(blocks, name).reshape(n, -1)
    q = _codes_32(blocks, name).astype(np.float64)
    d = _half(blocks, 0)
    if name == "Q4_1":
        return (q * d + _half(blocks, 2)).reshape(n, -1)
    zero = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 0}[name]
    return ((q - zero) * d).reshape(n, -1)


def quantize_reference(w: np.ndarray, qtype: int) -> np.ndarray:
    """float [N, K] -> uint8 [N, row_bytes] blocks of Q4_0, Q4_1 or Q8_0 (round to nearest, as
    ggml's reference quantizers; for tests that need blocks of chosen shapes)."""
    name, block, size = BLOCK_TYPES[qtype]
    if name not in QUANTIZABLE:
        raise ValueError(f"quantize_reference writes {', '.join(QUANTIZABLE)}, not {name}")
    n, k = w.shape
    x = w.astype(np.float32).reshape(n, k // block, block)
    out = np.zeros((n, k // block, size), dtype=np.uint8)
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


def random_blocks(qtype: int, n: int, k: int, rng: np.random.Generator,
                  std: float = 0.05) -> np.ndarray:
    """uint8 [n, row_bytes] of random blocks of any type here: every code, scale and bit plane
    random, the float16 scales sized so that the weights are about `std` (for tests of the
    kernels and of the loader on types quantize_reference does not write)."""
    name, weights, size = BLOCK_TYPES[qtype]
    blocks = rng.integers(0, 256, (n, k // weights, size), dtype=np.uint8)
    # Typical |code x scale| of each type: what one unit of d (and dmin) makes of a weight.
    spread = {"Q4_0": 4, "Q4_1": 8, "Q5_0": 8, "Q8_0": 64, "Q4_K": 250, "Q5_K": 500,
              "Q6_K": 1000}[name]
    d = (rng.uniform(0.5, 1.5, (n, k // weights, 1)) * std / spread).astype(np.float16)
    d_at = 208 if name == "Q6_K" else 0
    blocks[..., d_at:d_at + 2] = d.view(np.uint8)
    # The offset about centres the weights: Q4_1's m = -8 d, the K types' dmin x min near
    # d x sc x the middle code.
    centre = {"Q4_1": -8, "Q4_K": 7.5, "Q5_K": 15.5}.get(name)
    if centre is not None:
        m = rng.uniform(0.5, 1.5, (n, k // weights, 1)) * std / spread * centre
        blocks[..., 2:4] = m.astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


# The 16-row layout (the integer decode GEMM's, csrc/quant_int8_rows16*.h), every type here:
# the same bytes, rows padded with zero rows to a multiple of 16, then per group of 16 rows and
# per block column b, the group's 16 blocks b field by field, each field cut into units of
# `unit` bytes and stored unit-major, row-minor. The kernel then loads a field for 16 rows
# with one instruction: 16 halves d (and m) widen into one float register, and each 64-byte
# unit register holds dword j of the codes of 16 rows, one row per 32-bit lane.
ROWS16 = 16
_ROWS16_FIELDS = {"Q4_0": ((0, 2, 2), (2, 18, 4)),  # (first byte, end, unit bytes)
                  "Q4_1": ((0, 2, 2), (2, 4, 2), (4, 20, 4)),
                  "Q5_0": ((0, 2, 2), (2, 6, 4), (6, 22, 4)),
                  "Q8_0": ((0, 2, 2), (2, 34, 4)),
                  "Q4_K": ((0, 2, 2), (2, 4, 2), (4, 16, 4), (16, 144, 4)),
                  "Q5_K": ((0, 2, 2), (2, 4, 2), (4, 16, 4), (16, 48, 4), (48, 176, 4)),
                  "Q6_K": ((0, 128, 4), (128, 192, 4), (192, 208, 4), (208, 210, 2))}


def rows16_supported(qtype: int) -> bool:
    return type_name(qtype) in _ROWS16_FIELDS


def rows16_padded(n: int) -> int:
    return -(-n // ROWS16) * ROWS16


# Input bytes laid out at a time by to_rows16: its temporaries (a padded copy, the fields'
# permuted copies) are this size, not the matrix's (a 102 MiB embedding took 3x its size).
ROWS16_SLICE_BYTES = 4 << 20


def to_rows16(raw, qtype: int):
    """uint8 torch [N, row_bytes] (the file's rows) -> uint8 [rows16_padded(N), row_bytes] in
    the 16-row layout (above), on 2 MiB pages (kernels.huge_pages: the decode GEMM streams it
    every step; a small matrix shares its mapping with the model's other small ones). Written
    ROWS16_SLICE_BYTES of groups at a time."""
    import torch  # the rest of this module is numpy only
    from pipefill.kernels import huge_pages
    name, _, size = BLOCK_TYPES[qtype]
    n, nbytes = raw.shape
    out = huge_pages.empty((rows16_padded(n), nbytes), shared=True)
    groups = out.shape[0] // ROWS16
    dst = out.view(groups, nbytes // size, ROWS16 * size)
    step = max(1, ROWS16_SLICE_BYTES // (ROWS16 * nbytes))
    for g0 in range(0, groups, step):
        g1 = min(groups, g0 + step)
        rows = raw[g0 * ROWS16:g1 * ROWS16]
        if rows.shape[0] < (g1 - g0) * ROWS16:  # the last group: zero rows pad it
            rows = torch.cat([rows, rows.new_zeros((g1 - g0) * ROWS16 - rows.shape[0], nbytes)])
        b = rows.reshape(g1 - g0, ROWS16, nbytes // size, size)  # group, row, block, byte
        fields = [b[..., lo:hi].unflatten(-1, ((hi - lo) // unit, unit)).permute(0, 2, 3, 1, 4)
                  .flatten(2) for lo, hi, unit in _ROWS16_FIELDS[name]]  # group, block, bytes
        torch.cat(fields, dim=-1, out=dst[g0:g1])
    return out


def from_rows16(packed, qtype: int, n: int):
    """to_rows16's inverse: the first n rows as the file holds them, uint8 [n, row_bytes]."""
    import torch
    name, _, size = BLOCK_TYPES[qtype]
    rows, nbytes = packed.shape
    p = packed.view(rows // ROWS16, nbytes // size, ROWS16 * size)
    out = torch.empty(rows // ROWS16, ROWS16, nbytes // size, size, dtype=torch.uint8)
    at = 0
    for lo, hi, unit in _ROWS16_FIELDS[name]:
        field = p[..., at:at + ROWS16 * (hi - lo)].unflatten(-1, ((hi - lo) // unit, ROWS16, unit))
        out[..., lo:hi] = field.permute(0, 3, 1, 2, 4).flatten(-2)
        at += ROWS16 * (hi - lo)
    return out.reshape(rows, nbytes)[:n]


def rows16_take(packed, qtype: int, ids):
    """Rows `ids` (int64 [n]) of a matrix held in the 16-row layout, as the file holds them
    (uint8 [n, row_bytes]): each field of each row is gathered from its unit-major, row-minor
    place in its group, so only the ids' bytes are copied (an embedding lookup reads a few rows
    of a large table; putting their whole groups back took 16x their bytes, three times over:
    54 MiB for a 512-token chunk of a Q8_0 49,152 x 2,048 embedding)."""
    import torch
    name, _, size = BLOCK_TYPES[qtype]
    nbytes = packed.shape[1]
    p = packed.view(-1, nbytes // size, ROWS16 * size)  # group, block column, its 16 blocks
    group, row = ids // ROWS16, ids % ROWS16
    out = torch.empty(ids.shape[0], nbytes // size, size, dtype=torch.uint8)
    at = 0
    for lo, hi, unit in _ROWS16_FIELDS[name]:
        field = p[..., at:at + ROWS16 * (hi - lo)].unflatten(-1, ((hi - lo) // unit, ROWS16, unit))
        out[..., lo:hi] = field[group, :, :, row].flatten(-2)  # id, block, field's bytes
        at += ROWS16 * (hi - lo)
    return out.view(ids.shape[0], nbytes)
