"""Fused elementwise CPU ops (AVX-512, or AVX2 + FMA): add+RMSNorm, RoPE, SiLU*mul, and Gemma's
RMSNorm, post-norm + add + RMSNorm, per-head q/k norm + RoPE and GeGLU.

API (what the engine calls; all tensors on CPU, T = rows = tokens, any T >= 0):

* ``fused_available(force_disable=False, flags=None) -> (ok, reason)`` — cached, never raises.
  Checks the CPU flags, builds/loads the extension and verifies the CPU with cpuid/XCR0 (AVX512
  F/BW/VL). ``flags``: the CPU flags to trust (``usable_cpu_flags(--hide-cpu-flags)``): the best
  build they allow is selected for this process (avx512bf16, avx512, avx2; ``VARIANT_CPU_FLAGS``),
  and ``(False, why)`` when they allow none, exactly as a CPU without those flags would get.
  ``force_disable=True`` (or ``FORCE_DISABLE = True`` on this module) returns ``(False, why)``.
  When it is False the engine uses plain torch ops; the wrappers below then raise RuntimeError.
* ``add_rms_norm(residual, hidden, weight, eps, *, dtype=None, out=None) -> normed``
* ``rope_(x, cos, sin) -> x`` (in place)
* ``silu_mul(gate_up, out=None) -> out``
* ``gelu_tanh_mul(gate_up, out=None) -> out`` (Gemma's GeGLU)
* ``rms_norm(x, weight, eps, *, out=None) -> out`` (x in any of the two dtypes; out may be x)
* ``norm_add_rms_norm(residual, hidden, hidden_weight, weight, eps, *, out=None) -> normed``
  (Gemma's sandwich: hidden post-normed in place, added to the residual, normed again)
* ``qk_norm_rope_(x, num_q_heads, q_weight, k_weight, eps, cos, sin) -> x`` (in place)

All arithmetic is fp32, each result is rounded once to the output dtype (bf16: round to nearest
even, like ``.to(torch.bfloat16)``). Widths (H, D, I) must be multiples of 16. No autograd.

Build: ``csrc/fused_ops_avx512.cpp`` (the only code compiled with -mavx512*, entered only after
the runtime cpuid check) is compiled to object files with the C++ compiler directly;
``csrc/fused_ops.cpp`` (the check and the row split over torch's OpenMP pool via
``at::parallel_for``) is built without ISA flags by ``link_glue`` (kernels/build.py) and linked
with those objects. The kernel source is compiled twice: ``avx512`` (F/BW/VL) and ``avx512bf16``
(+AVX512-BF16 rounding instruction, chosen at run time when cpuid has it; see
``kernel_variant()``); ``csrc/fused_ops_avx2.cpp`` (-mavx2 -mfma, 8 lanes, same numerics) serves
CPUs without AVX-512. The entry points are module functions taking addresses and sizes (the GIL
is released during a call); the wrappers below check the tensors first. First build ~10 s on
two cores, cached in ``~/.cache/pipefill/kernels``.

Benchmark: ``python -m pipefill.bench.fused_ops`` (SmolLM2-135M shapes, T = 2048).
"""
from __future__ import annotations

import logging
import platform
import threading
import time

import torch

from pipefill.kernels.build import CSRC, GLUE_HEADER
from pipefill.kernels.build import build_dir as kernel_build_dir
from pipefill.kernels.build import compile_object, link_glue, require_ninja
from pipefill.base.platform import cpu_flags

log = logging.getLogger("pipefill.kernels")

FORCE_DISABLE = False  # module-level kill switch (tests, debugging)

_KERNEL_SRC = CSRC / "fused_ops_avx512.cpp"
_GLUE_SRC = CSRC / "fused_ops.cpp"
_HEADER = CSRC / "fused_ops_kernel.h"
# -ffp-contract=off: no implicit FMA contraction, so products/sums round as in torch eager.
KERNEL_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vl",
                "-ffp-contract=off", "-fno-exceptions"]
# The kernel source is compiled once per variant (namespace PF_FUSED_NS); the glue picks
# avx512bf16 (vcvtneps2bf16 rounding) when cpuid reports AVX512-BF16.
KERNEL_VARIANTS = {
    "avx512": KERNEL_FLAGS + ["-DPF_FUSED_NS=avx512"],
    "avx512bf16": KERNEL_FLAGS + ["-mavx512bf16", "-DPF_FUSED_NS=avx512bf16", "-DPF_HW_BF16=1"],
}
# CPUs without AVX-512 get the AVX2 + FMA build (its own source, 8 lanes).
_AVX2_SRC = CSRC / "fused_ops_avx2.cpp"
AVX2_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-mavx2", "-mfma", "-ffp-contract=off",
              "-fno-exceptions"]
REQUIRED_CPU_FLAGS = ("avx2", "fma")  # the least any build needs; cpuid picks the best build
# The CPU flags (as in /proc/cpuinfo) each build needs, best build first.
VARIANT_CPU_FLAGS = {
    "avx512bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "avx512": ("avx512f", "avx512bw", "avx512vl"),
    "avx2": ("avx2", "fma"),
}

_F32, _BF16 = 0, 1
_DTYPE_CODE = {torch.float32: _F32, torch.bfloat16: _BF16}

_lock = threading.Lock()
_lib = None  # the extension module, set only once fused_available() succeeded
_status: tuple[bool, str] | None = None


# ----------------------------------------------------------------------------- build / check

def _build():
    require_ninja("the fused ops")
    build_dir = kernel_build_dir("fused_ops")
    t0 = time.perf_counter()
    objs = []
    for variant, flags in KERNEL_VARIANTS.items():
        try:
            objs.append(str(compile_object(_KERNEL_SRC, _HEADER, flags, build_dir,
                                           f"fused_{variant}")))
        except RuntimeError as e:
            if variant == "avx512":
                raise
            # e.g. a compiler without -mavx512bf16: this namespace gets the plain AVX-512 code.
            log.warning("pipefill fused ops: %s variant not built, using avx512 code for it: %s",
                        variant, str(e).splitlines()[0])
            fallback = [f for f in KERNEL_VARIANTS["avx512"] if not f.startswith("-DPF_FUSED_NS")]
            objs.append(str(compile_object(_KERNEL_SRC, _HEADER,
                                           fallback + [f"-DPF_FUSED_NS={variant}"], build_dir,
                                           f"fused_{variant}-fallback")))
    objs.append(str(compile_object(_AVX2_SRC, _HEADER, AVX2_FLAGS, build_dir, "fused_avx2")))
    module = link_glue("pipefill_fused_ops", _GLUE_SRC, [GLUE_HEADER, _HEADER], objs, build_dir)
    dt = time.perf_counter() - t0
    if dt > 1:
        log.info("pipefill fused ops built in %.1f s (%s)", dt, build_dir)
    return module


def _check() -> tuple[bool, str]:
    global _lib
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"needs Linux x86-64, this is {platform.system()} {platform.machine()}"
    flags = cpu_flags()
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in flags]
    if missing:
        return False, "CPU lacks " + ", ".join(missing)
    try:
        lib = _build()
    except Exception as e:  # noqa: BLE001 - any build/load problem means "not available"
        return False, f"fused ops extension unavailable: {type(e).__name__}: {e}"
    ok, why = lib.pf_fused_cpu_supported()
    if not ok:
        return False, "cpuid: " + why
    _lib = lib
    return True, "ok"


def fused_available(force_disable: bool = False,
                    flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """(True, "ok") when the fused ops can run in this process, else (False, why). Never raises.

    The first call builds (or loads the cached) extension; the result is cached. `flags` (the
    CPU flags to trust, e.g. usable_cpu_flags(args.hide_cpu_flags)) selects the best build they
    allow, process-wide; None keeps the current build (at first: the best cpuid allows)."""
    global _status
    if force_disable or FORCE_DISABLE:
        return False, "fused ops disabled by caller (force_disable)"
    if _status is None:
        with _lock:
            if _status is None:
                try:
                    _status = _check()
                except Exception as e:  # noqa: BLE001
                    _status = (False, f"unexpected error: {type(e).__name__}: {e}")
    if not _status[0] or flags is None:
        return _status
    return _select_for_flags(frozenset(flags))


def _select_for_flags(flags: frozenset[str]) -> tuple[bool, str]:
    """Selects the best build `flags` allow (and cpuid confirms); (False, why) if none."""
    reasons = []
    for variant, need in VARIANT_CPU_FLAGS.items():
        missing = [f for f in need if f not in flags]
        if missing:
            reasons.append(f"{variant}: CPU lacks {', '.join(missing)}")
        elif _lib.pf_fused_select(variant):
            return True, "ok"
        else:
            reasons.append(f"{variant}: cpuid says no")
    return False, "; ".join(reasons)



def kernel_variant() -> str:
    """Name of the kernel build in use ("avx512", "avx512bf16" or "avx2"), "" when
    unavailable."""
    if not fused_available()[0]:
        return ""
    return _lib.pf_fused_kernel_name()


def _select_variant(name: str) -> bool:
    """Tests/benchmarks: switch the kernel build (not safe while ops run on other threads)."""
    if not fused_available()[0]:
        return False
    return _lib.pf_fused_select(name)


def _require():
    if _lib is None or FORCE_DISABLE:
        ok, why = fused_available()
        if not ok:
            raise RuntimeError(f"pipefill fused ops unavailable: {why}")
    return _lib


# ----------------------------------------------------------------------------- ops

def unchecked_lib():
    """The C entry points (pf_add_rms_norm, pf_rope, pf_silu_mul, and Gemma's pf_rms_norm,
    pf_norm_add_rms_norm, pf_qk_norm_rope, pf_gelu_tanh_mul) for callers that own their
    buffers and call them per decode layer: the wrappers below re-check shapes, dtypes and
    strides on every call, which costs more than the kernel at one row. Raises RuntimeError
    when the ops are unavailable."""
    return _require()


def dtype_code(dtype: torch.dtype) -> int:
    """The C entry points' code for a float32 or bfloat16 tensor."""
    if dtype not in _DTYPE_CODE:
        raise TypeError(f"expected bfloat16 or float32, got {dtype}")
    return _DTYPE_CODE[dtype]


def _code(t: torch.Tensor, what: str) -> int:
    code = _DTYPE_CODE.get(t.dtype)
    if code is None:
        raise TypeError(f"{what}: expected bfloat16 or float32, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{what}: expected a CPU tensor, got {t.device}")
    return code


def _check_width(n: int, what: str) -> None:
    if n % 16:
        raise ValueError(f"{what} must be a multiple of 16, got {n}")


def _check_rows(t: torch.Tensor, what: str, shape: tuple[int, int]) -> None:
    if t.dim() != 2 or tuple(t.shape) != shape:
        raise ValueError(f"{what}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{what}: last dim must be contiguous (strides {t.stride()})")


def _fail(rc: int, op: str) -> None:
    raise RuntimeError(f"pipefill fused {op} failed (rc={rc})")


def add_rms_norm(residual: torch.Tensor, hidden: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, *, dtype: torch.dtype | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Residual add + RMSNorm, fused: one pass over the rows.

    ``residual``: float32 [T, H] (last dim contiguous), updated IN PLACE to
    ``residual + hidden.float()`` (skipped when ``hidden`` is None). ``hidden``: [T, H], bf16 or
    float32. Returns ``normed = residual / sqrt(mean(residual^2, -1) + eps) * weight`` (weight:
    float32 [H]) computed in fp32 and rounded once to ``dtype`` (default: hidden's dtype, or
    float32 when hidden is None), in a new tensor (or in ``out``, [T, H] of that dtype).
    Equals ``F.rms_norm(residual, (H,), weight, eps).to(dtype)`` up to fp32 rounding of the
    mean. H must be a multiple of 16.
    """
    lib = _require()
    if residual.dtype != torch.float32 or residual.dim() != 2:
        raise TypeError(f"residual: expected float32 [T, H], got {residual.dtype} "
                        f"{list(residual.shape)}")
    _code(residual, "residual")
    T, H = residual.shape
    _check_width(H, "hidden size H")
    _check_rows(residual, "residual", (T, H))
    if weight.dtype != torch.float32 or tuple(weight.shape) != (H,) or not weight.is_contiguous():
        raise TypeError(f"weight: expected contiguous float32 [{H}], got {weight.dtype} "
                        f"{list(weight.shape)}")
    _code(weight, "weight")
    if hidden is not None:
        hcode = _code(hidden, "hidden")
        _check_rows(hidden, "hidden", (T, H))
        hptr, hst = hidden.data_ptr(), hidden.stride(0)
        if dtype is None:
            dtype = hidden.dtype
    else:
        hcode, hptr, hst = _F32, None, 0
        if dtype is None:
            dtype = torch.float32
    if out is None:
        out = torch.empty((T, H), dtype=dtype)
    else:
        if out.dtype != dtype:
            raise TypeError(f"out: expected {dtype}, got {out.dtype}")
        _check_rows(out, "out", (T, H))
    ocode = _code(out, "out")
    if T == 0:
        return out
    rc = lib.pf_add_rms_norm(residual.data_ptr(), residual.stride(0), hptr, hcode, hst,
                             weight.data_ptr(), out.data_ptr(), ocode, out.stride(0), T, H,
                             float(eps))
    if rc:
        _fail(rc, "add_rms_norm")
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding applied IN PLACE to ``x`` [T, N, D]; returns ``x``.

    ``x``: bf16 or float32; may be a strided view (e.g. a column slice of a fused qkv matrix):
    the last dim must be contiguous, row and head strides are arbitrary. ``cos``/``sin``:
    float32 [T, D/2] (or [T, 1, D/2]), contiguous. For i < D/2, with x1 = x[..., i],
    x2 = x[..., i + D/2]: x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin, computed in fp32
    (no FMA; bit-identical to that fp32 formula) and rounded once to x's dtype.
    D must be a multiple of 16.
    """
    lib = _require()
    code = _code(x, "x")
    if x.dim() != 3:
        raise ValueError(f"x: expected [T, N, D], got {list(x.shape)}")
    T, N, D = x.shape
    _check_width(D, "head_dim D")
    if x.stride(2) != 1:
        raise ValueError(f"x: last dim must be contiguous (strides {x.stride()})")
    _check_cos_sin(cos, sin, T, D // 2)
    if T == 0 or N == 0:
        return x
    rc = lib.pf_rope(x.data_ptr(), code, x.stride(0), x.stride(1), T, N, D, cos.data_ptr(),
                     sin.data_ptr())
    if rc:
        _fail(rc, "rope_")
    return x


def _check_cos_sin(cos: torch.Tensor, sin: torch.Tensor, T: int, half: int) -> None:
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise TypeError(f"{name}: expected a contiguous float32 CPU tensor, got {t.dtype}")
        if t.numel() != T * half or (t.dim() > 0 and t.shape[0] != T) or t.shape[-1] != half:
            raise ValueError(f"{name}: expected [{T}, {half}], got {list(t.shape)}")


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU activation: ``out[T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]``.

    ``gate_up``: [T, 2I], bf16 or float32, last dim contiguous. Computed in fp32 and rounded
    once to gate_up's dtype; written to a new tensor or to ``out`` ([T, I], same dtype, last
    dim contiguous). I must be a multiple of 16.
    """
    return _act_mul(gate_up, out, "silu_mul")


def gelu_tanh_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU (Gemma): ``gelu(gate_up[:, :I], approximate="tanh") * gate_up[:, I:]``, as
    silu_mul. Computed as g / (1 + exp(-z)) * u with z = 2 sqrt(2/pi) (g + 0.044715 g^3), equal
    to torch's 0.5 g (1 + tanh(z / 2)) but without its cancellation for negative g."""
    return _act_mul(gate_up, out, "gelu_tanh_mul")


def _act_mul(gate_up: torch.Tensor, out: torch.Tensor | None, op: str) -> torch.Tensor:
    lib = _require()
    code = _code(gate_up, "gate_up")
    if gate_up.dim() != 2:
        raise ValueError(f"gate_up: expected [T, 2I], got {list(gate_up.shape)}")
    T, I2 = gate_up.shape
    if I2 % 32:
        raise ValueError(f"gate_up: width 2I must be a multiple of 32, got {I2}")
    _check_rows(gate_up, "gate_up", (T, I2))
    I = I2 // 2  # noqa: E741
    out = _out_rows(out, gate_up.dtype, (T, I))
    if T == 0:
        return out
    rc = getattr(lib, "pf_" + op)(gate_up.data_ptr(), code, gate_up.stride(0), out.data_ptr(),
                                  out.stride(0), T, I)
    if rc:
        _fail(rc, op)
    return out


def _out_rows(out: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, int]):
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if out.dtype != dtype:
        raise TypeError(f"out: expected {dtype}, got {out.dtype}")
    _code(out, "out")
    _check_rows(out, "out", shape)
    return out


def _norm_weight(weight: torch.Tensor, width: int, what: str) -> None:
    if (weight.dtype != torch.float32 or tuple(weight.shape) != (width,)
            or not weight.is_contiguous() or weight.device.type != "cpu"):
        raise TypeError(f"{what}: expected contiguous float32 [{width}], got {weight.dtype} "
                        f"{list(weight.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` of x [T, H] (bf16 or float32, last dim
    contiguous) in fp32, rounded once to x's dtype, into a new tensor or ``out`` (x itself
    normalises in place). The same arithmetic as add_rms_norm's norm. H: a multiple of 16."""
    lib = _require()
    code = _code(x, "x")
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, H], got {list(x.shape)}")
    T, H = x.shape
    _check_width(H, "hidden size H")
    _check_rows(x, "x", (T, H))
    _norm_weight(weight, H, "weight")
    out = _out_rows(out, x.dtype, (T, H))
    if T == 0:
        return out
    rc = lib.pf_rms_norm(x.data_ptr(), code, x.stride(0), weight.data_ptr(), out.data_ptr(),
                         code, out.stride(0), T, H, float(eps))
    if rc:
        _fail(rc, "rms_norm")
    return out


def norm_add_rms_norm(residual: torch.Tensor, hidden: torch.Tensor, hidden_weight: torch.Tensor,
                      weight: torch.Tensor, eps: float, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Gemma's norms around a residual add, one pass over the rows: ``hidden`` [T, H] is
    RMS-normed by ``hidden_weight`` IN PLACE (rounded to its dtype), then as add_rms_norm:
    ``residual += hidden``, returns the residual normed by ``weight`` in hidden's dtype. The
    bits of ``rms_norm(hidden, hidden_weight, out=hidden)`` then ``add_rms_norm``."""
    lib = _require()
    if residual.dtype != torch.float32 or residual.dim() != 2:
        raise TypeError(f"residual: expected float32 [T, H], got {residual.dtype} "
                        f"{list(residual.shape)}")
    T, H = residual.shape
    _check_width(H, "hidden size H")
    _check_rows(residual, "residual", (T, H))
    hcode = _code(hidden, "hidden")
    _check_rows(hidden, "hidden", (T, H))
    _norm_weight(hidden_weight, H, "hidden_weight")
    _norm_weight(weight, H, "weight")
    out = _out_rows(out, hidden.dtype, (T, H))
    if T == 0:
        return out
    rc = lib.pf_norm_add_rms_norm(residual.data_ptr(), residual.stride(0), hidden.data_ptr(),
                                  hcode, hidden.stride(0), hidden_weight.data_ptr(),
                                  weight.data_ptr(), out.data_ptr(), hcode, out.stride(0), T, H,
                                  float(eps))
    if rc:
        _fail(rc, "norm_add_rms_norm")
    return out


def qk_norm_rope_(x: torch.Tensor, num_q_heads: int, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm then rotate-half RoPE, IN PLACE, of x [T, N, D] (q's heads then k's,
    as rope_ takes them): heads [0, num_q_heads) normed by q_weight, the rest by k_weight
    (float32 [D]), each rounded to x's dtype, then rotated as rope_ does. The bits of rms_norm
    per head followed by rope_; returns x."""
    lib = _require()
    code = _code(x, "x")
    if x.dim() != 3:
        raise ValueError(f"x: expected [T, N, D], got {list(x.shape)}")
    T, N, D = x.shape
    if not 0 <= num_q_heads <= N:
        raise ValueError(f"num_q_heads {num_q_heads} outside [0, {N}]")
    _check_width(D, "head_dim D")
    if x.stride(2) != 1:
        raise ValueError(f"x: last dim must be contiguous (strides {x.stride()})")
    _norm_weight(q_weight, D, "q_weight")
    _norm_weight(k_weight, D, "k_weight")
    _check_cos_sin(cos, sin, T, D // 2)
    if T == 0 or N == 0:
        return x
    rc = lib.pf_qk_norm_rope(x.data_ptr(), code, x.stride(0), x.stride(1), T, num_q_heads,
                             N - num_q_heads, D, q_weight.data_ptr(), k_weight.data_ptr(),
                             float(eps), cos.data_ptr(), sin.data_ptr())
    if rc:
        _fail(rc, "qk_norm_rope_")
    return x
