"""Rotary position embeddings (rotate-half convention), with llama3 and linear scaling."""
from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}: pipefill supports "
                     "'linear' and 'llama3'")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(in_band, blended, scaled)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor):
    """float32 cos, sin of shape [num_tokens, 1, head_dim // 2] for broadcasting over heads."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos()[:, None, :], freqs.sin()[:, None, :]


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [num_tokens, num_heads, head_dim] in place (x may be a strided view)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated1 = x1 * cos - x2 * sin
    x2.mul_(cos).add_(x1 * sin)
    x1.copy_(rotated1)
