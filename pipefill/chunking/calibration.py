"""Online calibration of dynamic chunks: the chunk-cost model refitted from real chunk timings
while stage 0 serves (ARCHITECTURE.md, 'The chunking room')."""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

from pipefill.chunking.cost import ChunkSizePredictor, solve_least_squares

log = logging.getLogger(__name__)


@dataclass
class ChunkTiming:
    size: int  # C
    history: int  # H: tokens already computed
    seconds: float


class OnlineCalibrator:
    """vLLM-Ascend-style calibration: T* re-anchored on measured C0-chunks at H = 0, and
    t(C, H) = a*C*(C+H) + b*(C+H) + c fitted from real chunk timings. The fit uses a sliding
    window of the WINDOW most recent timings, refitted with every new one from MIN_SAMPLES on,
    so it follows a machine whose speed changes (other load, thermal limits) instead of
    freezing on the first timings; the next chunk solves t(x, L) = T*."""

    MIN_SAMPLES, WINDOW = 5, 30

    def __init__(self, predictor: ChunkSizePredictor, window: int = WINDOW):
        self.predictor = predictor
        self.samples: deque[ChunkTiming] = deque(maxlen=window)
        self.model: tuple[float, float, float] | None = None
        self.num_fits = 0

    @property
    def first_chunk_times(self) -> list[float]:
        """Timings of C0-chunks at H = 0 in the window: T* follows the machine as well."""
        return [s.seconds for s in self.samples
                if s.history == 0 and s.size == self.predictor.base]

    def observe(self, size: int, history: int, seconds: float) -> None:
        self.samples.append(ChunkTiming(size, history, seconds))  # the oldest drops out
        if len(self.samples) >= self.MIN_SAMPLES:
            self._refit()

    def _refit(self) -> None:
        rows = [[s.size * (s.size + s.history), s.size + s.history, 1.0] for s in self.samples]
        scale = [max(abs(r[i]) for r in rows) or 1.0 for i in range(3)]
        try:
            coef = solve_least_squares([[r[i] / scale[i] for i in range(3)] for r in rows],
                                        [s.seconds for s in self.samples])
        except ValueError:
            return
        a, b, c = (coef[i] / scale[i] for i in range(3))
        if a <= 0:
            return
        self.model = (a, max(b, 0.0), c)
        self.num_fits += 1
        # The first fit at INFO; the refits that follow every chunk at DEBUG.
        (log.info if self.num_fits == 1 else log.debug)(
            "dynamic chunking: refit from the last %d chunk timings: t(C, H) = %.3g*C*(C+H) + "
            "%.3g*(C+H) + %.3g s; T* = %.3f s", len(self.samples), *self.model, self.target())

    def target(self) -> float:
        times = self.first_chunk_times
        if times:
            return sum(times) / len(times)
        a, b, c = self.model
        c0 = self.predictor.base
        return a * c0 * c0 + b * c0 + c

    def next_chunk_size(self, history_len: int) -> int:
        if self.model is None:
            return self.predictor.next_chunk_size(history_len)
        a, b, c = self.model
        # a x^2 + (a L + b) x + (b L + c - T*) = 0
        lin, const = a * history_len + b, b * history_len + c - self.target()
        disc = lin * lin - 4 * a * const
        x = None if disc < 0 else (-lin + math.sqrt(disc)) / (2 * a)
        return self.predictor.post_process(x, history_len)
