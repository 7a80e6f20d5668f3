"""Picking the next token on the last stage. Deterministic per (seed, step), whatever the batch."""
from __future__ import annotations

import torch

from pipefill.scheduler.plan import SampleSpec

# Below this temperature sampling is greedy: logits divided by a tinier one (5e-324 is a valid
# JSON number) overflow to inf and softmax turns them into NaN.
GREEDY_BELOW = 1e-5


def sample(logits: torch.Tensor, spec: SampleSpec):
    """logits [vocab] float32 -> (token id, its log-probability, the top-k (id, logprob) pairs),
    the last two under the model's own distribution (before temperature), when asked."""
    if spec.temperature < GREEDY_BELOW:
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
        drop[0] = False  # a top_p that rounds to 0 in float32 (5e-324) would drop them all
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    gen = torch.Generator().manual_seed((spec.seed * 1_000_003 + spec.step) % (2**63))
    return int(torch.multinomial(probs, 1, generator=gen))
