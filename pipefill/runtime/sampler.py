"""Picking the next token on the last stage. Deterministic per (seed, step), whatever the batch."""
from __future__ import annotations

import torch

from pipefill.scheduler.plan import SampleSpec


def sample(logits: torch.Tensor, spec: SampleSpec):
    """logits [vocab] float32 -> (token id, its log-probability, the top-k (id, logprob) pairs),
    the last two under the model's own distribution (before temperature), when asked."""
    if spec.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        token = _draw(logits, spec)
    if spec.logprobs is None:
        return token, None, None
    logprobs = torch.log_softmax(logits, -1)
    top = []
    if spec.logprobs > 0:
        values, ids = torch.topk(logprobs, spec.logprobs)
        top = list(zip(ids.tolist(), values.tolist()))
    return token, float(logprobs[token]), top


def _draw(logits: torch.Tensor, spec: SampleSpec) -> int:
    scaled = logits / spec.temperature
    if 0 < spec.top_k < scaled.numel():
        kth = torch.topk(scaled, spec.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, -1)
    if spec.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop = (torch.cumsum(sorted_probs, -1) - sorted_probs) >= spec.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    gen = torch.Generator().manual_seed((spec.seed * 1_000_003 + spec.step) % (2**63))
    return int(torch.multinomial(probs, 1, generator=gen))
