"""Building the C++ kernels at first use: ISA-specific sources become object files compiled
with their flags (and nothing else is), then torch.utils.cpp_extension links them with glue
compiled for the baseline CPU. Everything is cached under ~/.cache/pipefill/kernels.

One binding style for every kernel: each glue file (csrc/*_ext.cpp, fused_ops.cpp,
decode_gemm.cpp) is a pybind11 module built by cpp_extension.load and imported as a Python
module, and includes csrc/glue.h (CPU checks, scratch, work split, argument checks). pybind11
calls are the cheapest way in from Python here: a 13-integer call costs ~0.45 us against ~1 us
through ctypes with prebuilt arguments and ~2.4 us with argtypes, and the attention glue takes
torch tensors (shape checks in C++, no pointer juggling in Python). Glue that needs no tensor
includes pybind11 and <ATen/Parallel.h> only and takes addresses (tensor.data_ptr()): ~10 s to
compile instead of the ~35 s of <torch/extension.h> (ctypes glue took ~1 s, once per version)."""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_ext

log = logging.getLogger("pipefill.kernels")


def build_dir(name: str) -> Path:
    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
    path = Path.home() / ".cache" / "pipefill" / "kernels" / f"{name}-{tag}".replace("+", "_")
    path.mkdir(parents=True, exist_ok=True)
    return path


def require_ninja(what: str) -> None:
    """cpp_extension looks ninja up on PATH; a venv's python run by absolute path does not put
    the venv's bin (where `pip install ninja` puts it) there."""
    bindir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        os.environ["PATH"] = bindir + (os.pathsep + path if path else "")
    if not cpp_ext.is_ninja_available():
        raise RuntimeError(f"ninja is required to build {what}: "
                           f"run `{sys.executable} -m pip install ninja`")


def compile_object(source: Path, header: Path | tuple[Path, ...], flags: list[str],
                   out_dir: Path, stem: str) -> Path:
    """source -> <stem>-<hash>.o, rebuilt when the source, its header(s), flags or compiler
    change; written to a temporary name and renamed, so concurrent processes are safe."""
    headers = (header,) if isinstance(header, Path) else header
    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"C++ compiler {cxx!r} not usable: {e}") from None
    h = hashlib.sha256()
    for part in (source.read_bytes(), *(hd.read_bytes() for hd in headers),
                 " ".join(flags).encode(), version.encode(), cxx.encode()):
        h.update(part)
    obj = out_dir / f"{stem}-{h.hexdigest()[:16]}.o"
    if obj.exists():
        _drop_stale(out_dir, stem, obj)
        return obj
    tmp = out_dir / f".{obj.name}.{os.getpid()}.tmp.o"
    cmd = [cxx, *flags, "-I", str(source.parent), "-c", str(source), "-o", str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"compiling {source.name} failed:\n{' '.join(cmd)}\n"
                           f"{r.stderr[-4000:]}")
    os.replace(tmp, obj)
    _drop_stale(out_dir, stem, obj)
    return obj


# Objects and glue folders of other source versions are dropped only once unused this long:
# other checkouts of pipefill (a CI clone, an older commit, a helper's copy) share the cache and
# may be linking them right now.
STALE_AFTER_S = 7 * 24 * 3600


def _drop_stale(out_dir: Path, stem: str, keep: Path) -> None:
    os.utime(keep)  # in use: its age counts from now
    for stale in out_dir.glob(f"{stem}-*.o"):
        try:
            if stale != keep and time.time() - stale.stat().st_mtime > STALE_AFTER_S:
                stale.unlink()
        except OSError:
            pass


def glue_dir(out_dir: Path, sources: list[Path], objects: list[str],
             defines: tuple[str, ...] = ()) -> Path:
    """The folder where cpp_extension builds a glue library: one per version of its sources,
    headers, defines and the objects it links, so that checkouts at other versions never
    relink (or load half-written) one another's library."""
    h = hashlib.sha256()
    for src in sources:
        h.update(src.read_bytes())
    for obj in objects:
        h.update(Path(obj).name.encode())
    for define in defines:
        h.update(define.encode())
    path = out_dir / f"glue-{h.hexdigest()[:12]}"
    path.mkdir(exist_ok=True)
    os.utime(path)
    return path


CSRC = Path(__file__).resolve().parent / "csrc"
GLUE_HEADER = CSRC / "glue.h"  # included by every glue file
GLUE_VECTOR_ISA = CSRC / "glue_vector_isa.h"  # glue of scalar / AVX2 / AVX-512 builds
# The CPU flags each of those builds needs: base.platform.VECTOR_ISA_CPU_FLAGS.
# -fopenmp: at::parallel_for then runs on torch's own OpenMP pool (same libgomp, by soname).
GLUE_FLAGS = ["-O3", "-std=c++17", "-fopenmp"]


def link_glue(name: str, glue_src: Path, hashed: list[Path], objects: list[str], out_dir: Path,
              defines: tuple[str, ...] = (), **load_kwargs):
    """cpp_extension.load of one glue source (compiled with GLUE_FLAGS and `defines`, csrc/ on
    its include path) linked with `objects`, in its glue_dir; `hashed`: the headers it includes
    (GLUE_HEADER and its kernels' interface). Returns the imported module
    (is_python_module=False: the library's path). `defines` ("-DNAME=value"): constants whose
    one copy is in Python, so a build with other values gets a folder of its own.

    cpp_extension serialises builders with a `lock` file it creates and deletes itself, so a
    builder killed mid-build (Ctrl-C, a test's timeout) leaves it behind and every later build
    waits on it forever. Builders of this folder hold an flock first, which the kernel drops
    when its holder dies: whoever holds it knows that any `lock` file left there is stale."""
    folder = glue_dir(out_dir, [glue_src, *hashed], objects, defines)
    fd = os.open(folder / "build.flock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        return cpp_ext.load(name=name, sources=[str(glue_src)], extra_cflags=[*GLUE_FLAGS, *defines],
                            extra_include_paths=[str(CSRC)],
                            extra_ldflags=[*objects, "-fopenmp"], build_directory=str(folder),
                            verbose=False, **load_kwargs)
    finally:
        os.close(fd)


class LazyExtension:
    """A kernel extension built at first use, once per process. A failed build is remembered
    (not retried on every call) and raised as RuntimeError('<what> unavailable: <reason>')."""

    def __init__(self, what: str, build):
        self.what = what
        self._build = build
        self._lock = threading.Lock()
        self.module = None  # None until a build succeeded
        self._error: str | None = None

    def load(self):
        with self._lock:
            if self.module is None and self._error is None:
                try:
                    self.module = self._build()
                except Exception as e:  # noqa: BLE001 - any build problem means "not available"
                    self._error = f"{type(e).__name__}: {e}"
            if self.module is None:
                raise RuntimeError(f"{self.what} unavailable: {self._error}")
            return self.module


def platform_problem() -> str | None:
    """Why the C++ kernels cannot run here (they are Linux x86-64 code), or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux x86-64, this is {platform.system()} {platform.machine()}"
    return None


def build_isa_extension(name: str, what: str, isa_flags: dict[str, list[str]],
                        headers: tuple[Path, ...], glue_headers: tuple[Path, ...] = (),
                        source: Path | None = None, isa_define: str | None = None):
    """The module pipefill_<name>: glue csrc/<name>.cpp (including GLUE_HEADER and
    glue_headers) linked with one object per ISA of isa_flags, compiled from
    csrc/<name>_<isa>.cpp, or from `source` with -D<isa_define>=<isa> (one source built once
    per ISA), each including `headers`. RuntimeError where it cannot be built here."""
    problem = platform_problem()
    if problem:
        raise RuntimeError(problem)
    require_ninja(what)
    out = build_dir(name)
    t0 = time.perf_counter()
    objs = []
    for isa, flags in isa_flags.items():
        src = source or CSRC / f"{name}_{isa}.cpp"
        defines = [f"-D{isa_define}={isa}"] if isa_define else []
        objs.append(str(compile_object(src, headers, flags + defines, out, f"{name}_{isa}")))
    module = link_glue(f"pipefill_{name}", CSRC / f"{name}.cpp", [GLUE_HEADER, *glue_headers],
                       objs, out)
    if time.perf_counter() - t0 > 1:
        log.info("pipefill %s built in %.1f s (%s)", what, time.perf_counter() - t0, out)
    return module


class IsaExtension(LazyExtension):
    """A LazyExtension whose kernels come in per-ISA builds; status() says which run here:
    {isa: (usable, why not)}, from the module's `supported(code) -> (ok, why)` (cpuid and
    XCR0), read once per process. status() never raises: a build that fails marks every ISA
    unusable with the reason (the callers' torch paths run)."""

    def __init__(self, what: str, build, isa_codes: dict[str, int], supported: str):
        super().__init__(what, build)
        self.isa_codes, self.supported = isa_codes, supported
        self._status_lock = threading.Lock()
        self._status: dict[str, tuple[bool, str]] | None = None

    def status(self) -> dict[str, tuple[bool, str]]:
        with self._status_lock:
            if self._status is None:
                self._status = self._check()
            return self._status

    def _check(self) -> dict[str, tuple[bool, str]]:
        try:
            module = self.load()
        except RuntimeError as e:
            return {isa: (False, str(e)) for isa in self.isa_codes}
        status = {}
        for isa, code in self.isa_codes.items():
            ok, why = getattr(module, self.supported)(code)
            status[isa] = (ok, "ok" if ok else "cpuid: " + why)
        return status
