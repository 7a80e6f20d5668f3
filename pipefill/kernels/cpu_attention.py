"""Flash-style causal chunk attention on x86 vector units (AVX-512-BF16, AVX-512F, AVX2+FMA),
over the AMX kernel's packed paged KV cache (``AmxKVCache``; bf16 or float32), or over a
quantized token-major ``KVCache`` layer (int8 or fp8_e4m3 codes and a float32 scale per token
and KV head, kernels/kv_quant.py; pass its ``page_size``): each step's keys are widened in the
kernel into the values torch's dequantize gives in q's dtype, then read by the same loops.

API (what the engine calls):

* ``ISAS`` — the kernels, best first: ``avx512bf16`` (vdpbf16ps; bf16 q and cache),
  ``avx512`` and ``avx2`` (float32 compute; q float32 or bf16, cache float32 or bf16, a bf16
  cache is widened in the kernel by a shift).
* ``kernel_available(isa, flags=None) -> (ok, why)`` — never raises. ``flags``: the CPU flags to
  trust (default: /proc/cpuinfo; a caller hides flags to force a fallback). Builds/loads the
  extension and checks the CPU again with cpuid/XCR0 inside it.
* ``write_kv(k_cache, v_cache, k_new, v_new, page_table, start, page_size=0)`` — packs tokens
  ``[start, start + C)`` (converted to the cache dtype) and zeroes the rest of their 32-token
  group; a quantized cache (page_size given) gets the tokens' rows quantized (kv_quant.store).
* ``chunk_attention(isa, q, k_cache, v_cache, page_table, prefix_len, scale, k_new=None,
  v_new=None, out=None, qtile=0, kv_split=0, page_size=0, q_first=None, window=0) -> out`` —
  bottom-right causal attention of q [C, Hq, D] (positions [L, L + C)), head dim 64, 128 or
  256, over cached tokens [0, L + C), or under a sliding window (the query at p sees (p -
  window, p]) over the window's pages only; decode (one q-tile) over a long context splits the
  KV range into fixed parts merged by log-sum-exp (flash-decoding).
* ``decode_tables(page_tables, prefix_lens) -> (tables, lens)`` and ``decode_attention(isa, q,
  k_new, v_new, k_cache, v_cache, tables, lens, scale, out, page_size=0, window=0)`` — one decode step of a layer for B
  sequences in one call (each sequence's K/V write, then its attention; the tables are built
  once per step for all layers); bit-identical to B ``chunk_attention(..., k_new=, v_new=)`` calls.
* ``read_kv(...)`` — tokens back in token-major order (tests).

Build: ``csrc/cpu_attn_kernel.cpp`` is compiled three times into objects, each with only its own
-m flags and namespace; ``csrc/cpu_attn_ext.cpp`` (checks, packing, work split over torch's
OpenMP pool) is compiled without ISA flags and linked with them (~25 s once, cached in
``~/.cache/pipefill/kernels``).
"""
from __future__ import annotations

import logging
import math
import platform
import sys
import time

import torch

from pipefill.kernels.build import CSRC, GLUE_HEADER, LazyExtension
from pipefill.kernels.build import build_dir as kernel_build_dir
from pipefill.kernels.build import compile_object, link_glue, require_ninja
from pipefill.base.platform import cpu_flags
from pipefill.kernels.kv_quant import is_quantized, store

log = logging.getLogger("pipefill.kernels")

_KERNEL_SRC = CSRC / "cpu_attn_kernel.cpp"
_GLUE_SRC = CSRC / "cpu_attn_ext.cpp"
_HEADER = CSRC / "cpu_attn_kernel.h"
_BASE = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=fast", "-fno-exceptions", "-Wno-psabi"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
ISA_FLAGS = {
    "avx512bf16": _BASE + _AVX512 + ["-mavx512bf16", "-DPF_ATTN_BF16DOT=1", "-DPF_ATTN_ROWS=8",
                                            "-DPF_ATTN_WIDTH=16"],
    "avx512": _BASE + _AVX512 + ["-DPF_ATTN_ROWS=8", "-DPF_ATTN_WIDTH=16"],
    # F16C widens fp8 codes (every AVX2 CPU has it)
    "avx2": _BASE + ["-mavx2", "-mfma", "-mf16c", "-DPF_ATTN_ROWS=6", "-DPF_ATTN_WIDTH=8"],
}
ISAS = tuple(ISA_FLAGS)
# Decode over a long context: the keys are split into parts of this many (flash-decoding) once
# a step sees more than two parts, fixed so that no bit depends on the thread count. The one
# copy: the glue is compiled with it (PF_ATTN_KV_PART, its kAutoKvPart), and model/shared_head
# and the planner read it here without building anything.
DECODE_KV_PART = 1024
ISA_ID = {name: i for i, name in enumerate(ISAS)}  # must match kKernels in cpu_attn_ext.cpp
REQUIRED_CPU_FLAGS = {
    "avx512bf16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"),
    "avx2": ("avx2", "fma"),
}


def _build():
    require_ninja("the CPU attention kernels")
    build_dir = kernel_build_dir("cpu_attention")
    t0 = time.perf_counter()
    objs = [str(compile_object(_KERNEL_SRC, _HEADER, flags + [f"-DPF_ATTN_NS={isa}"], build_dir,
                               f"cpu_attn_{isa}"))
            for isa, flags in ISA_FLAGS.items()]
    mod = link_glue("pipefill_cpu_attention", _GLUE_SRC, [GLUE_HEADER, _HEADER], objs,
                    build_dir, defines=(f"-DPF_ATTN_KV_PART={DECODE_KV_PART}",))
    if time.perf_counter() - t0 > 2:
        log.info("pipefill CPU attention kernels ready after %.0f s", time.perf_counter() - t0)
    return mod


_extension = LazyExtension("CPU attention extension", _build)


def _load():
    """The extension module; raises RuntimeError with the reason if it cannot be built."""
    return _extension.load()


def kernel_available(isa: str, flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """(True, "ok") when kernel `isa` can run here, else (False, why). Never raises."""
    if isa not in ISA_FLAGS:
        return False, f"unknown kernel {isa!r} (choose from {', '.join(ISAS)})"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"needs Linux x86-64, this is {platform.system()} {platform.machine()}"
    flags = cpu_flags() if flags is None else flags
    missing = [f for f in REQUIRED_CPU_FLAGS[isa] if f not in flags]
    if missing:
        return False, "CPU lacks " + ", ".join(missing)
    try:
        ok, why = _load().cpu_supported(ISA_ID[isa])
    except Exception as e:  # noqa: BLE001
        return False, str(e)
    return (True, "ok") if ok else (False, f"cpuid: {why}")


def best_kernel(flags: frozenset[str] | None = None, bf16_dot: bool = True) -> str | None:
    """The best kernel this CPU runs; bf16_dot=False skips avx512bf16 (float32 q or cache)."""
    for isa in ISAS:
        if (bf16_dot or isa != "avx512bf16") and kernel_available(isa, flags)[0]:
            return isa
    return None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
             v_new: torch.Tensor, page_table: torch.Tensor, start: int,
             page_size: int = 0) -> None:
    dt = k_cache.dtype
    if is_quantized(dt):
        slots = quant_slots(page_table, start, k_new.shape[0], page_size)
        store(k_cache, slots, k_new)
        store(v_cache, slots, v_new)
        return
    _load().write_kv(k_cache, v_cache, k_new.to(dt), v_new.to(dt), page_table, int(start))


def quant_slots(page_table: torch.Tensor, start: int, count: int, page_size: int) -> torch.Tensor:
    """The rows of tokens [start, start + count) in a quantized (token-major) layer cache."""
    if page_size <= 0:
        raise ValueError("a quantized KV cache needs its page_size")
    pos = torch.arange(start, start + count)
    return page_table.long()[pos // page_size] * page_size + pos % page_size


def chunk_attention(isa: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, prefix_len: int, scale: float,
                    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, qtile: int = 0,
                    kv_split: int = 0, page_size: int = 0,
                    q_first: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Causal (bottom-right) attention of q [C, Hq, D] over cached tokens [0, prefix_len + C).
    q_first (int32 [Hkv + 1], query_head_offsets): KV head g serves query heads
    [q_first[g], q_first[g + 1]), groups of unequal sizes; None: equal groups.
    window (> 0, a sliding window): the query at position p sees keys (p - window, p] only,
    and no page wholly before the first query's window is read (its table entry may be stale;
    ARCHITECTURE.md, 'Window pages'); 0: the whole prefix.

    kv_split (split KV, for decode and small chunks that fit one q-tile): 0 = auto (parts of
    DECODE_KV_PART keys once the context exceeds two parts, so every thread works on one
    sequence; a cache of one KV head, a single work item unsplit, in two halves from 257 keys
    on, up to parts of DECODE_KV_PART), < 0 = never,
    > 0 = keys per part (a multiple of 64). The parts are fixed by the lengths, never by the
    thread count, and merged in order: results are bit-identical at any thread count."""
    if isa not in ISA_ID:
        raise ValueError(f"unknown kernel {isa!r} (choose from {', '.join(ISAS)})")
    ext = _load()
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both k_new and v_new, or neither")
    if k_new is not None:
        write_kv(k_cache, v_cache, k_new, v_new, page_table, prefix_len, page_size)
    return ext.chunk_attention(ISA_ID[isa], q, k_cache, v_cache, page_table, int(prefix_len),
                               float(scale), out, int(qtile), int(kv_split), int(page_size),
                               q_first, int(window))


def query_head_offsets(q_per_kv: tuple[int, ...]) -> torch.Tensor | None:
    """The kernels' q_first for KV heads serving q_per_kv[g] query heads each, in order: int32
    [Hkv + 1] running offsets; None for () (equal groups, the kernels' own layout)."""
    if not q_per_kv:
        return None
    offsets = [0]
    for n in q_per_kv:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32)


def decode_tables(page_tables: list[torch.Tensor],
                  prefix_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-step arguments of decode_attention: page tables as one int32 [B, max pages]
    tensor (short rows padded with page 0, never read) and the prefix lengths as int64 [B]."""
    if len(page_tables) != len(prefix_lens):
        raise ValueError(f"{len(page_tables)} page tables for {len(prefix_lens)} prefix lengths")
    width = max((t.shape[0] for t in page_tables), default=0)
    tables = torch.zeros(len(page_tables), width, dtype=torch.int32)
    for row, t in zip(tables, page_tables):
        row[:t.shape[0]] = t
    return tables, torch.tensor(prefix_lens, dtype=torch.int64)


def decode_attention(isa: str, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, scale: float, out: torch.Tensor,
                     page_size: int = 0, q_first: torch.Tensor | None = None,
                     window: int = 0,
                     shared: tuple[int, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One decode step of a layer: row b of q/k_new/v_new [B, H, D] is sequence b's new token
    at position lens[b]; its K/V go into the cache (converted to the cache dtype), then out[b] =
    its attention over tokens [0, lens[b] + 1). All (sequence, kv head, split part) items share
    one pool of threads; each is computed as chunk_attention computes it (same split parts).
    A quantized cache (page_size given) gets each new row quantized as kv_quant.quantize does.
    q_first, window: as chunk_attention's. shared (head, parts int64 [B, 2], partials float32
    [B, P, G, D + 2]): KV head `head` is split by keys with another TP rank; this call computes only its
    split parts [parts[b, 0], parts[b, 1]) (decode_parts gives each sequence's count, at least
    2) and leaves their unmerged (O, max, sum) in `partials`, part order, out's rows of that head
    untouched (merge_gathered fills them); the new token is written into this cache either way."""
    if isa not in ISA_ID:
        raise ValueError(f"unknown kernel {isa!r} (choose from {', '.join(ISAS)})")
    head, parts, partials = shared if shared is not None else (-1, None, None)
    _load().decode_attention(ISA_ID[isa], q, k_new, v_new, k_cache, v_cache, tables, lens,
                             float(scale), out, int(page_size), q_first, int(window), int(head),
                             parts, partials)
    return out


def decode_parts(lens: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The split-KV parts of each sequence's decode step (int64 [B], 1 = not split) for prefix
    lengths `lens` (int64 [B]) over a layer (cache) of `kv_heads` KV heads, as
    decode_attention cuts them (one KV head is halved early: chunk_attention's kv_split)."""
    return _load().decode_parts(lens, int(kv_heads))


def built_kv_part() -> int:
    """The keys per split part the built glue uses (DECODE_KV_PART, as compiled in)."""
    return _load().auto_kv_part()


def merge_gathered(gathered: torch.Tensor, counts: torch.Tensor, out: torch.Tensor,
                   first: int) -> torch.Tensor:
    """A shared KV head's attention from every rank's partials: gathered float32 [ranks, B, P,
    G, D + 2] (each rank's decode_attention `shared` partials), counts int64 [ranks, B] the
    parts each rank computed, in part order rank after rank; writes out[b, first:first + G].
    The same arithmetic in the same part order as one call computing every part."""
    _load().merge_gathered(gathered, counts, out, int(first))


def read_kv(k_layer_cache: torch.Tensor, v_layer_cache: torch.Tensor, page_table: torch.Tensor,
            num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [0, num_tokens) back in token-major [n, Hkv, D] layout (bf16 or float32 cache)."""
    if k_layer_cache.dtype != torch.float32:
        from pipefill.kernels.amx_attention import read_kv as read_bf16
        return read_bf16(k_layer_cache, v_layer_cache, page_table, num_tokens)
    P, H, ps, D = k_layer_cache.shape
    npages = math.ceil(num_tokens / ps)
    pages = page_table[:npages].long()
    k = k_layer_cache[pages]
    v = v_layer_cache[pages]
    # K: [ps/16][D/32][16 pairs][2][16 tokens] -> [ps/16, 16 tokens, D/32, 16 pairs, 2]
    k = k.reshape(npages, H, ps // 16, D // 32, 16, 2, 16).permute(0, 2, 6, 1, 3, 4, 5)
    k = k.reshape(npages * ps, H, D)
    # V: [ps/32][D/16][16 token pairs][2][16 dims] -> [ps/32, pairs, 2, D/16, 16 dims]
    v = v.reshape(npages, H, ps // 32, D // 16, 16, 2, 16).permute(0, 2, 4, 5, 1, 3, 6)
    v = v.reshape(npages * ps, H, D)
    return k[:num_tokens].contiguous(), v[:num_tokens].contiguous()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    for name in ISAS:
        print(name, kernel_available(name), file=sys.stderr)
