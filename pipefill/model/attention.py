"""Attention over the paged KV cache for chunks at any prefix length and for decode.

A chunk's queries sit at positions [L, L+C) and see keys [0, L+C) (causal, aligned bottom-right).
torch's CPU flash kernel aligns `is_causal` top-left and, given a mask, computes every block, so
we call it twice: the cached prefix [0, L) with no mask, the square diagonal block with
`is_causal=True` (where top-left == bottom-right), then merge the two by their log-sum-exps.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from pipefill.base.platform import VECTOR_ISA_CPU_FLAGS, dtype_name, isas_lacking_flags
from pipefill.kernels.kv_quant import QUANT_KV_DTYPES, as_stored, is_quantized, load, store

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class SeqMeta:
    """One sequence's slice of a packed forward batch."""
    row_start: int  # first row of this sequence in the packed [num_tokens, ...] tensors
    num_new: int  # C: tokens computed in this forward
    prefix_len: int  # L: tokens already in the cache
    write_slots: slice | torch.Tensor  # cache slots of the C new tokens
    read_slots: slice | torch.Tensor  # cache slots of tokens [0, L + C)
    page_table: torch.Tensor  # int32 [ceil((L + C) / page_size)] page ids of tokens [0, L + C)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    # [tokens, heads, dim] -> [1, heads, tokens, dim] as a view.
    return x.unsqueeze(0).transpose(1, 2)


def _flash_attend(q, k, v, causal: bool, scale: float):
    out, lse = _flash(heads_first(q), heads_first(k), heads_first(v), 0.0, causal, scale=scale)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)  # [C, Hq, D], [C, Hq]


def _merge(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return (out_a.float() * w_a + out_b.float() * w_b).to(out_a.dtype)


def split_attention(q, k_prefix, v_prefix, k_diag, v_diag, scale: float) -> torch.Tensor:
    """q [C, Hq, D] at the end of the prefix: the prefix with no mask and the square diagonal
    block with is_causal, merged by log-sum-exp. The prefix may be empty."""
    out_d, lse_d = _flash_attend(q, k_diag, v_diag, True, scale)
    if k_prefix.shape[0] == 0:
        return out_d
    out_p, lse_p = _flash_attend(q, k_prefix, v_prefix, False, scale)
    return _merge(out_p, lse_p, out_d, lse_d)


def attend_sequence(q, k, v, k_cache, v_cache, seq: SeqMeta, scale: float,
                    window: int | None = None, native: str | None = None) -> torch.Tensor:
    """q [C, Hq, D], k/v [C, Hkv, D] of the new tokens (already written to the cache).
    window: each query sees only the last `window` keys up to its own position; native: the
    int8 decode kernel's path for a decode row (native_decode_isa), None: torch reads."""
    decode = seq.num_new == 1 and seq.prefix_len > 0 and not q.is_cuda
    if window is not None and seq.prefix_len + seq.num_new > window:
        if decode and native is not None:  # the kernel reads the window's rows only
            end = seq.prefix_len + 1
            return _native_decode(q, k_cache, v_cache,
                                  _slot_range(seq.read_slots, end - window, end), scale, native)
        return _attend_window(q, k, v, k_cache, v_cache, seq, window, scale)
    if q.is_cuda:
        return _attend_cuda(q, load(k_cache, seq.read_slots, q.dtype),
                            load(v_cache, seq.read_slots, q.dtype), scale)
    if decode:  # one query sees every key
        if native is not None:
            return _native_decode(q, k_cache, v_cache, seq.read_slots, scale, native)
        keys, values = load(k_cache, seq.read_slots, q.dtype), load(v_cache, seq.read_slots,
                                                                    q.dtype)
        return _flash_attend(q, keys, values, False, scale)[0]
    prefix = _prefix_slots(seq)
    # A cache in another dtype (--kv-cache-dtype): the new tokens are read back rounded too.
    k_new, v_new = as_stored(k, k_cache.dtype), as_stored(v, v_cache.dtype)
    return split_attention(q, load(k_cache, prefix, q.dtype), load(v_cache, prefix, q.dtype),
                           k_new, v_new, scale)


def _native_decode(q, k_cache, v_cache, slots, scale: float, isa: str) -> torch.Tensor:
    """One decode row over the int8 cache rows `slots` on the C++ kernel (native_decode_isa)."""
    from pipefill.kernels.kv_quant_attention import decode_attention, slot_index
    return decode_attention(q, k_cache, v_cache, *slot_index([slots]), scale, isa)


def native_decode_isa(kv_dtype: torch.dtype,
                      flags: frozenset[str] | None = None) -> str | None:
    """The path of the C++ kernel that reads an int8 cache's rows in registers for decode rows
    (kernels/kv_quant_attention.py) that runs here and that the trusted CPU flags allow (as
    --hide-cpu-flags leaves them); None: torch dequantizes the rows."""
    if kv_dtype != torch.int8:
        return None
    # Imported on use: the module brings the kernel build (torch.utils.cpp_extension).
    from pipefill.kernels.kv_quant_attention import decode_isa
    return decode_isa(isas_lacking_flags(VECTOR_ISA_CPU_FLAGS, flags))


def _attend_window(q, k, v, k_cache, v_cache, seq: SeqMeta, window: int,
                   scale: float) -> torch.Tensor:
    """Sliding-window attention: the query at position p sees keys (p - window, p] (HF's
    sliding_window_overlay: kv > q - window, with the causal kv <= q). Only keys from
    L - window + 1 on can be seen by any of the chunk's queries [L, L + C); an explicit mask
    bounds each row."""
    first = max(0, seq.prefix_len - window + 1)
    cached = _slot_range(seq.read_slots, first, seq.prefix_len)
    k_new, v_new = as_stored(k, k_cache.dtype), as_stored(v, v_cache.dtype)
    keys = torch.cat([load(k_cache, cached, q.dtype), k_new])
    values = torch.cat([load(v_cache, cached, q.dtype), v_new])
    q_pos = torch.arange(seq.prefix_len, seq.prefix_len + seq.num_new, device=q.device)[:, None]
    k_pos = torch.arange(first, seq.prefix_len + seq.num_new, device=q.device)[None, :]
    mask = None if seq.num_new == 1 else (k_pos <= q_pos) & (k_pos > q_pos - window)
    out = torch.nn.functional.scaled_dot_product_attention(
        heads_first(q), heads_first(keys), heads_first(values), attn_mask=mask, scale=scale,
        enable_gqa=True)
    return out[0].transpose(0, 1)


def _slot_range(slots, start: int, end: int):
    """The cache slots of tokens [start, end) of a sequence whose slots are `slots`."""
    if isinstance(slots, slice):
        return slice(slots.start + start, slots.start + end)
    return slots[start:end]


def _attend_cuda(q, keys, values, scale: float) -> torch.Tensor:
    # CUDA's efficient-attention kernel supports the bottom-right causal mask natively.
    from torch.nn.attention.bias import causal_lower_right
    mask = causal_lower_right(q.shape[0], keys.shape[0])
    out = torch.nn.functional.scaled_dot_product_attention(
        heads_first(q), heads_first(keys), heads_first(values), attn_mask=mask, scale=scale,
        enable_gqa=True)
    return out[0].transpose(0, 1)


def _prefix_slots(seq: SeqMeta):
    slots = seq.read_slots
    if isinstance(slots, slice):
        return slice(slots.start, slots.start + seq.prefix_len)
    return slots[:seq.prefix_len]


def write_kv(k_cache, v_cache, k, v, seqs: list[SeqMeta]) -> None:
    for seq in seqs:
        rows = slice(seq.row_start, seq.row_start + seq.num_new)
        store(k_cache, seq.write_slots, k[rows])  # --kv-cache-dtype may differ (quantized)
        store(v_cache, seq.write_slots, v[rows])


def paged_attention(q, k, v, k_cache, v_cache, seqs: list[SeqMeta], scale: float,
                    window: int | None = None, native: str | None = None):
    """q [T, Hq, D], k/v [T, Hkv, D] packed over sequences -> [T, Hq, D]. window, native: as
    attend_sequence's. Sequences in order, each written then attended, as every attention
    callable here computes them: the pieces of a window layer's chunk (window_pieces) are
    sequences over one ring of pages, where a later piece overwrites what an earlier reads."""
    if len(seqs) == 1:
        write_kv(k_cache, v_cache, k, v, seqs)
        return attend_sequence(q, k, v, k_cache, v_cache, seqs[0], scale, window, native)
    out = torch.empty_like(q)
    for seq in seqs:
        rows = slice(seq.row_start, seq.row_start + seq.num_new)
        write_kv(k_cache, v_cache, k, v, [seq])
        out[rows] = attend_sequence(q[rows], k[rows], v[rows], k_cache, v_cache, seq, scale,
                                    window, native)
    return out


def profiled(name: str):
    """A named range for the time split while a profiler records; nothing otherwise (a range
    costs ~7 us, a tenth of a decode layer's work at batch 1)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return nullcontext()


def amx_paged_attention(q, k, v, k_cache, v_cache, seqs: list[SeqMeta], scale: float):
    """The fused AMX kernel; it writes the new K/V into its packed cache layout itself."""
    out = torch.empty_like(q)
    with profiled("pipefill::amx_attention"):  # for the time split
        for seq in seqs:
            rows = slice(seq.row_start, seq.row_start + seq.num_new)
            _amx_rows(q[rows], k[rows], v[rows], k_cache, v_cache, seq, scale, out[rows])
    return out


def _amx_rows(q, k, v, k_cache, v_cache, seq: SeqMeta, scale: float, out) -> None:
    """One sequence's rows through the AMX kernel into out."""
    from pipefill.kernels.amx_attention import chunk_attention
    chunk_attention(q, k_cache, v_cache, seq.page_table, seq.prefix_len, scale, k_new=k,
                    v_new=v, out=out)


# Fused kernels over the packed paged cache (pipefill.kernels.amx_attention.AmxKVCache), best
# first; "sdpa" is the split-SDPA fallback over the token-major KVCache.
KERNEL_BACKENDS = ("amx", "avx512bf16", "avx512", "avx2")
_STRENGTH = {"amx": "the CPU has AMX-BF16", "avx512bf16": "the CPU has AVX512-BF16 (vdpbf16ps)",
             "avx512": "the CPU has AVX-512F", "avx2": "the CPU has AVX2 and FMA"}


@dataclass
class VectorAttention:
    """The attention callable of a vector kernel; it packs the new K/V into its cache itself.
    q_first: the kernels' map of unequal query groups (cpu_attention.query_head_offsets of the
    rank's ModelConfig.q_per_kv), None for equal ones. window: a sliding-window layer's, which
    the kernels bound themselves, reading only the window's pages."""
    isa: str
    q_first: torch.Tensor | None = None

    def __call__(self, q, k, v, k_cache, v_cache, seqs: list[SeqMeta], scale: float,
                 window: int | None = None):
        out = torch.empty_like(q)
        with self.profiled():
            for seq in seqs:
                rows = slice(seq.row_start, seq.row_start + seq.num_new)
                self.decode_one(q[rows], k[rows], v[rows], k_cache, v_cache, seq, scale,
                                out[rows], window)
        return out

    def decode_one(self, q, k, v, k_cache, v_cache, seq: SeqMeta, scale: float, out,
                   window: int | None = None) -> None:
        """One sequence's rows (any count, the name is for the decode path's use) into out."""
        from pipefill.kernels.cpu_attention import chunk_attention
        chunk_attention(self.isa, q, k_cache, v_cache, seq.page_table, seq.prefix_len, scale,
                        k_new=k, v_new=v, out=out, q_first=self.q_first, window=window or 0)

    @staticmethod
    def decode_tables(seqs: list[SeqMeta]) -> tuple[torch.Tensor, torch.Tensor]:
        """decode_batch's per-step arguments (page tables, prefix lengths): once per step."""
        from pipefill.kernels.cpu_attention import decode_tables
        return decode_tables([s.page_table for s in seqs], [s.prefix_len for s in seqs])

    def decode_batch(self, q, k, v, k_cache, v_cache, tables, scale: float, out,
                     window: int | None = None) -> None:
        """One decode step of a layer, every sequence (one new token each, rows in seqs order)
        in one call: its K/V into the cache, its attention into out (under a sliding window:
        over the window's pages only). Same bits as decode_one per sequence."""
        from pipefill.kernels.cpu_attention import decode_attention
        decode_attention(self.isa, q, k, v, k_cache, v_cache, *tables, scale, out,
                         q_first=self.q_first, window=window or 0)

    @staticmethod
    def profiled():
        return profiled("pipefill::cpu_attention")


@dataclass
class QuantVectorAttention(VectorAttention):
    """A vector kernel over a quantized (int8, fp8_e4m3) token-major KVCache: the kernel widens
    each step's codes x scales itself (ARCHITECTURE.md, 'The KV room'); the layer caches do not
    hold their page size, so it travels here."""
    page_size: int = 0

    def decode_one(self, q, k, v, k_cache, v_cache, seq: SeqMeta, scale: float, out,
                   window: int | None = None) -> None:
        from pipefill.kernels.cpu_attention import chunk_attention
        chunk_attention(self.isa, q, k_cache, v_cache, seq.page_table, seq.prefix_len, scale,
                        k_new=k, v_new=v, out=out, page_size=self.page_size,
                        q_first=self.q_first, window=window or 0)

    def decode_batch(self, q, k, v, k_cache, v_cache, tables, scale: float, out,
                     window: int | None = None) -> None:
        from pipefill.kernels.cpu_attention import decode_attention
        decode_attention(self.isa, q, k, v, k_cache, v_cache, *tables, scale, out,
                         page_size=self.page_size, q_first=self.q_first, window=window or 0)


@dataclass
class AmxAttention(VectorAttention):
    """AMX for prefill chunks; decode rows on the avx512bf16 vector kernel (isa), which reads
    the same packed bf16 cache (the layouts are byte-identical). One query token per sequence
    fills 3 of an AMX tile's 16 rows, and the vector kernel's decode entry serves a whole batch
    per layer (the lean decode path's decode_batch)."""
    isa: str = "avx512bf16"

    def __call__(self, q, k, v, k_cache, v_cache, seqs: list[SeqMeta], scale: float):
        out = torch.empty_like(q)
        with profiled("pipefill::amx_attention"):
            for seq in seqs:
                rows = slice(seq.row_start, seq.row_start + seq.num_new)
                attend = self.decode_one if seq.num_new == 1 and seq.prefix_len > 0 else _amx_rows
                attend(q[rows], k[rows], v[rows], k_cache, v_cache, seq, scale, out[rows])
        return out


@dataclass
class QuantSdpaAttention:
    """The sdpa path over an int8 cache whose native decode kernel runs here (`isa`, one of
    kernels/kv_quant_attention.ISAS), with the lean decode path's entry points (DecodeRunner):
    a decode step's rows write their K/V and attend on the kernel in one call per layer, the
    same bits as paged_attention gives them row by row."""
    isa: str

    def __call__(self, q, k, v, k_cache, v_cache, seqs: list[SeqMeta], scale: float,
                 window: int | None = None):
        return paged_attention(q, k, v, k_cache, v_cache, seqs, scale, window, self.isa)

    @staticmethod
    def decode_tables(seqs: list[SeqMeta]) -> tuple:
        """decode_batch's per-step arguments, for every layer: the rows' write slots as one
        index, their read slots and offsets (kv_quant_attention.slot_index)."""
        from pipefill.kernels.kv_quant_attention import slot_index
        writes = [s.write_slots for s in seqs]
        return (slot_index(writes)[0], *slot_index([s.read_slots for s in seqs]))

    def decode_batch(self, q, k, v, k_cache, v_cache, tables, scale: float, out) -> None:
        """One decode step of a layer: every row's K/V into the cache, then its attention on
        the kernel, all rows in one call each."""
        from pipefill.kernels.kv_quant_attention import decode_attention
        writes, slots, offsets = tables
        store(k_cache, writes, k)
        store(v_cache, writes, v)
        decode_attention(q, k_cache, v_cache, slots, offsets, scale, self.isa, out)

    @staticmethod
    def profiled():
        return profiled("pipefill::attention")


@dataclass
class PerKVHead:
    """A torch attention path (paged_attention) over a TP rank's unequal query groups
    (ModelConfig.q_per_kv): one call per local KV head, over its query heads and its slice of
    the token-major cache, as an ordinary GQA layer of one KV head."""
    inner: object
    q_per_kv: tuple[int, ...]

    def __call__(self, q, k, v, k_cache, v_cache, seqs: list[SeqMeta], scale: float, **kw):
        outs, first = [], 0
        for g, count in enumerate(self.q_per_kv):
            kv = slice(g, g + 1)
            outs.append(self.inner(q[:, first:first + count], k[:, kv], v[:, kv],
                                   k_cache[:, kv], v_cache[:, kv], seqs, scale, **kw))
            first += count
        return torch.cat(outs, dim=1)


def _write_packed(pack, k_cache, v_cache, k, v, seqs: list[SeqMeta]) -> None:
    for seq in seqs:
        rows = slice(seq.row_start, seq.row_start + seq.num_new)
        pack(k_cache, v_cache, k[rows], v[rows], seq.page_table, seq.prefix_len)


def kv_writer(attention):
    """(k_cache, v_cache, k, v, seqs) -> None writing new K/V in the layout `attention` reads
    (as write_kv does for the token-major cache), with no attention computed; None for an
    attention callable this module does not know."""
    if isinstance(attention, QuantVectorAttention):  # the token-major quantized cache
        return write_kv
    if isinstance(attention, VectorAttention):
        from pipefill.kernels.cpu_attention import write_kv as pack
        return partial(_write_packed, pack)
    if attention is amx_paged_attention:
        from pipefill.kernels.amx_attention import write_kv as pack
        return partial(_write_packed, pack)
    if attention is paged_attention or isinstance(attention, QuantSdpaAttention):
        return write_kv
    if isinstance(attention, PerKVHead):  # every KV head at once, as the inner path writes
        return kv_writer(attention.inner)
    return None


def window_pieces(seq: SeqMeta, piece: int) -> list[SeqMeta]:
    """seq's new tokens cut at the multiples of `piece` tokens (ForwardMeta.window_piece; 0:
    not cut), each piece a sequence of its own over the same table, in order. A window
    layer's pages form a ring in which a later page of a long chunk takes over a page an
    earlier piece reads (ARCHITECTURE.md, 'Window pages'): computed piece after piece, every
    piece reads its keys before they are overwritten."""
    start, end = seq.prefix_len, seq.prefix_len + seq.num_new
    if piece <= 0 or seq.num_new == 0 or start // piece == (end - 1) // piece:
        return [seq]
    cuts = [start, *range((start // piece + 1) * piece, end, piece), end]
    return [SeqMeta(seq.row_start + a - start, b - a, a, _span(seq.read_slots, a, b),
                    _first(seq.read_slots, b), seq.page_table) for a, b in zip(cuts, cuts[1:])]


def attention_in_pieces(attention, q, k, v, k_cache, v_cache, seqs: list[SeqMeta],
                        scale: float, window: int, piece: int) -> torch.Tensor:
    """A window layer's attention (`attention`'s, with its window) over window_pieces, in one
    call: every attention callable computes its sequences in order, each written then
    attended (a vector kernel writes each piece's rows of the output in place)."""
    pieces = [p for seq in seqs for p in window_pieces(seq, piece)]
    return attention(q, k, v, k_cache, v_cache, pieces, scale, window=window)


def last_rows_attention(attention, writer, q, k, v, k_cache, v_cache, seqs: list[SeqMeta],
                        keep: list[bool], scale: float, window: int | None = None,
                        piece: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's new K/V into the cache, and attention for the last query row of the
    sequences with keep[i] only -> ([sum(keep), Hq, D], those rows' indices in q). That row is
    the last new token at position L + C - 1 over keys [0, L + C): the same attention as in
    the whole chunk's call. piece: a window layer's (window_pieces), whose K/V go into the
    cache piece after piece, so a page of the ring holds its latest page's keys."""
    heads, lasts = [], []
    for seq, wanted in zip(seqs, keep):
        n = seq.num_new - 1 if wanted else seq.num_new
        if n > 0:
            heads += window_pieces(SeqMeta(seq.row_start, n, seq.prefix_len,
                                           _first(seq.write_slots, n), seq.read_slots,
                                           seq.page_table), piece)
        if wanted:
            lasts.append(SeqMeta(seq.row_start + n, 1, seq.prefix_len + n,
                                 _last(seq.write_slots), seq.read_slots, seq.page_table))
    if heads:
        writer(k_cache, v_cache, k, v, heads)
    rows = torch.tensor([s.row_start for s in lasts], dtype=torch.long, device=q.device)
    if not lasts:
        return q.new_empty((0, *q.shape[1:])), rows
    compact = [SeqMeta(i, 1, s.prefix_len, s.write_slots, s.read_slots, s.page_table)
               for i, s in enumerate(lasts)]
    # Paths that take no window (AMX, the latent cache's) are never chosen for windowed layers.
    windowed = {} if window is None else {"window": window}
    return attention(q[rows], k[rows], v[rows], k_cache, v_cache, compact, scale,
                     **windowed), rows


def _span(slots, start: int, end: int):
    """Entries [start, end) of a slot slice or index."""
    return slice(slots.start + start, slots.start + end) if isinstance(slots, slice) \
        else slots[start:end]


def _first(slots, n: int):
    return _span(slots, 0, n)


def _last(slots):
    return slice(slots.stop - 1, slots.stop) if isinstance(slots, slice) else slots[-1:]


def cpu_paged_attention(isa: str, kv_dtype: torch.dtype | None = None,
                        page_size: int = 0, q_per_kv: tuple[int, ...] = ()) -> VectorAttention:
    from pipefill.kernels.cpu_attention import query_head_offsets
    q_first = query_head_offsets(q_per_kv)
    if kv_dtype is not None and is_quantized(kv_dtype):
        return QuantVectorAttention(isa, q_first, page_size)
    return VectorAttention(isa, q_first)


def uses_packed_cache(backend: str, kv_dtype: torch.dtype) -> bool:
    """Whether the stage's cache is the kernels' packed AmxKVCache (else the token-major
    KVCache, which a quantized cache always is)."""
    return backend in KERNEL_BACKENDS and not is_quantized(kv_dtype)


def backend_attention(backend: str, flags: frozenset[str] | None = None,
                      kv_dtype: torch.dtype | None = None, page_size: int = 0,
                      q_per_kv: tuple[int, ...] = ()):
    """(q, k, v, k_cache, v_cache, seqs, scale) -> out for a backend choose_backend returned
    (flags: the CPU flags to trust, as there; kv_dtype: the cache's, where it may be quantized;
    page_size: the cache's, which a vector kernel over a quantized cache needs; q_per_kv: a TP
    rank's unequal query groups, ModelConfig.q_per_kv)."""
    if backend == "sdpa":
        if q_per_kv:  # one KV head a call (the int8 decode kernel's batched entry is not used)
            return PerKVHead(paged_attention, q_per_kv)
        isa = native_decode_isa(kv_dtype, flags) if kv_dtype == torch.int8 else None
        return paged_attention if isa is None else QuantSdpaAttention(isa)
    if backend == "amx":
        assert not q_per_kv, "choose_backend refuses AMX for unequal query groups"
        from pipefill.kernels.cpu_attention import kernel_available
        if kernel_available("avx512bf16", flags)[0]:
            return AmxAttention()
        return amx_paged_attention
    return cpu_paged_attention(backend, kv_dtype, page_size, q_per_kv)


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: auto keeps the compute dtype (float32 models stay exact; bf16 is an
    opt-in halving of KV memory; int8 and fp8_e4m3 keep one byte a value plus a float32 scale
    per token and head, kernels/kv_quant.py), else the named dtype."""
    if name == "auto":
        return dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, **QUANT_KV_DTYPES}[name]


# Head dims the kernels take: the vector kernels 256 too (Gemma 3), AMX not.
_HEAD_DIMS = {"amx": (64, 128)}
_VECTOR_HEAD_DIMS = (64, 128, 256)


def _unfit(backend: str, dtype, kv_dtype, head_dim: int, page_size: int, device,
           flags, unequal_groups: bool = False, windowed: bool = False) -> str | None:
    """Why `backend` cannot serve this stage, or None."""
    if device.type != "cpu":
        return f"device is {device.type}"
    if windowed and backend == "amx":
        return ("the model has sliding-window layers, which the AMX kernel does not bound "
                "(the vector kernels do)")
    if unequal_groups and backend == "amx":
        return ("this TP rank's KV heads serve unequal query groups (a straddled GQA group), "
                "which the AMX kernel does not take (the vector kernels do)")
    quantized = is_quantized(kv_dtype)  # (ARCHITECTURE.md, 'The KV room')
    if quantized and backend == "amx":
        return (f"the KV cache is {dtype_name(kv_dtype)} (quantized), which the AMX kernel does "
                f"not read (the vector kernels do)")
    if backend in ("amx", "avx512bf16"):
        if dtype != torch.bfloat16:
            return f"dtype is {dtype}, the kernel is bfloat16-only"
        if kv_dtype != torch.bfloat16 and not quantized:
            return f"the KV cache is {kv_dtype}, the kernel is bfloat16-only"
    elif dtype not in (torch.float32, torch.bfloat16):
        return f"dtype is {dtype}, the kernel takes float32 and bfloat16"
    dims = _HEAD_DIMS.get(backend, _VECTOR_HEAD_DIMS)
    if head_dim not in dims:
        return (f"head_dim is {head_dim}, the kernel supports "
                f"{', '.join(map(str, dims[:-1]))} and {dims[-1]}")
    if page_size % 32:
        return f"--page-size {page_size} is not a multiple of 32"
    if backend == "amx":
        from pipefill.kernels import amx_attention
        missing = [f for f in amx_attention.REQUIRED_CPU_FLAGS
                   if flags is not None and f not in flags]
        if missing:
            return "CPU lacks " + ", ".join(missing)
        ok, reason = amx_attention.amx_available()
        return None if ok else reason
    from pipefill.kernels.cpu_attention import kernel_available
    ok, reason = kernel_available(backend, flags)
    return None if ok else reason


def choose_backend(requested: str, dtype: torch.dtype, head_dim: int, page_size: int,
                   device: torch.device, kv_dtype: torch.dtype | None = None,
                   flags: frozenset[str] | None = None,
                   windowed: bool = False, latent: bool = False,
                   unequal_groups: bool = False) -> tuple[str, str]:
    """-> (backend, why). auto: the first of KERNEL_BACKENDS that fits the dtypes, the shapes and
    the CPU (flags: the CPU flags to trust, default all), else sdpa with every reason. A named
    kernel that does not fit is a ValueError with the reason. windowed: the model has
    sliding-window layers, which the vector kernels bound (AMX does not); latent: its layers
    attend from a latent KV cache (model/mla.py), which only the torch path reads;
    unequal_groups: a TP rank's query groups differ in size (ModelConfig.q_per_kv), which AMX
    does not take."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if latent and is_quantized(kv_dtype):
        raise ValueError(f"--kv-cache-dtype: the model keeps a latent KV cache (MLA), which is "
                         f"not quantized yet; use auto, bfloat16 or float32, not "
                         f"{dtype_name(kv_dtype)}")
    if requested == "sdpa":
        return "sdpa", "requested"
    if requested != "auto" and requested not in KERNEL_BACKENDS:
        raise ValueError(f"--attention-backend {requested!r}: choose auto, "
                         f"{', '.join(KERNEL_BACKENDS)} or sdpa")
    if latent:  # only sdpa (ARCHITECTURE.md, 'The latent KV cache (MLA)')
        why = "the model attends from a latent KV cache (MLA), which the kernels do not read"
        if requested != "auto":
            raise ValueError(f"--attention-backend {requested} is not available: {why}")
        return "sdpa", why
    reasons = []
    for backend in (KERNEL_BACKENDS if requested == "auto" else (requested,)):
        why = _unfit(backend, dtype, kv_dtype, head_dim, page_size, device, flags,
                     unequal_groups, windowed)
        if why is None:
            return backend, _chosen_why(backend, requested, windowed)
        if requested != "auto":
            raise ValueError(f"--attention-backend {backend} is not available: {why}")
        reasons.append(f"{backend}: {why}")
    return "sdpa", "; ".join(reasons)


def _chosen_why(backend: str, requested: str, windowed: bool) -> str:
    """The log's reason for a kernel that fits; a model with windows is told where they go."""
    why = "requested" if requested != "auto" else _STRENGTH[backend]
    if windowed:  # (ARCHITECTURE.md, 'Window pages')
        why += "; the kernel bounds the sliding windows, reading only their pages"
    return why
