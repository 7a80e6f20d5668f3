"""Multi-head latent attention (DeepSeek-V2/V3) over the latent KV cache (ARCHITECTURE.md,
'The latent KV cache (MLA)').

Each token keeps one latent per layer: c, the kv_lora_rank values of kv_a_proj_with_mqa after
kv_a_layernorm, then k_pe, its qk_rope_head_dim rotated values — latent_dim values in all, laid
over the cache's K and V tensors (the first half in K's one head, the rest in V's: KVSpec.latent),
so every path that copies K and V pages carries the latent as it is. Head h's key is
[W_uk[h] c, k_pe] and its value W_uv[h] c, where W_uk and W_uv are kv_b_proj's rows.

Two ways to attend, equal up to rounding (tests/model/test_deepseek.py holds them together):

* decompressed: every head's keys and values of the sequence's tokens [0, L + C) from their
  latents through kv_b_proj, then model/attention.py's split flash attention (the cached
  prefix unmasked, the chunk's square block causal);
* absorbed: W_uk folded into the query (q_nope[h] W_uk[h] is a query in the latent space),
  scores against the latents and rotary keys directly, the weighted latents out through W_uv.
  Nothing per head is built from the cache, which is read once for all heads.

A prefill chunk takes the cheaper of the two at its prefix length (model/mla_cost.py; forced
by --mla-prefill-attention); decode rows attend absorbed, all of a step's in one call of the
C++ kernel (kernels/mla_attention.py) where it runs, else in torch (LatentAttention).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from pipefill.kernels import mla_attention
from pipefill.kernels.kv_quant_attention import slot_index
from pipefill.kernels.prefill_gemm import torch_linear
from pipefill.model.attention import SeqMeta, split_attention
from pipefill.model.mla_cost import (LatentShape, cheaper_path, largest_absorbed_chunk,
                                     score_block_rows)

log = logging.getLogger(__name__)


@dataclass
class LatentUp:
    """kv_b_proj, the up-projection from the latent c to every head's key (nope part) and
    value: [heads * (nope + v), kv_lora_rank], kept plain (both paths read it)."""
    kv_b: torch.Tensor
    num_heads: int
    nope_dim: int
    v_dim: int

    def heads(self) -> torch.Tensor:
        return self.kv_b.view(self.num_heads, self.nope_dim + self.v_dim, -1)

    @property
    def w_uk(self) -> torch.Tensor:  # [heads, nope, rank]
        return self.heads()[:, :self.nope_dim]

    @property
    def w_uv(self) -> torch.Tensor:  # [heads, v, rank]
        return self.heads()[:, self.nope_dim:]


def write_latent(k_cache, v_cache, latent: torch.Tensor, seqs: list[SeqMeta]) -> None:
    """Every sequence's new latents [T, latent_dim] into its write slots: the first half of
    each into K's one head, the rest into V's."""
    half = k_cache.shape[-1]
    for seq in seqs:
        rows = latent[seq.row_start:seq.row_start + seq.num_new].unsqueeze(1)
        k_cache[seq.write_slots] = rows[..., :half].to(k_cache.dtype)
        rest = rows[..., half:]
        if rest.shape[-1] == half:
            v_cache[seq.write_slots] = rest.to(v_cache.dtype)
        else:  # an odd latent: V's last value stays unused
            v_cache[seq.write_slots, :, :rest.shape[-1]] = rest.to(v_cache.dtype)


def read_latent(k_cache, v_cache, slots, latent_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The latents [N, latent_dim] of the tokens in `slots`, in `dtype`."""
    both = torch.cat([k_cache[slots], v_cache[slots]], dim=-1)
    return both.reshape(both.shape[0], -1)[:, :latent_dim].to(dtype)


@dataclass(frozen=True)
class LatentAttention:
    """How a stage's latent layers attend. prefill: 'auto' (each chunk the cheaper path at its
    prefix length), 'decompressed' or 'absorbed'; decode_isa: the C++ kernel's path for decode
    rows (kernels/mla_attention.ISAS), None: torch."""
    prefill: str = "auto"
    decode_isa: str | None = None

    def describe(self) -> str:
        decode = (f"the {self.decode_isa} latent kernel" if self.decode_isa else "torch")
        return f"latent: prefill chunks {self.prefill}, decode rows absorbed on {decode}"

    def prefill_path(self, up: LatentUp, rope: int, dtype: torch.dtype, queries: int,
                     keys: int) -> str:
        if self.prefill != "auto":
            return self.prefill
        shape = latent_shape(up, rope, dtype)
        log_prefill_rule(shape)
        return cheaper_path(shape, queries, keys)


def choose_latent_attention(kernels, kv_dtype: torch.dtype, device: torch.device,
                            flags: frozenset[str] | None = None) -> LatentAttention:
    """A stage's LatentAttention from its kernel flags (config.Kernels): --mla-prefill-attention
    for prefill chunks; decode rows on the fastest kernel path the trusted CPU flags allow,
    unless --attention-backend sdpa asks for torch (or the cache or device is not the
    kernel's)."""
    isa = None
    if (kernels.attention_backend != "sdpa" and device.type == "cpu"
            and kv_dtype in mla_attention.CACHE_DTYPES):
        isa = mla_attention.decode_isa(mla_attention.hidden_isas(flags))
    return LatentAttention(kernels.mla_prefill_attention, isa)


def latent_shape(up: LatentUp, rope: int, dtype: torch.dtype) -> LatentShape:
    return LatentShape(up.num_heads, up.nope_dim, rope, up.v_dim, up.kv_b.shape[1],
                       dtype.itemsize)


@functools.cache
def log_prefill_rule(shape: LatentShape) -> None:
    """One line per model shape (not per chunk): where the prefill's choice falls."""
    near, far = (largest_absorbed_chunk(shape, p) for p in (0, 32768))
    log.info("latent attention (%d heads, rank %d): a prefill chunk attends absorbed where "
             "that is cheaper (chunks up to %d tokens without a cached prefix, up to %d after "
             "32768 cached tokens), decompressed otherwise", shape.heads, shape.rank, near, far)


def latent_attention(q_nope, q_pe, k_cache, v_cache, seqs: list[SeqMeta], up: LatentUp,
                     latent_dim: int, scale: float, how: LatentAttention = LatentAttention(),
                     derived: dict | None = None) -> torch.Tensor:
    """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), packed over `seqs`, whose latents
    are in the cache already -> [T, H, v]. A sequence's C query rows are its last C tokens
    of prefix_len + C: one row (a decode step) attends absorbed, on the kernel where `how`
    has one (every such row of the step in one call); more take how.prefill_path.
    derived: the forward's ForwardMeta.derived, where the kernel's slot index is kept for
    the next layers."""
    out = q_nope.new_empty(q_nope.shape[0], up.num_heads, up.v_dim)
    if how.decode_isa is not None and k_cache.dtype in mla_attention.CACHE_DTYPES:
        singles = [seq for seq in seqs if seq.num_new == 1]
        if singles:
            rows, index = decode_index(singles, {} if derived is None else derived)
            out[rows] = absorbed_decode(q_nope[rows], q_pe[rows], k_cache, v_cache, index,
                                        up, scale, how.decode_isa)
            seqs = [seq for seq in seqs if seq.num_new != 1]
    for seq in seqs:
        rows = slice(seq.row_start, seq.row_start + seq.num_new)
        num_keys = seq.prefix_len + seq.num_new
        latent = read_latent(k_cache, v_cache, seq.read_slots, latent_dim, q_nope.dtype)
        latent = latent[:num_keys]
        path = "absorbed" if seq.num_new == 1 else how.prefill_path(
            up, q_pe.shape[-1], q_nope.dtype, seq.num_new, num_keys)
        attend = absorbed if path == "absorbed" else decompressed
        out[rows] = attend(q_nope[rows], q_pe[rows], latent, up, scale)
    return out


def decode_index(singles: list[SeqMeta], derived: dict):
    """(rows, (slots, offsets)) of one-row sequences: their rows in the packed batch and the
    kernel's index of their latents, built once per forward (kept in `derived` under the
    sequences' identity: a trimmed last layer passes others)."""
    key = ("latent decode", tuple((id(s.read_slots), s.row_start, s.prefix_len)
                                  for s in singles))
    if key not in derived:
        rows = torch.tensor([seq.row_start for seq in singles], dtype=torch.long)
        derived[key] = rows, slot_index([_first_slots(seq.read_slots, seq.prefix_len + 1)
                                         for seq in singles]), singles  # singles: keep ids
    return derived[key][:2]


def absorbed_decode(q_nope, q_pe, k_cache, v_cache, index, up: LatentUp, scale: float,
                    isa: str) -> torch.Tensor:
    """One query row per sequence ([B, H, nope], [B, H, rope]) attended absorbed on the C++
    kernel, every sequence in one call -> [B, H, v]; index: their latents' (slots, offsets)
    (decode_index). The query into the latent space through W_uk and the kernel's latent
    sums out through W_uv are torch GEMMs."""
    q_latent = torch.bmm(q_nope.transpose(0, 1), up.w_uk)  # [H, B, rank]
    q = torch.cat([q_latent, q_pe.transpose(0, 1)], dim=-1).transpose(0, 1)  # [B, H, D]
    slots, offsets = index
    summed = mla_attention.decode_attention(q, k_cache, v_cache, slots, offsets,
                                            up.kv_b.shape[1], scale, isa)  # [B, H, rank]
    out = torch.bmm(summed.transpose(0, 1).to(q_nope.dtype), up.w_uv.transpose(1, 2))
    return out.transpose(0, 1)


def _first_slots(slots, n: int):
    """The cache slots of a sequence's first n tokens."""
    return slice(slots.start, slots.start + n) if isinstance(slots, slice) else slots[:n]


def decompressed(q_nope, q_pe, latent, up: LatentUp, scale: float) -> torch.Tensor:
    """C queries at the end of N tokens' latents [N, latent_dim]: keys and values per head
    through kv_b_proj, then split_attention (bottom-right causal) -> [C, H, v]."""
    num_keys, num_queries, rank = latent.shape[0], q_nope.shape[0], up.kv_b.shape[1]
    kv = torch_linear(latent[:, :rank], up.kv_b).view(num_keys, up.num_heads, -1)
    keys = kv.new_empty(num_keys, up.num_heads, up.nope_dim + q_pe.shape[-1])
    keys[..., :up.nope_dim] = kv[..., :up.nope_dim]
    keys[..., up.nope_dim:] = latent[:, None, rank:]
    values = kv[..., up.nope_dim:]
    if values.shape[-1] != keys.shape[-1]:  # the flash kernel wants one head size
        values = torch.nn.functional.pad(values, (0, keys.shape[-1] - values.shape[-1]))
    q = torch.cat([q_nope, q_pe], dim=-1)
    split = num_keys - num_queries
    out = split_attention(q, keys[:split], values[:split], keys[split:], values[split:], scale)
    return out[..., :up.v_dim]


def absorbed(q_nope, q_pe, latent, up: LatentUp, scale: float) -> torch.Tensor:
    """C queries at the end of N tokens' latents, attended in the latent space -> [C, H, v]:
    scores q_nope W_uk . c + q_pe . k_pe, the probabilities' sum of c out through W_uv. The
    queries go in blocks whose float32 scores stay within mla_cost.SCORE_BLOCK_BYTES, each
    block over the keys up to its last query."""
    num_keys, num_queries = latent.shape[0], q_nope.shape[0]
    step = score_block_rows(up.num_heads, num_keys)
    if num_queries <= step:
        return _absorbed_block(q_nope, q_pe, latent, up, scale)
    first = num_keys - num_queries
    return torch.cat([_absorbed_block(q_nope[i:i + step], q_pe[i:i + step],
                                      latent[:first + min(i + step, num_queries)], up, scale)
                      for i in range(0, num_queries, step)])


def _absorbed_block(q_nope, q_pe, latent, up: LatentUp, scale: float) -> torch.Tensor:
    num_keys, num_queries, rank = latent.shape[0], q_nope.shape[0], up.kv_b.shape[1]
    c, k_pe = latent[:, :rank], latent[:, rank:]
    q_latent = torch.bmm(q_nope.transpose(0, 1), up.w_uk)  # [H, C, rank]
    scores = (q_latent @ c.T).add_(q_pe.transpose(0, 1) @ k_pe.T).float() * scale  # [H, C, N]
    if num_queries > 1:  # query i sits at key num_keys - num_queries + i
        q_pos = torch.arange(num_keys - num_queries, num_keys)[:, None]
        scores.masked_fill_(torch.arange(num_keys)[None, :] > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(latent.dtype)
    out = torch.bmm(probs @ c, up.w_uv.transpose(1, 2))  # [H, C, v]
    return out.transpose(0, 1)
