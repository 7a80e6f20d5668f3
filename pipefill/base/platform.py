"""Facts about the CPU this process runs on, and placing a stage on its cores."""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import socket
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    return frozenset((_cpuinfo_field("flags") or "").split())


@functools.cache
def cpu_name() -> str:
    """The CPU's model name, which every benchmark prints beside its numbers."""
    import platform
    return _cpuinfo_field("model name") or platform.processor() or "unknown CPU"


@functools.cache
def cpu_vendor() -> str:
    """cpuid's vendor string, e.g. GenuineIntel or AuthenticAMD ('' where unknown)."""
    return _cpuinfo_field("vendor_id") or ""


# The CPU flags (as /proc/cpuinfo names them) each build of the kernels' scalar / AVX2 /
# AVX-512 sets needs, as their glue's cpuid check (kernels/csrc/glue_vector_isa.h) asks (an
# AVX-512 CPU has AVX2 and FMA; Linux lists a flag only where the OS enables its register
# state). --hide-cpu-flags turns a build off by these. Here, below the kernels, so that a room
# that chooses a path without building a kernel reads the same table.
VECTOR_ISA_CPU_FLAGS = {"avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma"),
                        "scalar": ()}


def isas_lacking_flags(table: dict[str, tuple[str, ...]],
                       flags: frozenset[str] | None) -> tuple[str, ...]:
    """The paths of `table` ({path: the CPU flags it needs}) that need a flag missing from
    `flags` (the trusted flags, as --hide-cpu-flags leaves them; None: trust the CPU, none)."""
    if flags is None:
        return ()
    return tuple(isa for isa, need in table.items() if not set(need) <= flags)


def usable_cpu_flags(hide: str | Iterable[str] = "") -> frozenset[str]:
    """The CPU's flags less the hidden ones (--hide-cpu-flags: "avx512f,avx512_bf16" or a
    collection), so kernel selection can be run as on a smaller CPU."""
    if isinstance(hide, str):
        hide = [f.strip() for f in hide.split(",")]
    return cpu_flags() - {f for f in hide if f}


def has_fast_bf16(flags: frozenset[str] | None = None) -> bool:
    """AMX-BF16 or AVX-512-BF16: bf16 matmuls run at least as fast as fp32 ones."""
    return bool((cpu_flags() if flags is None else flags) & {"amx_bf16", "avx512_bf16"})


def resolve_dtype(name: str, flags: frozenset[str] | None = None) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if has_fast_bf16(flags) else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def place_stage(local_rank: int, num_local_stages: int, num_threads: int) -> list[int]:
    """Pins this process to its own cores (when there are enough) and sets torch's threads.

    Stage i of a node takes cores [i * threads, (i + 1) * threads) of the usable set, so two
    stages on two cores each own one and never contend.
    """
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[local_rank * num_threads:(local_rank + 1) * num_threads]
    if len(cores) >= num_local_stages * num_threads and len(mine) == num_threads:
        os.sched_setaffinity(0, mine)
    else:
        log.warning("%d stage(s) x %d thread(s) do not fit on %d usable cores: not pinning",
                    num_local_stages, num_threads, len(cores))
        mine = cores
    torch.set_num_threads(num_threads)
    return mine


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory_for_reuse() -> bool:
    """Makes glibc serve every allocation from its heap and keep what is freed there, instead
    of mapping each block over 32 MB fresh and unmapping it when freed. A prefill chunk's
    activations are such blocks (2,048 rows of MoE expert slots are 67 MB in bf16), and fresh
    pages fault on first touch: a gather into a new 67 MB tensor took 30 ms, into a reused one
    4 ms. The heap then stays at the high-water mark of a step, which the next step reuses;
    release_freed_memory still hands back what loading freed. False where the C library is not
    glibc."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def release_freed_memory() -> None:
    """Hands the heap memory freed so far (loading's temporaries: the file's metadata, copies
    of blocks before their 16-row layout, float32 tensors of a dequantized file) back to the
    OS: glibc keeps freed heap for reuse. Called before the KV pool is allocated too: the pool
    is resident only where written, but a pool laid over freed, already-touched heap is
    resident from the start (ARCHITECTURE.md, 'What a stage's memory is made of')."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


def resident_memory(pid: int | str = "self") -> dict[str, int]:
    """A process's memory in bytes: "rss" and its peak "hwm" (/proc/<pid>/status VmRSS,
    VmHWM), and the resident "anon" (heap, tensors) and "file" (mapped files: shared
    libraries) parts of rss (/proc/<pid>/smaps_rollup); {} where /proc lacks them."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out["rss" if line.startswith("VmRSS") else "hwm"] = int(line.split()[1]) * 1024
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Rss:", "Anonymous:")):
                    out[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        return {}
    if "Rss" in out and "Anonymous" in out:
        out["anon"], out["file"] = out["Anonymous"], out["Rss"] - out["Anonymous"]
    out.pop("Rss", None)
    out.pop("Anonymous", None)
    return out


def free_port() -> int:
    """A loopback TCP port free right now (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
