"""How far a long prompt's prefill has come, and how long the rest will take.

A prefill slows down as it goes (each chunk's attention reads a longer prefix), so the time left
is not the time so far scaled by the tokens left. With the cost model's F(L) = a·L² + b·L, the
cost of computing tokens [0, L), the time left is the time so far scaled by the cost left:
elapsed · (F(total) − F(done)) / (F(done) − F(start)), start being the tokens the prompt found
cached. Only the ratio a/b matters, so without a fitted model (fixed chunks, no profile yet)
the model's shapes give it (shape_coefficients): a linear guess said 5 minutes left of a
30-minute 128K prefill, whose last tokens spend 40 times more FLOPs on attention than on
weights.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


def prefill_cost(tokens: int, coefficients) -> float:
    a, b = (coefficients[0], coefficients[1]) if coefficients else (0.0, 1.0)
    return a * tokens * tokens + b * tokens


def shape_coefficients(layer_weights, attention_width: int) -> tuple[float, float]:
    """(a, b) of F in FLOPs, from the weights a token multiplies by in each layer and the
    attention width (heads × (q/k head size + v head size)): a token costs 2 FLOPs per weight,
    and the first L tokens' scores and weighted values L² × width per layer (causal: half of
    2 · L² · width)."""
    return float(len(layer_weights) * attention_width), 2.0 * float(sum(layer_weights))


def eta_seconds(elapsed_s: float, start: int, done: int, total: int,
                coefficients=None) -> float | None:
    """Seconds left, or None before anything was computed to measure by."""
    spent = prefill_cost(done, coefficients) - prefill_cost(start, coefficients)
    if elapsed_s <= 0 or spent <= 0:
        return None
    return elapsed_s * (prefill_cost(total, coefficients) - prefill_cost(done, coefficients)) \
        / spent


@dataclass(frozen=True)
class PrefillProgress:
    """One long prompt's prefill, as stage 0 reports it with its load."""
    rid: str
    done: int  # prompt tokens computed or on their way through the stages
    total: int
    age_s: float  # since it was admitted
    eta_s: float | None

    def as_list(self) -> list:
        return [self.rid, self.done, self.total, round(self.age_s, 3),
                None if self.eta_s is None else round(self.eta_s, 3)]

    @staticmethod
    def of(item: list) -> "PrefillProgress":
        rid, done, total, age, eta = item
        return PrefillProgress(rid, done, total, age, eta)

    def line(self) -> str:
        """e.g. 'prefill 65536/131072 eta 812s' (the SSE comment and the log line's core)."""
        eta = "?" if self.eta_s is None else (f"{self.eta_s:.1f}s" if self.eta_s < 10
                                               else f"{self.eta_s:.0f}s")
        return f"prefill {self.done}/{self.total} eta {eta}"


class ProgressClock:
    """Stage 0's clock of the long prompts in prefill: when each was first seen and with how
    many tokens already there (its cached prefix), to turn the scheduler's counts into ages
    and ETAs."""

    def __init__(self, clock=time.monotonic, prior=None):
        self.clock = clock
        self.prior = prior  # (a, b) from the model's shapes, until a fitted model exists
        self._seen: dict[str, tuple[float, int]] = {}

    def report(self, counts: list[tuple[str, int, int]], coefficients=None
               ) -> list[PrefillProgress]:
        """counts: (rid, done, total) of the prompts in prefill now."""
        now = self.clock()
        live = {rid for rid, _, _ in counts}
        self._seen = {rid: v for rid, v in self._seen.items() if rid in live}
        out = []
        for rid, done, total in counts:
            since, start = self._seen.setdefault(rid, (now, done))
            out.append(PrefillProgress(rid, done, total, now - since,
                                       eta_seconds(now - since, start, done, total,
                                                   coefficients or self.prior)))
        return out
