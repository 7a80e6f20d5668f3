"""Which way a prefill chunk attends from the latent cache: the cost of each path
(ARCHITECTURE.md, 'The latent KV cache (MLA)'). Pure arithmetic on the model's shapes.

A chunk of C queries at the end of N = prefix + C tokens:

* decompressed builds every head's keys and values of all N tokens through kv_b_proj (a GEMM
  of 2·N·rank·H·(nope + v) FLOPs, written out as N·H·(2·(nope + rope)) values: the values are
  padded to the keys' width for the flash kernel), then attends with nope + rope wide keys,
  causally (the diagonal block's upper half is skipped);
* absorbed folds W_uk into the queries (2·C·H·nope·rank), scores every query against every
  latent (2·H·C·N·(rank + rope), the causal mask computed and thrown away), sums the latents
  (2·H·C·N·rank) and goes out through W_uv (2·C·H·rank·v); its score matrix (H·C·N
  float32) passes through memory about ten times (the product, the rope part added, the
  scale, the mask, softmax, the cast), in blocks of queries that keep it within
  SCORE_BLOCK_BYTES, each block reading the latents once.

So decompressing costs per key and absorbing per query and key: with a long cached prefix a
chunk of C queries attends absorbed while C · (the absorbed path's cost per query and key, less
the decompressed attention's) stays under the cost of building one key and value, 2 · rank ·
(nope + v) FLOPs a head — up to about 160 queries for DeepSeek's shapes (rank 512, 128 + 64,
v 128), whatever the head count, since both paths cost per head; without a prefix, up to about
10 (the chunk's own keys are few). Time = FLOPs / flops rate + bytes / bytes rate (the steps run one
after the other, so the two add); only the ratio of the rates matters, and the default is a
balance of 10 FLOPs per byte, a CPU's (a calibration may pass measured rates).
"""
from __future__ import annotations

from dataclasses import dataclass

# Passes of the absorbed path's float32 score matrix through memory (see above).
SCORE_PASSES = 10
# The absorbed path's score matrix is bounded to this many bytes: a chunk's queries go in
# blocks of as many as fit, each block reading the latents again.
SCORE_BLOCK_BYTES = 256 << 20
# Queries the CPU flash kernel takes per block: it reads the keys and values once per block.
FLASH_QUERY_BLOCK = 256


@dataclass(frozen=True)
class LatentShape:
    """A latent layer's attention shapes; elem: bytes of a value in the compute dtype."""
    heads: int
    nope: int
    rope: int
    v: int
    rank: int
    elem: int = 2


@dataclass(frozen=True)
class Rates:
    """What the machine does per second: FLOPs and bytes moved (read + write)."""
    flops: float = 1e12
    bytes: float = 1e11

    def seconds(self, flops: float, nbytes: float) -> float:
        return flops / self.flops + nbytes / self.bytes


def decompressed_cost(s: LatentShape, queries: int, keys: int) -> tuple[float, float]:
    """(FLOPs, bytes) of the decompressed path for `queries` at the end of `keys` tokens."""
    h, e, qk = s.heads, s.elem, s.nope + s.rope
    v_width = qk  # the values are padded to the keys' width (one head size for flash)
    pairs = queries * (keys - queries) + queries * (queries + 1) / 2  # causal
    flops = 2 * keys * s.rank * h * (s.nope + s.v) + 2 * h * pairs * (qk + v_width)
    up = keys * (s.rank + s.rope) + h * (s.nope + s.v) * s.rank + keys * h * (s.nope + s.v)
    assemble = keys * h * (s.nope + qk + v_width)  # keys written (nope read), values padded
    blocks = -(-queries // FLASH_QUERY_BLOCK)
    attend = keys * h * (qk + v_width) * blocks
    return flops, e * (up + assemble + attend)


def absorbed_cost(s: LatentShape, queries: int, keys: int) -> tuple[float, float]:
    """(FLOPs, bytes) of the absorbed path for `queries` at the end of `keys` tokens."""
    h, e = s.heads, s.elem
    grid = h * queries * keys
    flops = (2 * queries * h * s.nope * s.rank + 2 * grid * (2 * s.rank + s.rope)
             + 2 * queries * h * s.rank * s.v)
    weights = h * s.rank * (s.nope + s.v)
    blocks = -(-queries // score_block_rows(s.heads, keys))
    latents = keys * (s.rank + s.rope) * blocks
    return flops, e * (latents + weights) + 4 * SCORE_PASSES * grid


def score_block_rows(heads: int, keys: int) -> int:
    """Queries per block of the absorbed path: as many as keep the float32 scores of every
    head within SCORE_BLOCK_BYTES (at least one)."""
    return max(1, SCORE_BLOCK_BYTES // (4 * heads * keys))


def cheaper_path(s: LatentShape, queries: int, keys: int, rates: Rates = Rates()) -> str:
    """'absorbed' or 'decompressed': the cheaper way for `queries` at the end of `keys`
    tokens (ties decompress)."""
    absorbed = rates.seconds(*absorbed_cost(s, queries, keys))
    return "absorbed" if absorbed < rates.seconds(*decompressed_cost(s, queries, keys)) \
        else "decompressed"


def largest_absorbed_chunk(s: LatentShape, prefix: int, rates: Rates = Rates(),
                           limit: int = 1 << 16) -> int:
    """The largest chunk that attends absorbed after `prefix` cached tokens (0: none does).
    The absorbed path's share grows with the chunk, so the choice flips once: a bisection."""
    if cheaper_path(s, 1, prefix + 1, rates) != "absorbed":
        return 0
    lo, hi = 1, limit  # absorbed at lo; decompressed at hi, or hi is the limit
    if cheaper_path(s, hi, prefix + hi, rates) == "absorbed":
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cheaper_path(s, mid, prefix + mid, rates) == "absorbed":
            lo = mid
        else:
            hi = mid
    return lo
