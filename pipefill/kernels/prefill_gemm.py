"""Prefill-sized (large-M) linear layers on oneDNN, with weights reordered once at load time.

torch's float32 F.linear goes to MKL's sgemm, which on AMD CPUs takes a generic code path: on
a Zen 4 it runs 2,048-row prefill GEMMs of the default model at 0.12-0.14 TFLOP/s on 2 cores,
where oneDNN (its own JIT kernels, chosen from cpuid whatever the vendor) reaches 0.19-0.21,
and 0.15 against MKL's 0.13 with both capped at AVX2. oneDNN wants the weight in its blocked
layout; reordering it per call would cost as much as the GEMM, so it is done once and the
plain [N, K] matrix is dropped: the stage holds one prefill copy, not two.

bfloat16 F.linear already runs on oneDNN, so auto leaves it on torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipefill.base.platform import dtype_name

CHOICES = ("auto", "torch", "onednn")
# oneDNN builds (JIT) and keeps a primitive per row count, ~0.7 MiB each that stays resident:
# a server whose steps have ever-new row counts grew ~4 MiB a minute. Row counts are rounded
# up to this grain (zero rows added, dropped from the output), so a stage meets at most
# max rows / ROW_GRAIN of them per weight shape; chunk sizes are multiples of it already.
# Up to SMALL_ROWS rows the grain is finer: an expert of a mixture-of-experts layer gets
# ~128 rows of a chunk, a different count each time, and padding 129 rows to 192 cost up to
# 30% of its GEMMs' speed (measured on a Zen 4 at the qwen3-30b-a3b expert shapes); with the
# finer grain a shape meets at most SMALL_ROWS / SMALL_ROW_GRAIN more primitives.
# torch's bfloat16 F.linear on CPU is oneDNN too and gets the same treatment (in_row_grains).
ROW_GRAIN = 64
SMALL_ROW_GRAIN, SMALL_ROWS = 16, 256
MKL_SLOW_VENDORS = ("AuthenticAMD", "HygonGenuine")  # cpuid vendor strings


def onednn_status() -> tuple[bool, str]:
    """(usable, why not): oneDNN in this torch build with the two ops this module calls."""
    if not torch.backends.mkldnn.is_available():
        return False, "this torch build has no oneDNN (mkldnn)"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False, "this torch build lacks mkldnn._reorder_linear_weight/_linear_pointwise"
    return True, ""


def choose_prefill_gemm(requested: str, dtype: torch.dtype, weight_dtype: torch.dtype,
                        device: torch.device, vendor: str) -> tuple[str, str]:
    """-> (torch | onednn, why). auto: onednn for float32 matrices on AMD (and Hygon) CPUs;
    elsewhere torch (MKL's sgemm serves Intel well and is what every earlier measurement on
    Intel used; other architectures are unmeasured). A named onednn that cannot run here is a
    ValueError with the reason."""
    if requested not in CHOICES:
        raise ValueError(f"--prefill-gemm {requested!r}: choose one of {', '.join(CHOICES)}")
    if requested == "torch":
        return "torch", "requested"
    why = _unfit(dtype, weight_dtype, device)
    if requested == "onednn":
        if why:
            raise ValueError(f"--prefill-gemm onednn is not available: {why}")
        return "onednn", "requested"
    if why:
        return "torch", why
    if dtype != torch.float32:
        return "torch", "bfloat16 F.linear already runs on oneDNN"
    if vendor not in MKL_SLOW_VENDORS:
        return "torch", f"MKL's sgemm on a {vendor or 'CPU of unknown vendor'}"
    return "onednn", f"float32 on an {vendor} CPU, where MKL's sgemm is slower"


def experts_in_onednn_layout(requested: str, dtype: torch.dtype, weight_dtype: torch.dtype,
                             device: torch.device) -> tuple[bool, str]:
    """(move a mixture-of-experts layer's experts into oneDNN's layout, why) where the dense
    matrices stay on torch: an expert gets tens to hundreds of rows of a chunk, a different
    count each time, and at those counts a bfloat16 GEMM on a weight reordered once ran at
    0.28-0.39 TFLOP/s against F.linear's 0.16-0.30 (16-96 rows, qwen3-30b-a3b expert shapes,
    Zen 4, 2 threads): F.linear reorders the weight for every call. `--prefill-gemm torch`
    keeps them plain."""
    if requested == "torch":
        return False, "requested"
    why = _unfit(dtype, weight_dtype, device)
    return (False, why) if why else (True, "few rows per expert")


def _unfit(dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"the stage runs on {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype_name(dtype)} (float32 and bfloat16 only)"
    if weight_dtype != dtype:
        return "the matrices are kept in a different dtype from the compute dtype"
    ok, why = onednn_status()
    return None if ok else why


@dataclass
class OneDnnLinear:
    """y = x @ W.T + b for any number of rows, W held in oneDNN's layout for `rows_hint` rows
    (other row counts run as fast: measured for 1..2,048 rows against a 2,048-row layout)."""
    weight: torch.Tensor  # opaque blocked layout: only oneDNN may read it
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    nbytes: int

    @classmethod
    def reorder(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                rows_hint: int) -> OneDnnLinear:
        n, k = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows_hint)
        return cls(packed, bias, n, k, weight.numel() * weight.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"linear expects {self.in_features} input features, got "
                             f"{x.shape[-1]}")
        return in_row_grains(self._compute, x)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias,
                                                  "none", [], "")


def padded_rows(rows: int) -> int:
    """The row count oneDNN sees for `rows` rows: the next multiple of SMALL_ROW_GRAIN up
    to SMALL_ROWS, of ROW_GRAIN above."""
    grain = SMALL_ROW_GRAIN if rows <= SMALL_ROWS else ROW_GRAIN
    return -(-rows // grain) * grain


def in_row_grains(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a row-wise fn of a 2-D x, called on x padded with zero rows to padded_rows."""
    rows = x.shape[0]
    if x.dim() != 2 or padded_rows(rows) == rows:
        return fn(x)
    return fn(torch.nn.functional.pad(x, (0, 0, 0, padded_rows(rows) - rows)))[:rows]


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear, with x's rows in grains where torch runs it on oneDNN (bfloat16 on CPU)."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return in_row_grains(lambda rows: torch.nn.functional.linear(rows, weight, bias), x)
    return torch.nn.functional.linear(x, weight, bias)
