"""Rotary position embeddings (rotate-half convention), with llama3, linear and yarn scaling."""
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
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}: pipefill supports "
                     "'linear', 'llama3' and 'yarn'")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict) -> float:
    """What cos and sin are multiplied by (yarn's attention factor; 1 for the others): given,
    or mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are set (DeepSeek),
    else mscale(factor)."""
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = (scaling["factor"], scaling.get("mscale"),
                               scaling.get("mscale_all_dim"))
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


def _yarn_inverse_frequencies(dim: int, theta: float, s: dict) -> torch.Tensor:
    # Dimensions that turn fewer than beta_slow times over the original context are slowed by
    # `factor`, those turning more than beta_fast times kept, a linear ramp between them.
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the dimension keeps its frequency
    # Rounded as transformers' _compute_yarn_parameters rounds.
    periods = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return 1.0 / (factor * periods) * (1 - keep) + 1.0 / periods * keep


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


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, factor: float = 1.0):
    """float32 cos, sin of shape [num_tokens, 1, head_dim // 2] for broadcasting over heads,
    both multiplied by `factor` (rope_attention_factor)."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    if factor == 1.0:
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    return (freqs.cos() * factor)[:, None, :], (freqs.sin() * factor)[:, None, :]


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [num_tokens, num_heads, head_dim] in place (x may be a strided view)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated1 = x1 * cos - x2 * sin
    x2.mul_(cos).add_(x1 * sin)
    x1.copy_(rotated1)
