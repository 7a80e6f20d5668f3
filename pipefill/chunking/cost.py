"""The chunk-cost model and the predictor (ARCHITECTURE.md, 'The chunking room'): dynamic chunks
cost the same time at every prefix length, so that equal-time micro-batches keep the pipeline's
stages busy.

Pure Python: the profile supplies (length, seconds) pairs, this module fits f(l) = a*l^2 + b*l
+ c and predicts the size x of the chunk after L tokens from f(L + x) - f(L) = T*.
"""
from __future__ import annotations

import math

MIN_PROFILE_SAMPLES = 8
# 12 prefills: the fit has three coefficients, and each sample is a whole prefill of up to
# 1.25 x C0 tokens on a CPU that may take seconds per prefill (128 of them once took 430 s).
PROFILE_SAMPLES = 12
PROFILE_SPACING = 2.5  # l_i grows like i^2.5: dense where prefills are cheap


def profile_lengths(base_chunk_size: int, num: int = PROFILE_SAMPLES) -> list[int]:
    """num distinct lengths from 1.25*C0 down to about 1.25*C0/32, spaced like i^2.5: the
    cheap short prefills pin the constant and linear terms, a few long ones the quadratic term
    (the long end is what the predictor extrapolates from), and the whole profile costs about
    a third of num prefills of 1.25*C0. Multiples of 8 where there is room; longest first."""
    top = max(int(1.25 * base_chunk_size), num)
    low = max(1, top // 32)
    grain = 8 if top >= 32 * num else 1
    lengths = set()
    for i in range(num):
        x = low + (top - low) * (i / (num - 1)) ** PROFILE_SPACING
        lengths.add(max(grain, round(x / grain) * grain))
    return sorted(lengths, reverse=True)


def fit_relative_error(lengths: list[int], latencies: list[float],
                       coefficients: tuple[float, float, float]) -> float:
    """Root-mean-square of (fit - measured) / measured over the profile's samples."""
    a, b, c = coefficients
    errs = [((a * x * x + b * x + c) - y) / y for x, y in zip(lengths, latencies) if y > 0]
    return math.sqrt(sum(e * e for e in errs) / max(1, len(errs)))


def solve_least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Ordinary least squares through the normal equations (small, well-scaled systems)."""
    n = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(n)]
    # Gauss-Jordan with partial pivoting.
    m = [row[:] + [v] for row, v in zip(ata, aty)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            raise ValueError("the fit is singular: the samples do not span the model")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_quadratic(lengths: list[int], latencies: list[float]) -> tuple[float, float, float]:
    """f(l) = a*l^2 + b*l + c by least squares (lengths scaled to keep the system tame)."""
    scale = max(lengths)
    rows = [[(x / scale) ** 2, x / scale, 1.0] for x in lengths]
    a, b, c = solve_least_squares(rows, latencies)
    return a / scale**2, b / scale, c


class ChunkSizePredictor:
    """Predicts continuation chunk sizes whose cost matches the first chunk's."""

    def __init__(self, base_chunk_size: int, page_size: int = 64, smooth_factor: float = 0.75,
                 max_model_len: int = 1 << 30, max_prefill_tokens: int = 1 << 30):
        if base_chunk_size < 1:
            raise ValueError("base_chunk_size must be at least 1")
        if not 0.0 <= smooth_factor <= 1.0:
            raise ValueError(f"smooth_factor must be in [0, 1], got {smooth_factor}")
        self.base = base_chunk_size
        self.page_size = page_size
        self.smooth = smooth_factor
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self._coef: tuple[float, float, float] | None = None
        self._target: float | None = None

    @property
    def coefficients(self) -> tuple[float, float, float]:
        if self._coef is None:
            raise ValueError("the predictor is not fitted")
        return self._coef

    @property
    def target_latency(self) -> float:
        if self._target is None:
            raise ValueError("the predictor is not fitted")
        return self._target

    @property
    def fitted(self) -> bool:
        return self._coef is not None

    def fit(self, lengths: list[int], latencies: list[float]) -> None:
        """Least-squares fit of f(l) = a*l^2 + b*l + c; ValueError when unusable."""
        if len(lengths) != len(latencies):
            raise ValueError("lengths and latencies differ in length")
        if len(lengths) < MIN_PROFILE_SAMPLES:
            raise ValueError(f"{len(lengths)} profile samples; at least "
                             f"{MIN_PROFILE_SAMPLES} are needed")
        a, b, c = fit_quadratic(list(lengths), list(latencies))
        if not a > 0:
            raise ValueError(f"the fitted cost is not convex (a = {a:.3g} <= 0): chunk costs "
                             "do not grow with position, dynamic chunking has nothing to do")
        b = max(b, 0.0)
        target = a * self.base**2 + b * self.base  # f(C0) - f(0)
        if not target > 0:
            raise ValueError(f"the target chunk time T* = {target:.3g} is not positive")
        self._coef, self._target = (a, b, c), target

    def set_model(self, a: float, b: float, c: float, target: float) -> None:
        """Installs coefficients directly (a cached profile, the simulator, calibration)."""
        self._coef, self._target = (a, b, c), target

    def raw_size(self, history_len: int) -> float | None:
        """x with f(L + x) - f(L) = T*: the positive root of a x^2 + (2aL + b) x - T* = 0."""
        if self._coef is None or not self._target > 0:
            return None
        a, b, _ = self._coef
        lin = 2 * a * history_len + b
        disc = lin * lin + 4 * a * self._target
        if a <= 0 or disc < 0:
            return None
        return (-lin + math.sqrt(disc)) / (2 * a)

    def next_chunk_size(self, history_len: int) -> int:
        """Size of the chunk that follows history_len computed tokens; C0 when no prediction."""
        return self.post_process(self.raw_size(history_len), history_len)

    def post_process(self, x: float | None, history_len: int) -> int:
        c0 = self.base
        if x is None or not math.isfinite(x) or x <= 0:
            return c0
        g = max(self.page_size, 64)
        s = c0 + self.smooth * (x - c0)
        s = max(math.floor(s), c0 // 4)
        s = max(s // g * g, g)
        s = min(s, self.max_model_len - history_len - 100, self.max_prefill_tokens)
        s = s // g * g
        return c0 if s < g else int(s)

    def chunk_sequence(self, prompt_len: int, prefix_len: int = 0) -> list[int]:
        """Chunk sizes that cover [prefix_len, prompt_len): C0 first, then predictions."""
        sizes, at = [], prefix_len
        while at < prompt_len:
            size = self.base if at == prefix_len else self.next_chunk_size(at)
            sizes.append(min(size, prompt_len - at))
            at += sizes[-1]
        return sizes
