"""Multi-head latent attention (DeepSeek-V2/V3) over the latent KV cache (ARCHITECTURE.md,
'The latent KV cache (MLA)').

Each token keeps one latent per layer: c, the kv_lora_rank values of kv_a_proj_with_mqa after
kv_a_layernorm, then k_pe, its qk_rope_head_dim rotated values — latent_dim values in all, laid
over the cache's K and V tensors (the first half in K's one head, the rest in V's: KVSpec.latent),
so every path that copies K and V pages carries the latent as it is. Head h's key is
[W_uk[h] c, k_pe] and its value W_uv[h] c, where W_uk and W_uv are kv_b_proj's rows.

Two ways to attend, equal up to rounding (tests/model/test_deepseek.py holds them together):

* decompressed (prefill chunks): every head's keys and values of the sequence's tokens
  [0, L + C) from their latents through kv_b_proj, then model/attention.py's split flash
  attention (the cached prefix unmasked, the chunk's square block causal);
* absorbed (decode steps): W_uk folded into the query (q_nope[h] W_uk[h] is a query in the
  latent space), scores against the latents and rotary keys directly, the weighted latents out
  through W_uv. Nothing per head is built from the cache, which is read once for all heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipefill.kernels.prefill_gemm import torch_linear
from pipefill.model.attention import SeqMeta, split_attention


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


def latent_attention(q_nope, q_pe, k_cache, v_cache, seqs: list[SeqMeta], up: LatentUp,
                     latent_dim: int, scale: float) -> torch.Tensor:
    """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), packed over `seqs`, whose latents
    are in the cache already -> [T, H, v]. A sequence's C query rows are its last C tokens
    of prefix_len + C: one row (a decode step) attends absorbed, more decompressed."""
    out = q_nope.new_empty(q_nope.shape[0], up.num_heads, up.v_dim)
    for seq in seqs:
        rows = slice(seq.row_start, seq.row_start + seq.num_new)
        latent = read_latent(k_cache, v_cache, seq.read_slots, latent_dim, q_nope.dtype)
        latent = latent[:seq.prefix_len + seq.num_new]
        attend = absorbed if seq.num_new == 1 else decompressed
        out[rows] = attend(q_nope[rows], q_pe[rows], latent, up, scale)
    return out


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
    scores q_nope W_uk . c + q_pe . k_pe, the probabilities' sum of c out through W_uv."""
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
