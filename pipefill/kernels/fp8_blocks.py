"""FP8 block-quantized weights as DeepSeek-V3 and the -FP8 Qwen3 releases ship them, which the
quantized decode GEMM (kernels.quant_gemm) reads as they are.

A linear layer's `weight` [N, K] is float8 e4m3fn (1 sign, 4 exponent bits biased by 7, 3
mantissa bits, subnormals, no infinities, largest finite 448), and its `weight_scale_inv` is
float32 [ceil(N / 128), ceil(K / 128)]: one scale per 128 x 128 block, the last blocks partial
where N or K is not a multiple of 128. Weight (n, k) is fp8(n, k) x scale[n // 128, k // 128],
rounded once to float32 (torch's ``weight.to(float32) * scale``), which `dequantize` computes.
config.json says so in `quantization_config` (QUANT_CONFIG: what pipefill reads).

`quantize` writes this layout from float weights (bench make-model and the tests): each
block's largest magnitude maps to 448, codes rounded to nearest even.
"""
from __future__ import annotations

import torch

BLOCK = 128  # weights per scale block, along rows and along columns
FP8_MAX = 448.0  # e4m3fn's largest finite value
NAME = "FP8_E4M3"  # in log lines, beside GGUF's type names
# The quantization_config DeepSeek-V3 and the -FP8 Qwen3 releases write (keys pipefill checks).
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}
# Keys that may stand beside them: which modules the quantizer left alone (a weight without a
# scale is read as a plain matrix whatever this says).
INFORMATIONAL_KEYS = ("modules_to_not_convert", "ignored_layers")
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"


def grid_shape(rows: int, cols: int) -> tuple[int, int]:
    """The scale grid of a [rows, cols] weight."""
    return -(-rows // BLOCK), -(-cols // BLOCK)


def expand(scale: torch.Tensor, cols: int, grid_rows: torch.Tensor) -> torch.Tensor:
    """Each weight's scale, [len(grid_rows), cols] float32: row i's from grid row
    grid_rows[i]."""
    return scale[grid_rows].repeat_interleave(BLOCK, dim=1)[:, :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, first_row: int = 0,
               grid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [rows, K]: e4m3 codes (float8_e4m3fn, or their bytes as uint8) times their block
    scales. The rows are those from `first_row` on of the matrix the grid scales, or each row's
    grid row is given (`grid_rows`: a stacked or reordered matrix's)."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    if grid_rows is None:
        grid_rows = torch.arange(first_row, first_row + weight.shape[0]) // BLOCK
    return weight.float() * expand(scale.float(), weight.shape[1], grid_rows)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8_e4m3fn [N, K], float32 scales [ceil(N/128), ceil(K/128)]): each
    block scaled so that its largest magnitude is 448 (an all-zero block gets scale 1)."""
    n, k = w.shape
    gn, gk = grid_shape(n, k)
    padded = torch.zeros(gn * BLOCK, gk * BLOCK, dtype=torch.float32)
    padded[:n, :k] = w.float()
    amax = padded.view(gn, BLOCK, gk, BLOCK).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w.float() / expand(scale, k, torch.arange(n) // BLOCK)).clamp(-FP8_MAX, FP8_MAX)
    return codes.to(torch.float8_e4m3fn), scale
