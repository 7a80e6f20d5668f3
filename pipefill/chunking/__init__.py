"""The chunking room (ARCHITECTURE.md, 'The chunking room'): how long stage 0's prefill chunks
are. Pure Python apart from the profile's cache key; it imports nothing of the runtime (the
profile's scratch prefill comes in as ProfileBench.prefill, the pages it borrows through a
PageLender).

    cost.py         the chunk-cost model f(l) = a*l^2 + b*l + c, its fit, ChunkSizePredictor
    calibration.py  OnlineCalibrator: the model refitted from real chunk timings
    profile.py      the start-up profile: timed scratch prefills, cached on disk
    sim.py          the pipeline simulator, the tuner behind `auto`, the pipeline diagram
    policy.py       ChunkPolicy: the one object the scheduler asks, next_chunk(L)
    startup.py      build_chunk_policy: stage 0's policy from the flags (and a profile)
    progress.py     a long prefill's progress and its ETA from the cost model
"""
from pipefill.chunking.cost import ChunkSizePredictor, fit_quadratic, profile_lengths
from pipefill.chunking.policy import ChunkPolicy, PageLender
from pipefill.chunking.profile import ProfileBench
from pipefill.chunking.startup import build_chunk_policy, first_chunk_size

__all__ = ["ChunkPolicy", "ChunkSizePredictor", "PageLender", "ProfileBench",
           "build_chunk_policy", "first_chunk_size", "fit_quadratic", "profile_lengths"]
