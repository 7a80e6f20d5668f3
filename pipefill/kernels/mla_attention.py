"""Decode attention from a latent KV cache (multi-head latent attention, ARCHITECTURE.md, 'The
latent KV cache (MLA)'): one query token per sequence, every head of it at once, absorbed — the
query already folded into the latent space, so each token's key is its whole latent
(kv_lora_rank + rope values, 576 for DeepSeek-V2/V3) and its value the first kv_lora_rank
(512). The kernel reads each cached latent once for all heads: a block of tokens is widened
to float32 and multiplied by every head's query, as two small GEMMs vectorised over the heads
(csrc/mla_attn_kernel.h). float32 sums; bfloat16 or float32 caches.

Paths, one C++ source compiled once per ISA with its own -m flags, chosen at run time from
cpuid (``disable=`` forces paths off, as the tests and --hide-cpu-flags do): ``avx512bf16``
(a bf16 model over a bf16 cache: both products on vdpbf16ps, the query and the
probabilities rounded to bf16 as torch's bf16 path rounds them; anything else as avx512),
``avx512``, ``avx2`` (AVX2 + FMA) and ``scalar`` (the baseline x86-64 build), all of which
widen the latents to float32; where the extension cannot build, ``decode_isa`` answers None
and model/mla.py attends in torch.

API: ``decode_attention(q [B, H, D] float32, k_cache, v_cache [slots, 1, half], slots,
offsets, rank, scale, isa) -> [B, H, rank] float32`` (kv_quant_attention.slot_index gives
slots and offsets); ``decode_isa(disable=()) -> isa or None``; ``isa_status()``;
``hidden_isas(flags)``: the paths the trusted CPU flags rule out.
"""
from __future__ import annotations

import functools
import math

import torch

from pipefill.base.platform import VECTOR_ISA_CPU_FLAGS, isas_lacking_flags
from pipefill.kernels.build import CSRC, GLUE_VECTOR_ISA, IsaExtension, build_isa_extension

ISAS = ("avx512bf16", "avx512", "avx2", "scalar")  # preference order
_ISA_CODE = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}
_BASE = ["-O3", "-std=c++17", "-fPIC", "-fno-exceptions"]
_AVX512 = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl"]
# Register width in floats and token (or latent value) rows per register block, a divisor of
# the 32-token block and of DeepSeek's 512 latent values (no tail rows): AVX-512 16
# accumulators of one register, AVX2 8 of two (16 heads), the baseline 8 of four.
_ISA_FLAGS = {"scalar": _BASE + ["-DPF_MLA_WIDTH=4", "-DPF_MLA_ROWS=2"],
              "avx2": _BASE + ["-mavx2", "-mfma", "-DPF_MLA_WIDTH=8", "-DPF_MLA_ROWS=4"],
              "avx512": _BASE + _AVX512 + ["-DPF_MLA_WIDTH=16", "-DPF_MLA_ROWS=16"],
              "avx512bf16": _BASE + _AVX512 + ["-mavx512bf16", "-DPF_MLA_WIDTH=16",
                                               "-DPF_MLA_ROWS=16"]}
# The CPU flags (as /proc/cpuinfo names them) each build needs.
ISA_CPU_FLAGS = {"avx512bf16": VECTOR_ISA_CPU_FLAGS["avx512"] + ("avx512_bf16",),
                 **VECTOR_ISA_CPU_FLAGS}
_HEADER = CSRC / "mla_attn_kernel.h"
_WHAT = "the latent (MLA) decode attention"
HEAD_TILE = 16  # heads per register tile: the query's heads are padded to a multiple
CACHE_DTYPES = (torch.float32, torch.bfloat16)

_EXT = IsaExtension(_WHAT, functools.partial(
    build_isa_extension, "mla_attn", _WHAT, _ISA_FLAGS, (_HEADER,), (GLUE_VECTOR_ISA, _HEADER),
    source=CSRC / "mla_attn_isa.cpp", isa_define="PF_MLA_NS"), _ISA_CODE, "pf_mla_isa_supported")


def isa_status() -> dict[str, tuple[bool, str]]:
    """{isa: (usable here, why not)}; builds (or loads the cached) extension once."""
    return _EXT.status()


def hidden_isas(flags: frozenset[str] | None) -> tuple[str, ...]:
    """The vector paths that need a CPU flag missing from `flags` (the trusted flags, as
    --hide-cpu-flags leaves them; None: trust the CPU)."""
    return isas_lacking_flags(ISA_CPU_FLAGS, flags)


@functools.cache
def decode_isa(disable: tuple[str, ...] = ()) -> str | None:
    """The fastest path that runs here and is not disabled, or None (torch attends)."""
    usable = [isa for isa in ISAS if isa not in disable and isa_status()[isa][0]]
    return usable[0] if usable else None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, offsets: torch.Tensor, rank: int, scale: float,
                     isa: str) -> torch.Tensor:
    """q [B, H, D] (row b one sequence's query token in the latent space: q_nope W_uk, then
    q_pe; float32, or bf16 for a bf16 model) against the latents
    slots[offsets[b]:offsets[b + 1]] of one layer's caches [slots, 1, half] (D <= 2 * half)
    -> [B, H, rank] float32: softmax(q . latent * scale) times the latents' first `rank`
    values."""
    b, heads, d = q.shape
    half = k_cache.shape[-1]
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in CACHE_DTYPES
    assert k_cache.shape[1:] == v_cache.shape[1:] == (1, half) and d <= 2 * half
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and 0 < rank <= d
    assert slots.dtype == offsets.dtype == torch.long and offsets.numel() == b + 1
    assert slots.is_contiguous() and offsets.is_contiguous()
    bf16 = k_cache.dtype == torch.bfloat16
    pairs = isa == "avx512bf16" and bf16 and q.dtype == torch.bfloat16
    padded = -(-heads // HEAD_TILE) * HEAD_TILE
    qt = torch.zeros(b, d + (d % 2 if pairs else 0), padded)  # heads innermost: the lanes
    qt[:, :d, :heads] = q.float().transpose(1, 2) * (scale * math.log2(math.e))
    if pairs:  # [B, Dp / 2, Hp, 2] bf16: two latent values a 32-bit lane (vdpbf16ps)
        qt = qt.view(b, -1, 2, padded).transpose(2, 3).contiguous().to(torch.bfloat16)
    out = torch.empty(b, rank, padded)
    rc = _EXT.load().pf_mla_decode(_ISA_CODE[isa], qt.data_ptr(), k_cache.data_ptr(),
                                   v_cache.data_ptr(), bf16, pairs, slots.data_ptr(),
                                   offsets.data_ptr(), b, padded, d, rank, half,
                                   out.data_ptr())
    if rc:
        raise RuntimeError(f"pipefill {_WHAT} ({isa}) failed (rc={rc})")
    return out[:, :, :heads].transpose(1, 2)
