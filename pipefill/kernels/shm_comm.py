"""The C++ side of the shared-memory all-reduce and all-gather (pipefill/comm/shm.py is the
Python side; ARCHITECTURE.md, 'The all-reduce inside a node').

``csrc/shm_comm.cpp`` is the glue (segment mapping, barriers on per-rank counts with acquire /
release atomics, the spin-yield-sleep wait with its timeout and dead-peer check, the split of a
call into pieces); ``csrc/shm_comm_reduce.cpp`` is the sum, one plain loop compiled three times
with its own flags (avx512, avx2, scalar = the baseline x86-64 build) and chosen at run time
from cpuid. Every build adds in rank order without reassociation, so all give the same bits.

API: ``extension()`` (the built module; RuntimeError with the reason when it cannot be built),
``isa_status()``, ``choose_isa(hidden_flags="", isa=None) -> (isa or None, why)``.
"""
from __future__ import annotations

import functools

from pipefill.base.platform import VECTOR_ISA_CPU_FLAGS
from pipefill.kernels.build import CSRC, GLUE_VECTOR_ISA, IsaExtension, build_isa_extension

ISAS = ("avx512", "avx2", "scalar")  # preference order
ISA_CODE = {"scalar": 0, "avx2": 1, "avx512": 2}
# CPU flags (as /proc/cpuinfo names them) each build needs; --hide-cpu-flags turns builds off.
ISA_CPU_FLAGS = VECTOR_ISA_CPU_FLAGS
_BASE = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fno-exceptions"]
ISA_FLAGS = {"avx512": _BASE + ["-mavx512f", "-mavx512bw", "-mavx512vl",
                                "-mprefer-vector-width=512"],
             "avx2": _BASE + ["-mavx2", "-mfma"],
             "scalar": _BASE}
_HEADER = CSRC / "shm_comm_kernel.h"


_EXTENSION = IsaExtension("the shared-memory all-reduce", functools.partial(
    build_isa_extension, "shm_comm", "the shared-memory all-reduce", ISA_FLAGS, (_HEADER,),
    (GLUE_VECTOR_ISA, _HEADER), source=CSRC / "shm_comm_reduce.cpp", isa_define="PF_SHM_NS"),
    ISA_CODE, "isa_supported")


def extension():
    """The built module (built once per process; RuntimeError with the reason if it cannot be)."""
    return _EXTENSION.load()


def isa_status() -> dict[str, tuple[bool, str]]:
    """{isa: (usable here, why not)}; never raises."""
    return _EXTENSION.status()


def choose_isa(hidden_flags: str | frozenset[str] = "",
               isa: str | None = None) -> tuple[str | None, str]:
    """The build to sum with -> (isa or None, why): `isa` if given and usable, else the best
    usable one whose CPU flags are not among `hidden_flags` (--hide-cpu-flags)."""
    if isinstance(hidden_flags, str):
        hidden_flags = frozenset(f.strip() for f in hidden_flags.split(",") if f.strip())
    if isa is not None and isa not in ISAS:
        return None, f"unknown ISA {isa!r}: choose one of {', '.join(ISAS)}"
    reasons = []
    for name in ISAS if isa is None else (isa,):
        ok, why = isa_status()[name]
        if set(ISA_CPU_FLAGS[name]) & hidden_flags:
            ok, why = False, "its CPU flags are hidden"
        if ok:
            return name, "ok"
        reasons.append(f"{name}: {why}")
    return None, "; ".join(reasons)
