"""Picking the next token on the last stage. Deterministic per (seed, step), whatever the batch."""
from __future__ import annotations

import torch

from pipefill.base.plan import SampleSpec

# Below this temperature sampling is greedy: logits divided by a tinier one (5e-324 is a valid
# JSON number) overflow to inf and softmax turns them into NaN.
GREEDY_BELOW = 1e-5


def sample(logits: torch.Tensor, spec: SampleSpec):
    """logits [vocab] float32 -> (token id, its log-probability, the top-k (id, logprob) pairs),
    the last two under the model's own distribution (before temperature), when asked."""
    if spec.temperature < GREEDY_BELOW:
        token = greedy_token(logits)
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


def greedy_token(logits: torch.Tensor) -> int:
    """torch.argmax(logits) (the first maximum; a NaN counts as the maximum), by numpy: torch's
    argmax over a 49,152-word vocabulary took ~90 us on 2 threads (an OpenMP region for one
    row), numpy's ~4 us, per sequence and step."""
    return int(logits.detach().float().contiguous().numpy().argmax())


def _draw(logits: torch.Tensor, spec: SampleSpec) -> int:
    """top-k / top-p without sorting the vocabulary: only the k (or a growing window of)
    largest logits are sorted (torch.topk), the normaliser comes from one logsumexp pass."""
    scaled = logits / spec.temperature
    vocab = scaled.numel()
    k = spec.top_k if 0 < spec.top_k < vocab else vocab
    if spec.top_p >= 1.0:
        if k == vocab:
            probs, ids = torch.softmax(scaled, -1), None
        else:
            values, ids = torch.topk(scaled, k)
            probs = torch.softmax(values, -1)
    else:
        probs, ids = _nucleus(scaled, k, spec.top_p)
    gen = torch.Generator().manual_seed((spec.seed * 1_000_003 + spec.step) % (2**63))
    pick = int(torch.multinomial(probs, 1, generator=gen))
    return pick if ids is None else int(ids[pick])


def _nucleus(scaled: torch.Tensor, k: int, top_p: float, window: int = 64):
    """(probs, ids) of the smallest set of the k most likely tokens whose mass (within those
    k) reaches top_p; the first token always stays (a top_p that rounds to 0 would drop all)."""
    vocab = scaled.numel()
    if k < vocab:  # top-k first: the mass is taken within the k survivors
        scaled, kept = torch.topk(scaled, k)
    else:
        kept = None
    log_norm = torch.logsumexp(scaled, -1)
    while True:
        w = min(window, scaled.numel())
        values, order = torch.topk(scaled, w)  # sorted, largest first
        probs = torch.exp(values - log_norm)
        drop = (torch.cumsum(probs, -1) - probs) >= top_p
        if bool(drop.any()) or w == scaled.numel():
            break
        # The nucleus is wider than the window: look further (past a quarter of the
        # candidates, sort them all at once).
        window = window * 4 if window * 16 < scaled.numel() else scaled.numel()
    drop[0] = False
    probs[drop] = 0.0
    ids = order if kept is None else kept[order]
    return probs, ids
