"""Small-M decode GEMM over weights packed at load time: y[M, N] = x[M, K] @ W[N, K]^T.

Decode steps multiply a handful of rows (one per running request) by every weight matrix; torch's
matmul streams the weights well at M = 1 but several times slower at M = 4..16. Here each call
reads each weight once for all rows: W is packed into groups of 48 output columns with the
column values of one k (float32) or of one k-pair (bf16) contiguous, the groups are split over
torch's thread pool, a register tile of up to 8 rows x 48 columns (AVX-512; 4 x 24 on AVX2) uses
each loaded weight for all its rows, and every row's sum is one chain in k order that does not
depend on M (a row gives the same bits alone or inside a batch). Padding N to whole groups costs
at most 47 columns per matrix (none for the default model's shapes).

Paths, one C++ translation unit each, built with its own -m flags and chosen at run time from
cpuid (a CPU never runs an instruction it lacks; ``disable=`` forces paths off for tests):

* ``amx``: bf16 activations x bf16 weights in AMX tiles (TDPBF16PS, 16 rows x 32 k x 16
  columns per instruction), float32 sums; K padded to a multiple of 32 in the packed copy.
  The vector paths turn compute-bound from ~8 rows; this one streams the weights at the same
  speed for every M up to 16. Its sums are batch-independent too, but not the same bits as
  ``avx512bf16``'s (another summation order).
* ``avx512bf16``: bf16 activations x bf16 weights with vdpbf16ps, float32 sums.
* ``avx512``: float32 compute, float32 or bf16 weights (bf16 widened in registers).
* ``avx2``: AVX2 + FMA, the same arithmetic as ``avx512`` (bit-identical results).

Larger M (prefill) stays on torch's
F.linear over the original [N, K] weights, so the packed copy costs one extra copy of each
packed matrix (or half of one for bf16 packs of float32 weights).

API: ``pack(weight, bias, compute_dtype, weight_dtype=None, max_rows=32, disable=()) ->
PackedLinear | None`` and ``PackedLinear(x) -> y``; ``PackedLinear.bind(x, out) -> BoundLinear``
(checked once, then ``bound()`` is one C call over the same buffers); ``isa_status()``;
``available()``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pipefill.kernels.build import CSRC, IsaExtension, build_isa_extension

BLOCK = 48  # output columns per packed group (kGroup in decode_gemm_kernel.h)
ISAS = ("amx", "avx512bf16", "avx512", "avx2")  # preference order
_ISA_CODE = {"avx2": 0, "avx512": 1, "avx512bf16": 2, "amx": 3}
BF16_ONLY = ("amx", "avx512bf16")  # bf16 activations and weights only
AMX_K = 32  # the AMX path's packed K is a multiple of this (kAmxK)
_BASE = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fno-exceptions"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl"]
ISA_FLAGS = {"avx2": _BASE + ["-mavx2", "-mfma"],
             "avx512": _BASE + _AVX512,
             "avx512bf16": _BASE + _AVX512 + ["-mavx512bf16"],
             "amx": _BASE + _AVX512 + ["-mavx512bf16", "-mamx-tile", "-mamx-bf16"]}
_HEADER = CSRC / "decode_gemm_kernel.h"
_STORE512 = CSRC / "decode_gemm_store512.h"  # the AVX-512 and AMX paths' row store
_F32, _BF16 = 0, 1
_CODE = {torch.float32: _F32, torch.bfloat16: _BF16}

_EXT = IsaExtension("the decode GEMM", functools.partial(
    build_isa_extension, "decode_gemm", "the decode GEMM", ISA_FLAGS, (_HEADER, _STORE512),
    (_HEADER,)), _ISA_CODE, "pf_dg_isa_supported")


def isa_status() -> dict[str, tuple[bool, str]]:
    """{isa: (usable here, why not)}; builds (or loads the cached) extension once. Never raises."""
    return _EXT.status()


# CPU flags (as /proc/cpuinfo names them) each path needs; --hide-cpu-flags turns paths off.
ISA_CPU_FLAGS = {"amx": ("amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl",
                         "avx512_bf16"),
                 "avx512bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
                 "avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma")}


def hidden_isas(hidden: str | frozenset[str] | tuple = "") -> tuple[str, ...]:
    """The paths that need a flag the user hid (--hide-cpu-flags "avx512f,avx512_bf16")."""
    if isinstance(hidden, str):
        hidden = {f.strip() for f in hidden.split(",")}
    return tuple(isa for isa, need in ISA_CPU_FLAGS.items() if set(need) & set(hidden))


def choose_isa(compute_dtype: torch.dtype, weight_dtype: torch.dtype,
               disable: tuple[str, ...] = ()) -> tuple[str | None, str]:
    """The fastest usable path for these dtypes -> (isa or None, why)."""
    if compute_dtype not in _CODE or weight_dtype not in _CODE:
        return None, f"dtypes {compute_dtype}/{weight_dtype} not supported"
    reasons = []
    for isa in ISAS:
        ok, why = isa_status()[isa]
        if isa in BF16_ONLY and (compute_dtype, weight_dtype) != (torch.bfloat16,) * 2:
            ok, why = False, "needs bf16 activations and weights"
        if isa in disable:
            ok, why = False, "disabled by caller"
        if ok:
            return isa, "ok"
        reasons.append(f"{isa}: {why}")
    return None, "; ".join(reasons)


def available(compute_dtype: torch.dtype = torch.float32,
              weight_dtype: torch.dtype | None = None) -> bool:
    return choose_isa(compute_dtype, weight_dtype or compute_dtype)[0] is not None


def padded_k(k: int, isa: str) -> int:
    """K of the packed copy: even, and a multiple of AMX_K for the AMX path (whole tiles)."""
    return -(-k // AMX_K) * AMX_K if isa == "amx" else k + (k & 1)


def pack_weight(weight: torch.Tensor, weight_dtype: torch.dtype,
                isa: str = "avx512") -> torch.Tensor:
    """[N, K] -> float32 [ng, Kp, 48] or bf16 [ng, Kp/2, 48, 2] (zero padding to a whole group
    of 48 columns and to Kp = padded_k(K, isa)). Written in place through a view of the packed
    tensor in W's row order, so packing costs the packed copy only (no padded or converted copy
    of the whole matrix on top: the LM head's would be 56 MB of bf16 for the default model)."""
    n, k = weight.shape
    nb, kp = -(-n // BLOCK), padded_k(k, isa)
    if weight_dtype == torch.float32:
        packed = torch.empty(nb, kp, BLOCK, dtype=weight_dtype)
        by_rows = packed.permute(0, 2, 1)  # [ng, 48, Kp]: group g's rows of W
    else:
        packed = torch.empty(nb, kp // 2, BLOCK, 2, dtype=weight_dtype)
        by_rows = packed.permute(0, 2, 1, 3)  # [ng, 48, Kp/2, 2]
    row_shape = by_rows.shape[2:]
    full = n // BLOCK if k == kp else 0  # groups that need no padding
    if full:
        by_rows[:full].copy_(weight[:full * BLOCK].reshape(full, BLOCK, *row_shape))
    for g in range(full, nb):  # padded groups, through a zeroed [48, Kp] tile
        tile = torch.zeros(BLOCK, kp, dtype=weight_dtype)
        rows = weight[g * BLOCK:(g + 1) * BLOCK]
        tile[:rows.shape[0], :k] = rows
        by_rows[g].copy_(tile.view(BLOCK, *row_shape))
    return packed


def call_operands(x: torch.Tensor, out: torch.Tensor | None, in_features: int,
                  out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode GEMM call's x [M, in_features] (float32 or bf16, made row-contiguous) and out
    [M, out_features] (allocated in x's dtype when None); ValueError/TypeError for a bad x."""
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x: expected [M, {in_features}], got {list(x.shape)}")
    if x.dtype not in _CODE:
        raise TypeError(f"x: expected float32 or bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    return x, out


@dataclass
class PackedLinear:
    """One packed weight matrix; calling it computes F.linear(x, W, bias) for x.shape[0] rows."""
    packed: torch.Tensor
    out_features: int
    in_features: int
    bias: torch.Tensor | None  # float32 [N]
    isa: str
    max_rows: int  # callers use torch above this many rows

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.packed.dtype

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x, out = call_operands(x, out, self.in_features, self.out_features)
        rc = _EXT.module.pf_dg_gemm(*self._gemm_args(x, out))
        if rc:
            raise RuntimeError(f"pipefill decode GEMM ({self.isa}) failed (rc={rc}) for x "
                               f"{x.dtype} {list(x.shape)}")
        return out

    def _gemm_args(self, x: torch.Tensor, out: torch.Tensor) -> tuple:
        """pf_dg_gemm's arguments for x -> out (one builder for the plain and the bound call,
        so both run the kernel on exactly the same arguments)."""
        return (_ISA_CODE[self.isa], x.data_ptr(), _CODE[x.dtype], x.stride(0),
                self.packed.data_ptr(), _CODE[self.packed.dtype],
                None if self.bias is None else self.bias.data_ptr(),
                out.data_ptr(), _CODE[out.dtype], out.stride(0), x.shape[0],
                self.out_features, self.in_features)

    def bind(self, x: torch.Tensor, out: torch.Tensor) -> BoundLinear:
        """A call of this matrix from x [M, K] into out [M, N], checked now: each later
        ``bound()`` recomputes out from x's current values with no checks and no data_ptr()
        calls. x and out must keep their storage (no resize_/set_) while the bound call is
        used; it holds references to both, so they stay allocated as long as it exists.
        ValueError for a shape, dtype, layout or device the kernel cannot take."""
        _check_bind(self, x, out)
        return BoundLinear(self, x, out, functools.partial(_EXT.module.pf_dg_gemm,
                                                           *self._gemm_args(x, out)))


def _rows_span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, end byte) of a 2-D tensor with contiguous rows."""
    n = ((t.shape[0] - 1) * t.stride(0) + t.shape[1]) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + n * t.element_size()


def _check_bind(lin: PackedLinear, x: torch.Tensor, out: torch.Tensor) -> None:
    for name, t, width in (("x", x, lin.in_features), ("out", out, lin.out_features)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(f"bind: {name} must be a CPU tensor")
        if t.dim() != 2 or t.shape[1] != width or t.shape[0] != x.shape[0]:
            rows = x.shape[0] if x.dim() == 2 else "M"
            raise ValueError(f"bind: {name}: expected [{rows}, {width}], got {list(t.shape)}")
        if t.dtype not in _CODE:
            raise ValueError(f"bind: {name}: expected float32 or bfloat16, got {t.dtype}")
        if (t.shape[1] > 1 and t.stride(1) != 1) or (t.shape[0] > 1 and t.stride(0) < width):
            raise ValueError(f"bind: {name} must have contiguous, non-overlapping rows "
                             f"(strides {t.stride()} for shape {list(t.shape)})")
    if lin.isa in BF16_ONLY and x.dtype != torch.bfloat16:
        raise ValueError(f"bind: the {lin.isa} path takes bfloat16 x, got {x.dtype}")
    (x0, x1), (o0, o1) = _rows_span(x), _rows_span(out)
    if x0 < o1 and o0 < x1:  # the kernel reads x while it writes out
        raise ValueError("bind: out overlaps x")


@dataclass(slots=True, eq=False)
class BoundLinear:
    """PackedLinear.bind's result: ``bound()`` computes linear(x) into out and returns out."""
    linear: PackedLinear
    x: torch.Tensor  # held so that the pointers in _gemm stay valid
    out: torch.Tensor
    _gemm: functools.partial  # pf_dg_gemm with every argument prebuilt

    def __call__(self) -> torch.Tensor:
        rc = self._gemm()
        if rc:
            raise RuntimeError(f"pipefill decode GEMM ({self.linear.isa}) failed (rc={rc}) "
                               f"for a bound x {self.x.dtype} {list(self.x.shape)}")
        return self.out


def pack(weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype,
         weight_dtype: torch.dtype | None = None, max_rows: int = 32,
         disable: tuple[str, ...] = ()) -> PackedLinear | None:
    """Packs [N, K] for the best usable path; None when no path can run here (torch then)."""
    weight_dtype = weight_dtype or weight.dtype
    isa, _ = choose_isa(compute_dtype, weight_dtype, disable)
    if isa is None or weight.device.type != "cpu":
        return None
    b = None if bias is None else bias.float().contiguous()
    return PackedLinear(pack_weight(weight, weight_dtype, isa), weight.shape[0], weight.shape[1],
                        b, isa, max_rows)
