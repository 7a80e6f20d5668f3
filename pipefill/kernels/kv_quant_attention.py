"""Decode attention that reads an int8 KV cache natively on the sdpa path (ARCHITECTURE.md,
'The KV room'; where a vector kernel fits, kernels/cpu_attention.py reads quantized pages
instead, prefill and decode):
one query token per sequence over its cached rows of int8 codes and a float32 scale
(pipefill/kernels/kv_quant.py), widened to float32 in registers, each row's scale applied once
per dot product (K) and folded into the softmax weight (V), so no dequantized copy of the
context is made. float32 sums; q is widened from bf16 and the output rounded back.

Paths, one C++ source compiled once per ISA with its own -m flags, chosen at run time from
cpuid (``disable=`` forces paths off, as the tests do): ``avx512``, ``avx2`` (AVX2 + FMA) and
``scalar``; where the extension cannot build, ``decode_isa`` answers None and the sdpa path
dequantizes the rows in torch instead (fp8_e4m3 caches and prefill chunks always do).

API: ``slot_index(read_slots) -> (slots, offsets)`` (once per step), ``decode_attention(q
[B, Hq, D], k_cache, v_cache [slots, H, D + 4] int8, slots, offsets, scale, isa, out=None) ->
[B, Hq, D]`` (one call per layer for a whole decode step: (sequence, KV head) pairs split over
torch's threads); ``decode_isa(disable=()) -> isa or None``; ``isa_status()``.
"""
from __future__ import annotations

import functools

import torch

from pipefill.base.platform import VECTOR_ISA_CPU_FLAGS
from pipefill.kernels.build import CSRC, GLUE_VECTOR_ISA, IsaExtension, build_isa_extension
from pipefill.kernels.kv_quant import SCALE_BYTES

ISAS = ("avx512", "avx2", "scalar")  # preference order
ISA_CPU_FLAGS = VECTOR_ISA_CPU_FLAGS  # the CPU flags each build needs
_ISA_CODE = {"scalar": 0, "avx2": 1, "avx512": 2}
_BASE = ["-O3", "-std=c++17", "-fPIC", "-fno-exceptions"]
_ISA_FLAGS = {"scalar": _BASE,
              "avx2": _BASE + ["-mavx2", "-mfma"],
              "avx512": _BASE + ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl"]}
_HEADER = CSRC / "kv_quant_attn_kernel.h"
_WHAT = "the int8 KV decode attention"

_EXT = IsaExtension(_WHAT, functools.partial(
    build_isa_extension, "kv_quant_attn", _WHAT, _ISA_FLAGS, (_HEADER,),
    (GLUE_VECTOR_ISA, _HEADER), source=CSRC / "kv_quant_attn_isa.cpp", isa_define="PF_QA_NS"),
    _ISA_CODE, "pf_qa_isa_supported")


def isa_status() -> dict[str, tuple[bool, str]]:
    """{isa: (usable here, why not)}; builds (or loads the cached) extension once."""
    return _EXT.status()


@functools.cache
def decode_isa(disable: tuple[str, ...] = ()) -> str | None:
    """The fastest path that runs here and is not disabled, or None (torch dequantizes)."""
    usable = [isa for isa in ISAS if isa not in disable and isa_status()[isa][0]]
    return usable[0] if usable else None


def slot_index(read_slots: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached tokens of B sequences (each a slice or an index of cache rows) as one int64
    index and its offsets [B + 1] (decode_attention's slots and offsets), built once per step.
    The slots come from the plan's page tables, whose pages every stage checked against its
    pool (kv/pool.PageOwners): the kernel does not bound-check them again."""
    parts = [torch.arange(s.start, s.stop, dtype=torch.long) if isinstance(s, slice)
             else s.to(torch.long) for s in read_slots]
    offsets = torch.zeros(len(parts) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor([p.numel() for p in parts]).cumsum(0)
    return torch.cat(parts).contiguous(), offsets


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, offsets: torch.Tensor, scale: float, isa: str,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] (float32 or bf16; row b one sequence's query token) attending to the rows
    slots[offsets[b]:offsets[b + 1]] of one layer's int8 caches [slots, H, D + 4] -> out
    [B, Hq, D] in q's dtype (written into `out` when given)."""
    b, hq, d = q.shape
    heads, row = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.dtype == v_cache.dtype == torch.int8 and row == d + SCALE_BYTES
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and hq % heads == 0
    assert slots.dtype == offsets.dtype == torch.long and offsets.numel() == b + 1
    qf = q.float().contiguous()
    res = torch.empty(b, hq, d, dtype=torch.float32)
    rc = _EXT.load().pf_qa_decode(_ISA_CODE[isa], qf.data_ptr(), k_cache.data_ptr(),
                                  v_cache.data_ptr(), slots.data_ptr(), offsets.data_ptr(), b,
                                  hq, heads, d, row, float(scale), res.data_ptr())
    if rc:
        raise RuntimeError(f"pipefill {_WHAT} ({isa}) failed (rc={rc})")
    if out is None:
        return res.to(q.dtype)
    return out.copy_(res)
