"""Linear layers whose weights stay GGUF blocks (kernels.gguf_blocks: Q4_0, Q4_1, Q5_0, Q8_0,
Q4_K, Q5_K, Q6_K) or FP8 e4m3 with 128 x 128 block scales (kernels.fp8_blocks): the decode GEMM
reads the blocks and dequantizes them in registers; prefill dequantizes the matrix per call into
the compute dtype and runs torch's GEMM on it.

A decode step reads every weight once, so its time follows the bytes of the weights: a Q4_K
matrix is 4.5 bits a weight, Q4_1 5, Q6_K 6.6, against bf16's 16. Each call splits the output
columns over torch's thread pool; a column's blocks are dequantized once per tile of rows (8 on
AVX-512, 4 on AVX2), 32 weights at a time (a block of the 32-weight types, a sub-block of the
256-weight K types, whose 6-bit scales are decoded once per block), into float32 registers with
the bits of ggml's own dequantization, and multiplied by the float32 activations (bf16
activations are widened first), one float32 sum per output. FP8 weights (one byte each, half of
bf16's) go 32 at a time: widened exactly through IEEE halves and times their block's scale,
rounded once, the float32 value of torch's ``weight.to(float32) * scale``
(csrc/fp8_gemm_kernel.h; the AVX2 path needs F16C too).

Paths, one C++ translation unit each, built with their own -m flags and chosen at run time from
cpuid (``disable=`` forces paths off for tests, as --hide-cpu-flags does): ``avx512``,
``avx2`` (AVX2 + FMA) and ``scalar`` (any x86-64); where the extension cannot build, ``torch``
dequantizes with the gguf package and multiplies with F.linear.

Prefill (more rows than ``max_rows``) runs the integer path below on all its rows up to
INT8_PREFILL_MAX_ROWS rows of the compute dtype (bf16 512, float32 any: measured faster by
``bench decode-gemm --prefill-vs-int8``, ARCHITECTURE.md 'GGUF blocks kept quantized'), or
where it does not, dequantizes the whole matrix into the compute dtype for each call (on the
same path, vectorised like the decode GEMM; bf16 rounded to nearest even in registers), then
F.linear: about N·K element operations against the GEMM's 2·M·N·K, under 1% of a chunk of 256
rows, and one matrix's dequantized copy alive at a time (freed after the call), so the stage
never holds a dequantized copy of its weights.

The integer path (GGUF blocks; csrc/quant_int8_kernel.h, quant_int8_simd.h) replaces that
float arithmetic in decode where the CPU has it: each call quantizes every activation row once
to int8 in blocks of 32 (one float32 scale dx = amax / 127 a block, codes rounded to nearest
even) and multiplies the blocks' integer codes by them with integer dot products, applying
each block's float scales once per block (and its offset, Q4_1's m and the K types' mins,
through the activation block's sum; zero points through the same sums, exactly in int32). The
dequantization is no longer the work: a block is unpacked once for all rows of a tile and each
row adds two integer dot products per 128 weights, and three float operations per 128 (K types,
short rows) or per 512 (the 32-weight types on rows of at least 1024 weights on zmm, 512 on
ymm: their blocks transposed into one lane each, csrc/quant_int8_simd.h, which says why the
blocking suits the caches). On both integer paths every type is instead held in a 16-row
layout written once at load (kernels.gguf_blocks.to_rows16: the same bytes, each field of 16
rows' blocks side by side; csrc/quant_int8_rows16.h on VNNI, quant_int8_rows16_avx2.h): one
output column per 32-bit lane, the activations' natural codes broadcast, so a unit of 32
weights of 16 rows costs a few loads and masks plus 8 vpdpbusd (AVX2: two halves of 8 rows,
8 vpmaddubsw and 1-8 vpmaddwd each) and 3-4 float operations per row, about a quarter of the
row-major kernels' work per byte at M = 1, where the call then streams its bytes at memory
speed (``disable`` "int8-rows16" keeps the file's row order and the row-major kernels). Paths:
``avx512vnni`` (vpdpbusd on zmm, 8 rows a tile) and ``avx2`` (vpmaddubsw + vpmaddwd on ymm, 4
rows), chosen from cpuid; ``disable`` turns them off by ``int8`` (both), ``int8-<path>``, or
the float path their build includes (``avx512`` or ``avx2``); --hide-cpu-flags avx512_vnni
hides the first (hidden_int8_paths). The activations' rounding is the only change to the
result: each x is off by at most half its block's dx, as in llama.cpp's Q8_0/Q8_1 dot
products (tests/kernels/test_quant_int8.py bounds both errors).

API: ``QuantLinear.from_parts([(raw uint8 [n, row_bytes], ggml type), ...], in_features,
bias, max_rows, disable, order)``, ``QuantLinear.from_fp8([(weight float8_e4m3fn [n, K],
scales [ceil(n / 128), ceil(K / 128)]), ...], ..., order)`` (order: the rows moved as
plain_matrix[order] before any layout is written); ``lin(x, out=None)`` (decode), ``lin.bind(x,
out)`` (checked once, then ``bound()`` is the GEMM calls with prebuilt arguments),
``lin.prefill(x)`` (``prefill_int8``, ``prefill_dequantized``: each way alone;
``int8_prefills(rows, dtype)``, ``prefill_rule(dtype)``), ``lin.dequantize(dtype)``, ``lin.nbytes``, ``lin.shape``,
``lin.take_rows(order)``, ``lin.int8`` (the integer path or None), ``lin.decode_path``;
``isa_status()``, ``choose_isa(disable, fp8=False)``, ``choose_int8(disable)``,
``int8_status()``, ``quantize_activations(x, path)``.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pipefill.base.platform import VECTOR_ISA_CPU_FLAGS
from pipefill.kernels.build import CSRC, GLUE_VECTOR_ISA, IsaExtension, build_isa_extension
from pipefill.kernels import fp8_blocks, huge_pages
from pipefill.kernels.decode_gemm import call_operands
from pipefill.kernels.gguf_blocks import (BLOCK_TYPES, ROWS16, from_rows16, row_bytes,
                                          rows16_supported, rows16_take, supports, to_rows16,
                                          type_name)
from pipefill.kernels.prefill_gemm import torch_linear

ISAS = ("avx512", "avx2", "scalar")  # preference order
_ISA_CODE = {"scalar": 0, "avx2": 1, "avx512": 2}
_BASE = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fno-exceptions"]
ISA_FLAGS = {"scalar": _BASE,
             "avx2": _BASE + ["-mavx2", "-mfma", "-mf16c"],
             "avx512": _BASE + ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
                                "-mavx512vl"],
             # The integer path's VNNI build (its AVX2 build is inside "avx2").
             "avx512vnni": _BASE + ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
                                    "-mavx512vl", "-mavx512vnni"]}
_HEADER = CSRC / "quant_gemm_kernel.h"
_SIMD = CSRC / "quant_gemm_simd.h"  # the AVX2 and AVX-512 paths' kernel
_FP8_HEADER, _FP8_SIMD = CSRC / "fp8_gemm_kernel.h", CSRC / "fp8_gemm_simd.h"
_CODE = {torch.float32: 0, torch.bfloat16: 1}
# rows() dequantizes each id's 16-row group up to this many ids (a decode step's lookups);
# past it, gathering the ids' own bytes reads 16x less than the groups.
GROUP_LOOKUP_ROWS = 16
INT8_PATHS = ("avx512vnni", "avx2")  # the integer path's builds, preference order
_INT8_CODE = {"avx2": 0, "avx512vnni": 1}
_INT8_BASE = {"avx512vnni": "avx512", "avx2": "avx2"}  # the float build each one extends
# CPU flags (as /proc/cpuinfo names them) each float build needs (VECTOR_ISA_CPU_FLAGS), with
# FP8 weights (the AVX2 path widens codes with F16C), and each integer path needs.
ISA_CPU_FLAGS = VECTOR_ISA_CPU_FLAGS
FP8_CPU_FLAGS = {**ISA_CPU_FLAGS, "avx2": ISA_CPU_FLAGS["avx2"] + ("f16c",)}
INT8_CPU_FLAGS = {"avx512vnni": ("avx512_vnni", "avx512f", "avx512bw", "avx512vl", "f16c"),
                  "avx2": ("avx2", "fma", "f16c")}
_INT8_HEADER, _INT8_SIMD = CSRC / "quant_int8_kernel.h", CSRC / "quant_int8_simd.h"
# The integer paths' kernels on the 16-row layout (VNNI, AVX2) and the records they share.
_ROWS16 = (CSRC / "quant_int8_rows16.h", CSRC / "quant_int8_rows16_avx2.h",
           CSRC / "quant_int8_rows16_records.h")
_SIMD_COMMON = CSRC / "quant_simd_common.h"  # what the vector headers above share
# Prefill (more rows than max_rows) runs the integer path up to this many rows, by the compute
# dtype, the dequantized copy and torch's GEMM above (QuantLinear.int8_prefills), with the
# reason the start-up log gives. Measured by `bench decode-gemm --prefill-vs-int8` on both GGUF
# files' layers (Zen 4, 1 thread's CPU time; ARCHITECTURE.md, 'GGUF blocks kept quantized'):
# against bf16 (oneDNN) 1.05-5x faster at 16-512 rows, 0.99-1.27x at 1,024, 0.81-1.30x at
# 2,048; against float32 (MKL's sgemm) 2.1-27x at every count up to 2,048.
INT8_PREFILL_MAX_ROWS = {torch.bfloat16: 512, torch.float32: 1 << 62}
INT8_PREFILL_WHY = {
    torch.bfloat16: "measured 1.05-5x faster than bf16 dequantize + GEMM up to 512 rows, "
                    "0.81-1.30x at 1,024-2,048, where the dequantized copy keeps bf16's smaller "
                    "error",
    torch.float32: "measured 2.1-27x faster than float32 dequantize + GEMM up to 2,048 rows"}

_EXT = IsaExtension("the quantized decode GEMM", functools.partial(
    build_isa_extension, "quant_gemm", "the quantized decode GEMM", ISA_FLAGS,
    (_HEADER, _SIMD, _FP8_HEADER, _FP8_SIMD, _INT8_HEADER, _INT8_SIMD, *_ROWS16, _SIMD_COMMON),
    (GLUE_VECTOR_ISA, _HEADER, _FP8_HEADER, _INT8_HEADER)),
    _ISA_CODE, "pf_qg_isa_supported")


def isa_status() -> dict[str, tuple[bool, str]]:
    """{isa: (usable here, why not)}; builds (or loads the cached) extension once. Never raises."""
    return _EXT.status()


@functools.cache
def fp8_isa_status() -> dict[str, tuple[bool, str]]:
    """isa_status for FP8 weights: the AVX2 path also needs F16C (every AVX2 CPU has it).
    Read once per process (a loader asks once per expert)."""
    status = dict(isa_status())
    for isa, (ok, _) in status.items():
        if ok:
            ok, why = _EXT.module.pf_qg_fp8_isa_supported(_ISA_CODE[isa])
            status[isa] = (ok, "ok" if ok else "cpuid: " + why)
    return status


def choose_isa(disable: tuple[str, ...] = (), fp8: bool = False) -> tuple[str, str]:
    """The fastest usable path (for FP8 weights where `fp8`) -> (isa, why); 'torch' where no
    kernel path runs here."""
    reasons = []
    status = fp8_isa_status() if fp8 else isa_status()
    for isa in ISAS:
        ok, why = status[isa]
        if isa in disable:
            ok, why = False, "disabled by caller"
        if ok:
            return isa, "ok"
        reasons.append(f"{isa}: {why}")
    return "torch", "; ".join(reasons)


@functools.cache
def int8_status() -> dict[str, tuple[bool, str]]:
    """{integer path: (usable here, why not)}, read once per process. Never raises."""
    if not any(ok for ok, _ in isa_status().values()):
        return {p: (False, "the kernels did not build") for p in INT8_PATHS}
    status = {}
    for path in INT8_PATHS:
        ok, why = _EXT.module.pf_qg_int8_supported(_INT8_CODE[path])
        status[path] = (ok, "ok" if ok else "cpuid: " + why)
    return status


def choose_int8(disable: tuple[str, ...] = ()) -> tuple[str | None, str]:
    """The integer path decode takes -> (path or None, why): the first usable one that
    `disable` does not turn off ("int8", "int8-<path>" or its float build's name)."""
    reasons = []
    for path in INT8_PATHS:
        ok, why = int8_status()[path]
        off = {"int8", f"int8-{path}", _INT8_BASE[path]} & set(disable)
        if off:
            ok, why = False, f"disabled ({', '.join(sorted(off))})"
        if ok:
            return path, "ok"
        reasons.append(f"{path}: {why}")
    return None, "; ".join(reasons)


def rows16_usable(int8: str | None, disable: tuple[str, ...] = ()) -> bool:
    """Whether the blocks are held in the 16-row layout: on either integer path (VNNI and
    AVX2 each have a kernel for it), unless `disable` names "int8-rows16" (the row-major
    kernels, for tests and benchmarks)."""
    return int8 in INT8_PATHS and "int8-rows16" not in disable


def hidden_int8_paths(hidden: str = "") -> tuple[str, ...]:
    """disable entries for the integer paths that need a flag the user hid (--hide-cpu-flags)."""
    flags = {f.strip() for f in hidden.split(",")}
    return tuple(f"int8-{p}" for p, need in INT8_CPU_FLAGS.items() if flags & set(need))


def quantize_activations(x: torch.Tensor, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer path's quantization of x [M, K] (float32; K a multiple of 32) -> (int8 codes
    [M, K], float32 scales [M, K / 32]): what its kernels multiply."""
    x = x.float().contiguous()
    q = torch.empty(x.shape, dtype=torch.int8)
    dx = torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.float32)
    rc = _EXT.module.pf_qg_int8_quantize(_INT8_CODE[path], x.data_ptr(), x.stride(0), x.shape[0],
                                         x.shape[1], q.data_ptr(), dx.data_ptr())
    if rc:
        raise RuntimeError(f"pipefill int8 quantize ({path}) failed (rc={rc})")
    return q, dx


def stream_read(buf: torch.Tensor, ahead: int = 0, isa: str | None = None) -> int:
    """Reads buf (uint8, contiguous, 64-byte aligned, a whole number of 64-byte lines) once on
    torch's threads, as a decode GEMM at M = 1 streams its weights, on the loads of `isa` (the
    decode GEMM's, by default: csrc/quant_gemm_kernel.h's xor_lines; `ahead` > 0: software
    prefetch that many lines ahead) -> the xor of its 64-bit words."""
    if buf.dtype != torch.uint8 or not buf.is_contiguous() or buf.data_ptr() % 64 \
            or buf.numel() % 64:
        raise ValueError("stream_read: expected contiguous uint8 bytes, 64-byte aligned, a "
                         f"multiple of 64 long; got {buf.dtype} of {buf.numel()} at "
                         f"{buf.data_ptr() % 64} past a 64-byte boundary")
    isa = isa or choose_isa()[0]
    if isa == "torch" or not isa_status()[isa][0]:
        raise RuntimeError(f"stream_read: the quantized GEMM's {isa} path does not run here")
    return _EXT.module.pf_qg_stream_read(_ISA_CODE[isa], buf.data_ptr(), buf.numel(), ahead)


def read_bandwidth(nbytes: int = 512 << 20, reps: int = 5, ahead: int = 0,
                   isa: str | None = None) -> float:
    """Bytes per second that torch's threads read from memory: the best of `reps` passes of
    stream_read over `nbytes`, far more than the caches hold, on the pages large weights lie on
    (kernels.huge_pages): the most a decode GEMM at M = 1 can stream."""
    buf = huge_pages.empty((nbytes // 64 * 64,))
    buf.fill_(1)
    best = float("inf")
    for _ in range(reps + 1):  # the first pass: warm-up
        t0 = time.perf_counter()
        stream_read(buf, ahead, isa)
        best = min(best, time.perf_counter() - t0)
    return buf.numel() / best

@dataclass
class QuantPart:
    """Rows [offset, offset + rows) of a linear layer's output, as GGUF blocks of one type, or
    as FP8 codes with their block scales (`scale` set). `rows16`: the blocks are held in the
    16-row layout (kernels.gguf_blocks.to_rows16: the same bytes, rows padded to a multiple of
    16) that the integer paths' 16-row kernels read; file_rows() gives them back as the file
    has them."""
    raw: torch.Tensor  # uint8 [rows, row_bytes]; FP8: the codes' bytes [rows, K]
    qtype: int  # GGML type id (kernels.gguf_blocks.BLOCK_TYPES); FP8: FP8_TYPE
    offset: int
    scale: torch.Tensor | None = None  # FP8: float32 [grid rows, ceil(K / 128)]
    scale_row: torch.Tensor | None = None  # FP8: int32 [rows], each row's row of `scale`
    rows16: int = 0  # the rows held in the 16-row layout (raw has them padded), or 0

    @property
    def rows(self) -> int:
        return self.rows16 or self.raw.shape[0]

    def file_rows(self) -> torch.Tensor:
        """uint8 [rows, row_bytes] in the file's layout (a copy where rows16)."""
        return from_rows16(self.raw, self.qtype, self.rows16) if self.rows16 else self.raw

    def as_rows16(self) -> QuantPart:
        return QuantPart(to_rows16(self.raw, self.qtype), self.qtype, self.offset,
                         rows16=self.rows)

    @property
    def type_name(self) -> str:
        return fp8_blocks.NAME if self.scale is not None else type_name(self.qtype)


FP8_TYPE = -1  # QuantPart.qtype of FP8 parts (not a GGML type id)


def _rows_in_order(parts: list[QuantPart], order: torch.Tensor) -> list[QuantPart]:
    """The parts' rows in `order`, as plain_matrix[order], in the file's row layout: whole
    rows move (a GGUF row's blocks, an FP8 row with its own scales), each within its part (an
    order that moves a row into a part of another block type is refused)."""
    moved = []
    for p in parts:
        local = order[p.offset:p.offset + p.rows] - p.offset
        if local.numel() != p.rows or local.min() < 0 or local.max() >= p.rows:
            raise ValueError("a row order moves rows between parts of different block types")
        moved.append(QuantPart(p.file_rows()[local].contiguous(), p.qtype, p.offset, p.scale,
                               None if p.scale_row is None else p.scale_row[local].contiguous()))
    return moved


class QuantLinear:
    """F.linear(x, W, bias) with W held as GGUF blocks: decode (at most max_rows rows) on the
    quantized GEMM, prefill on a per-call dequantized copy (see the module's docstring). A
    layer's stacked matrices (q/k/v, gate/up) may mix block types: one part per type run."""

    def __init__(self, parts: list[QuantPart], in_features: int, bias: torch.Tensor | None,
                 isa: str, max_rows: int, int8: str | None = None):
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)
        self.bias = None if bias is None else bias.float().contiguous()
        self.isa = isa
        self.max_rows = max_rows
        # The integer path decode takes (GGUF blocks only), or None: the float path.
        self.int8 = None if isa == "torch" or any(p.scale is not None for p in parts) else int8
        # Prefill runs the integer path up to this many rows (int8_prefills); None: the
        # compute dtype's INT8_PREFILL_MAX_ROWS.
        self.int8_prefill_max_rows: int | None = None

    @classmethod
    def from_parts(cls, blocks: list[tuple[np.ndarray | torch.Tensor, int]], in_features: int,
                   bias: torch.Tensor | None = None, max_rows: int = 32,
                   disable: tuple[str, ...] = (), order: torch.Tensor | None = None
                   ) -> QuantLinear:
        """blocks: (uint8 [rows, row_bytes], ggml type) per stacked matrix, in output order;
        neighbours of one type are joined into one part (one kernel call). order: the
        stacked rows in this order (as take_rows), moved before the 16-row layout is
        written, so no layout of the old order is ever made."""
        parts, offset = [], 0
        for raw, qtype in blocks:
            if not supports(qtype, in_features):
                raise ValueError(f"{type_name(qtype)} blocks of {in_features} columns cannot "
                                 "stay quantized")
            raw = torch.as_tensor(np.ascontiguousarray(raw), dtype=torch.uint8)
            if raw.dim() != 2 or raw.shape[1] != row_bytes(qtype, in_features):
                raise ValueError(f"{type_name(qtype)} rows of {in_features} weights are "
                                 f"{row_bytes(qtype, in_features)} bytes, got {list(raw.shape)}")
            if parts and parts[-1].qtype == qtype:
                parts[-1].raw = torch.cat([parts[-1].raw, raw])
            else:
                parts.append(QuantPart(raw.clone() if not raw.is_contiguous() else raw, qtype,
                                       offset))
            offset += raw.shape[0]
        if order is not None:
            parts = _rows_in_order(parts, order)
        int8 = choose_int8(disable)[0]
        if rows16_usable(int8, disable):
            parts = [p.as_rows16() if rows16_supported(p.qtype) else p for p in parts]
        return cls(parts, in_features, bias, choose_isa(disable)[0], max_rows, int8)

    @classmethod
    def from_fp8(cls, matrices: list[tuple[torch.Tensor, torch.Tensor]], in_features: int,
                 bias: torch.Tensor | None = None, max_rows: int = 32,
                 disable: tuple[str, ...] = (), order: torch.Tensor | None = None
                 ) -> QuantLinear:
        """matrices: (float8_e4m3fn or uint8 codes [n, K], float32 scales [ceil(n / 128),
        ceil(K / 128)]) per stacked matrix, in output order (kernels.fp8_blocks): one part,
        the grids stacked and every row pointed at its own grid's row; order: as
        from_parts'."""
        codes, grids, rows_of, grid_rows = [], [], [], 0
        for w, scale in matrices:
            if w.dim() != 2 or w.shape[1] != in_features \
                    or w.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise ValueError(f"FP8 weights: expected float8_e4m3fn [n, {in_features}], got "
                                 f"{w.dtype} {list(w.shape)}")
            grid = fp8_blocks.grid_shape(w.shape[0], in_features)
            if tuple(scale.shape) != grid:
                raise ValueError(f"FP8 scales of a {list(w.shape)} weight in 128 x 128 blocks: "
                                 f"expected {list(grid)}, got {list(scale.shape)}")
            codes.append(w.contiguous().view(torch.uint8))
            grids.append(scale.float())
            rows_of.append(torch.arange(w.shape[0], dtype=torch.int32) // fp8_blocks.BLOCK
                           + grid_rows)
            grid_rows += grid[0]
        parts = [QuantPart(torch.cat(codes), FP8_TYPE, 0, torch.cat(grids).contiguous(),
                           torch.cat(rows_of))]
        if order is not None:
            parts = _rows_in_order(parts, order)
        return cls(parts, in_features, bias, choose_isa(disable, fp8=True)[0], max_rows)

    @property
    def nbytes(self) -> int:
        return sum(p.raw.numel() + (0 if p.scale is None else p.scale.nbytes + p.scale_row.nbytes)
                   for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features), as the plain matrix's."""
        return self.out_features, self.in_features

    @property
    def types(self) -> str:
        return "+".join(p.type_name for p in self.parts)

    @property
    def decode_path(self) -> str:
        """What decode runs on, for the start-up log."""
        if self.int8:
            layout = ", 16-row layout" if any(p.rows16 for p in self.parts) else ""
            return f"int8 activations x blocks, integer dot products on {self.int8}{layout}"
        if any(p.scale is not None for p in self.parts):
            return f"FP8 weights widened to float32 on {self.isa}"
        return f"blocks dequantized to float32 on {self.isa}"

    def take_rows(self, order: torch.Tensor) -> QuantLinear:
        """The layer with its output rows in `order`, as plain_matrix[order] (_rows_in_order);
        the bias must not be set yet. A part in the 16-row layout is laid out anew, and the
        old layout's bytes stay resident while anything else lives in its shared mapping
        (kernels/huge_pages.py): at load, reorder through from_parts' `order` instead."""
        if self.bias is not None:
            raise ValueError("take_rows: only a layer without a bias can reorder its rows")
        parts = [moved.as_rows16() if p.rows16 else moved
                 for p, moved in zip(self.parts, _rows_in_order(self.parts, order))]
        out = QuantLinear(parts, self.in_features, None, self.isa, self.max_rows, self.int8)
        out.int8_prefill_max_rows = self.int8_prefill_max_rows
        return out

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode: x [M, K] float32 or bf16 -> out [M, N] (x's dtype unless out is given)."""
        x, out = call_operands(x, out, self.in_features, self.out_features)
        if self.isa == "torch":
            return out.copy_(self.torch_decode(x))
        for call in self._gemm_calls(x, out):
            self._run(call)
        return out

    def bind(self, x: torch.Tensor, out: torch.Tensor) -> BoundQuantLinear:
        """x [M, K] -> out [M, N] with prebuilt kernel arguments (as PackedLinear.bind: x and
        out must keep their storage while the bound call is used)."""
        for name, t, width in (("x", x, self.in_features), ("out", out, self.out_features)):
            if t.dim() != 2 or t.shape != (x.shape[0], width) or t.dtype not in _CODE \
                    or (width > 1 and t.stride(1) != 1):
                raise ValueError(f"bind: {name}: expected contiguous rows [M, {width}] of "
                                 f"float32 or bfloat16, got {t.dtype} {list(t.shape)}")
        calls = None if self.isa == "torch" else self._gemm_calls(x, out)
        return BoundQuantLinear(self, x, out, calls)

    def _gemm_calls(self, x: torch.Tensor, out: torch.Tensor) -> list[functools.partial]:
        """One pf_qg_gemm per part, writing its columns of out."""
        calls = []
        for p in self.parts:
            bias = None if self.bias is None else self.bias[p.offset:].data_ptr()
            if p.scale is not None:
                calls.append(functools.partial(
                    _EXT.module.pf_qg_fp8_gemm, _ISA_CODE[self.isa], x.data_ptr(),
                    _CODE[x.dtype], x.stride(0), p.raw.data_ptr(), p.scale.data_ptr(),
                    p.scale_row.data_ptr(), p.scale.shape[1], bias,
                    out.data_ptr() + p.offset * out.element_size(), _CODE[out.dtype],
                    out.stride(0), x.shape[0], p.rows, self.in_features))
                continue
            gemm, path = ((_EXT.module.pf_qg_int8_gemm, _INT8_CODE[self.int8]) if self.int8
                          else (_EXT.module.pf_qg_gemm, _ISA_CODE[self.isa]))
            if p.rows16:
                gemm = _EXT.module.pf_qg_int8_rows16_gemm
            calls.append(functools.partial(
                gemm, path, x.data_ptr(), _CODE[x.dtype], x.stride(0),
                p.raw.data_ptr(), p.qtype, p.raw.shape[1], bias,
                out.data_ptr() + p.offset * out.element_size(), _CODE[out.dtype], out.stride(0),
                x.shape[0], p.rows, self.in_features))
        return calls

    def _run(self, call) -> None:
        rc = call()
        if rc:
            self._failed(rc)

    def _failed(self, rc: int):
        raise RuntimeError(f"pipefill quantized GEMM ({self.int8 or self.isa}, "
                           f"{self.types}) failed (rc={rc})")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in dtype (float32 or bf16): the file's weights exactly (float32), or
        rounded to nearest even (bf16)."""
        w = torch.empty(self.out_features, self.in_features, dtype=dtype)
        for p in self.parts:
            rows = w[p.offset:p.offset + p.rows]
            if self.isa == "torch" or dtype not in _CODE:
                rows.copy_(_torch_dequantize(p))
            else:
                self._dequantize_into(p, rows)
        return w

    def _dequantize_into(self, p: QuantPart, out: torch.Tensor, first: int = 0) -> None:
        """Rows [first, first + len(out)) of part p dequantized by the kernel into out
        (float32 or bf16 rows); in the 16-row layout `first` starts a group."""
        n, code, row_bytes = out.shape[0], _CODE[out.dtype], p.raw.shape[1]
        raw = p.raw.data_ptr() + first * row_bytes
        if p.scale is not None:
            rc = _EXT.module.pf_qg_fp8_dequant(
                _ISA_CODE[self.isa], raw, p.scale.data_ptr(),
                p.scale_row.data_ptr() + first * p.scale_row.element_size(), p.scale.shape[1],
                n, self.in_features, out.data_ptr(), code, out.stride(0))
        else:
            rc = _EXT.module.pf_qg_dequant(_ISA_CODE[self.isa], raw, p.qtype, row_bytes, n,
                                           self.in_features, out.data_ptr(), code,
                                           out.stride(0), bool(p.rows16))
        if rc:
            raise RuntimeError(f"pipefill dequantize ({self.types}) failed (rc={rc})")

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the plain matrix, dequantized as dequantize(dtype) gives them, from
        their own blocks only: an embedding lookup ([*ids.shape, in_features]). A layer of
        one part (one matrix of one block type), as an embedding is."""
        if len(self.parts) != 1:
            raise ValueError("rows: only a layer of one part (one block type) looks rows up")
        p, flat = self.parts[0], ids.reshape(-1).long()
        if p.rows16 and len(flat) <= GROUP_LOOKUP_ROWS and self.isa != "torch" \
                and dtype in _CODE:
            return self._rows_by_group(p, flat, dtype).reshape(*ids.shape, self.in_features)
        raw = rows16_take(p.raw, p.qtype, flat) if p.rows16 else p.raw.index_select(0, flat)
        picked = QuantPart(raw, p.qtype, 0, p.scale,
                           None if p.scale_row is None else p.scale_row.index_select(0, flat))
        one = QuantLinear([picked], self.in_features, None, self.isa, 0, self.int8)
        return one.dequantize(dtype).reshape(*ids.shape, self.in_features)

    def _rows_by_group(self, p: QuantPart, flat: torch.Tensor, dtype: torch.dtype
                       ) -> torch.Tensor:
        """rows() of a few ids in the 16-row layout: each id's group of 16 rows dequantized
        by the kernel (the same values dequantize gives its row), one C call an id, where
        gathering the fields took a dozen torch calls a step (a decode step looks up one)."""
        out = torch.empty(len(flat), self.in_features, dtype=dtype)
        group = torch.empty(ROWS16, self.in_features, dtype=dtype)
        for i, row in enumerate(flat.tolist()):
            if not 0 <= row < p.rows16:
                raise IndexError(f"rows: id {row} is out of range for {p.rows16} rows")
            self._dequantize_into(p, group, first=row // ROWS16 * ROWS16)
            out[i] = group[row % ROWS16]
        return out

    def torch_decode(self, x: torch.Tensor) -> torch.Tensor:
        """The kernels' arithmetic on torch: float32 weights and activations, float32 sums."""
        return F.linear(x.float(), self.dequantize(torch.float32), self.bias)

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """Any number of rows, on the path int8_prefills picks for its row count."""
        return self.prefill_for(x.shape[0], x.dtype)(x)

    def prefill_for(self, rows: int, dtype: torch.dtype):
        """What prefill runs on `rows` rows of `dtype`, as a function that a caller cutting
        those rows into pieces calls on each: the integer path, or F.linear on one
        dequantized copy that the function holds (dequantized once for all the pieces)."""
        if self.int8_prefills(rows, dtype):
            return self.prefill_int8
        w = self.dequantize(dtype)
        bias = self.bias.to(dtype) if self.bias is not None else None
        return lambda x: torch_linear(x, w, bias)

    def int8_prefill_rows(self, dtype: torch.dtype) -> int:
        """The most rows prefill in `dtype` runs on the integer path (0: none)."""
        if self.int8 is None:
            return 0
        if self.int8_prefill_max_rows is not None:
            return self.int8_prefill_max_rows
        return INT8_PREFILL_MAX_ROWS.get(dtype, 0)

    def int8_prefills(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether prefill of `rows` rows in `dtype` runs the integer path: where it is the
        decode path and rows <= int8_prefill_rows(dtype) (INT8_PREFILL_MAX_ROWS by default)."""
        return rows <= self.int8_prefill_rows(dtype)

    def prefill_rule(self, dtype: torch.dtype) -> str:
        """What prefill in `dtype` runs on and why, for the start-up log."""
        limit = self.int8_prefill_rows(dtype)
        if self.int8 is None:
            return "dequantizes each matrix per call (no integer path)"
        if limit <= self.max_rows:
            return "dequantizes each matrix per call (the integer prefill is turned off)"
        why = (INT8_PREFILL_WHY.get(dtype, "") if self.int8_prefill_max_rows is None
               else "--gguf-int8-prefill-max-rows")
        rows = "any number of rows" if limit >= 1 << 62 else f"up to {limit} rows"
        return (f"runs the integer path on {rows} ({why})"
                + ("" if limit >= 1 << 62 else ", dequantizes each matrix per call above"))

    def prefill_int8(self, x: torch.Tensor) -> torch.Tensor:
        """Any number of rows on the decode GEMM's integer path (x's rows quantized to int8)."""
        return self(x)

    def prefill_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """Any number of rows: F.linear on this call's dequantized copy (freed on return)."""
        return torch_linear(x, self.dequantize(x.dtype), self.bias.to(x.dtype)
                            if self.bias is not None else None)


def _torch_dequantize(p: QuantPart) -> torch.Tensor:
    """A part's float32 weights without the kernels (the torch path, where none builds): FP8
    by kernels.fp8_blocks (the codes 0x7f/0xff are NaN here, +-480 on the kernel paths), GGUF
    blocks by the gguf package."""
    if p.scale is not None:
        return fp8_blocks.dequantize(p.raw, p.scale, grid_rows=p.scale_row.long())
    import gguf  # imported here, as model.gguf_file does: only GGUF users pay for it
    return torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(p.file_rows().numpy(), gguf.GGMLQuantizationType(p.qtype)),
        dtype=np.float32))


@dataclass(slots=True, eq=False)
class BoundQuantLinear:
    """QuantLinear.bind's result: ``bound()`` computes linear(x) into out and returns out."""
    linear: QuantLinear
    x: torch.Tensor  # held so that the pointers in calls stay valid
    out: torch.Tensor
    calls: list | None  # None: the torch path

    def __call__(self) -> torch.Tensor:
        if self.calls is None:
            return self.out.copy_(self.linear.torch_decode(self.x))
        for call in self.calls:  # the GEMM calls straight (a bound call runs ~120 times a step)
            rc = call()
            if rc:
                self.linear._failed(rc)
        return self.out


__all__ = ["BLOCK_TYPES", "INT8_PATHS", "QuantLinear", "QuantPart", "choose_int8", "choose_isa",
           "hidden_int8_paths", "int8_status", "isa_status", "quantize_activations",
           "read_bandwidth", "stream_read"]
