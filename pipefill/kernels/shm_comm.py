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
import logging
import platform
import time

from pipefill.kernels.build import (CSRC, GLUE_HEADER, LazyExtension, build_dir, compile_object,
                                    link_glue, require_ninja)

log = logging.getLogger("pipefill.kernels")

ISAS = ("avx512", "avx2", "scalar")  # preference order
ISA_CODE = {"scalar": 0, "avx2": 1, "avx512": 2}
# CPU flags (as /proc/cpuinfo names them) each build needs; --hide-cpu-flags turns builds off.
ISA_CPU_FLAGS = {"avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma"),
                 "scalar": ()}
_BASE = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fno-exceptions"]
ISA_FLAGS = {"avx512": _BASE + ["-mavx512f", "-mavx512bw", "-mavx512vl",
                                "-mprefer-vector-width=512"],
             "avx2": _BASE + ["-mavx2", "-mfma"],
             "scalar": _BASE}
_HEADER = CSRC / "shm_comm_kernel.h"


def _build():
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"needs Linux x86-64, this is {platform.system()} "
                           f"{platform.machine()}")
    require_ninja("the shared-memory all-reduce")
    out = build_dir("shm_comm")
    t0 = time.perf_counter()
    objs = [str(compile_object(CSRC / "shm_comm_reduce.cpp", _HEADER,
                               flags + [f"-DPF_SHM_NS={isa}"], out, f"shm_comm_{isa}"))
            for isa, flags in ISA_FLAGS.items()]
    module = link_glue("pipefill_shm_comm", CSRC / "shm_comm.cpp", [GLUE_HEADER, _HEADER],
                       objs, out)
    if time.perf_counter() - t0 > 1:
        log.info("pipefill shared-memory all-reduce built in %.1f s (%s)",
                 time.perf_counter() - t0, out)
    return module


_EXTENSION = LazyExtension("the shared-memory all-reduce", _build)


def extension():
    """The built module (built once per process; RuntimeError with the reason if it cannot be)."""
    return _EXTENSION.load()


@functools.cache
def isa_status() -> dict[str, tuple[bool, str]]:
    """{isa: (usable here, why not)}; never raises."""
    try:
        lib = extension()
    except RuntimeError as e:
        return {isa: (False, str(e)) for isa in ISAS}
    status = {}
    for isa in ISAS:
        ok, why = lib.isa_supported(ISA_CODE[isa])
        status[isa] = (ok, "ok" if ok else "cpuid: " + why)
    return status


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
