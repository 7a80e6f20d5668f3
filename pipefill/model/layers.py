"""The building blocks every family's layer is made of: linear layers on the GEMM a row count
picks, RMSNorm, and the elementwise steps (torch or the fused kernels)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipefill.kernels.prefill_gemm import torch_linear
from pipefill.model.config import ModelConfig
from pipefill.model.rope import apply_rope_


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias=None, packed=None,
           large=None) -> torch.Tensor:
    """Decode-sized x (at most packed.max_rows rows) runs the packed small-M GEMM, which reads
    every weight once for all rows (torch's matmul slows down at M = 4..16); larger x runs
    `large` (a oneDNN-layout copy, which holds the bias too) where there is one, else
    F.linear (oneDNN for bfloat16 on CPU: rows padded as for `large`, see prefill_gemm)."""
    if packed is not None and x.shape[0] <= packed.max_rows:
        return packed(x)
    if large is not None:
        return large(x)
    return torch_linear(x, weight, bias)


# A long chunk's MLP runs this many rows at a time (about: row_tiles evens the tiles), so its
# gate/up projection and their product are live for one tile only (ARCHITECTURE.md 'What a
# stage's memory is made of'). Tiles of at least half this stay above the integer prefill's
# rows, on the path the whole chunk would take.
MLP_TILE_ROWS = 2048


def row_tiles(rows: int, tile: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering `rows` in ceil(rows / tile) tiles of even size (sizes
    differ by at most 1; each at least tile / 2 rows where rows > tile)."""
    count = max(1, -(-rows // tile))
    return [(i * rows // count, (i + 1) * rows // count) for i in range(count)]


def by_row_tiles(fn, x: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """fn(x) for a row-wise fn, computed over row tiles of x (row_tiles; tile: MLP_TILE_ROWS
    by default) into one output, so fn's intermediates are live for a tile at a time; fn(x)
    itself where x fits one tile."""
    tile = MLP_TILE_ROWS if tile is None else tile
    if x.shape[0] <= tile:
        return fn(x)
    out = None
    for start, end in row_tiles(x.shape[0], tile):
        y = fn(x[start:end])
        if out is None:
            out = y.new_empty((x.shape[0], *y.shape[1:]))
        out[start:end] = y
        del y
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype):
    """Normalises in float32 (as HF does) and returns the compute dtype. The same operations
    as F.rms_norm, bit for bit, in fewer passes: torch 2.13's CPU rms_norm took 67 ms for a
    2,048-token chunk's per-head q norm of 32 heads of 128, this 29 ms."""
    x = x.to(torch.float32, copy=True)  # normalised in place below: never the caller's
    scale = x.square().mean(-1, keepdim=True).add_(eps).rsqrt_()
    return x.mul_(scale).mul_(weight).to(dtype)


class TorchOps:
    """The elementwise steps of a layer in plain torch (any CPU, any device)."""

    @staticmethod
    def add_rms_norm(residual, hidden, weight, eps, dtype):
        """residual += hidden (in place; None: residual is hidden.float()); -> normed."""
        residual = hidden.float() if residual is None else residual.add_(hidden)
        return rms_norm(residual, weight, eps, dtype), residual

    @staticmethod
    def rope_(x, cos, sin):
        apply_rope_(x, cos.to(x.dtype), sin.to(x.dtype))

    @staticmethod
    def silu_mul(gate_up):
        inter = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])

    # Gemma's steps (families/gemma3.py).
    @staticmethod
    def rms_norm(x, weight, eps, dtype):
        return rms_norm(x, weight, eps, dtype)

    @staticmethod
    def qk_norm_rope_(qk, num_q_heads, q_weight, k_weight, eps, cos, sin):
        """Per-head RMSNorm of q's heads (the first num_q_heads of qk [T, N, D]) and k's, in
        place, then rope over both."""
        q, k = qk[:, :num_q_heads], qk[:, num_q_heads:]
        q.copy_(rms_norm(q, q_weight, eps, qk.dtype))
        k.copy_(rms_norm(k, k_weight, eps, qk.dtype))
        TorchOps.rope_(qk, cos, sin)

    @staticmethod
    def gelu_mul(gate_up):
        inter = gate_up.shape[-1] // 2
        return F.gelu(gate_up[:, :inter], approximate="tanh").mul_(gate_up[:, inter:])


class FusedOps:
    """The same steps as one pass each (pipefill.kernels.fused_ops, AVX-512)."""

    def __init__(self):
        # Imported on use: the module brings the kernel build (torch.utils.cpp_extension).
        from pipefill.kernels import fused_ops
        self.k = fused_ops

    def add_rms_norm(self, residual, hidden, weight, eps, dtype):
        if residual is None:
            residual = hidden.float()
            return self.k.add_rms_norm(residual, None, weight, eps, dtype=dtype), residual
        return self.k.add_rms_norm(residual, hidden, weight, eps), residual

    def rope_(self, x, cos, sin):
        self.k.rope_(x, cos, sin)

    def silu_mul(self, gate_up):
        return self.k.silu_mul(gate_up)

    def rms_norm(self, x, weight, eps, dtype):
        assert x.dtype == dtype, (x.dtype, dtype)
        return self.k.rms_norm(x, weight, eps)

    def qk_norm_rope_(self, qk, num_q_heads, q_weight, k_weight, eps, cos, sin):
        self.k.qk_norm_rope_(qk, num_q_heads, q_weight, k_weight, eps, cos, sin)

    def gelu_mul(self, gate_up):
        return self.k.gelu_tanh_mul(gate_up)


def elementwise_ops(cfg: ModelConfig, device: torch.device,
                    dtype: torch.dtype = torch.float32, flags: frozenset[str] | None = None):
    """Fused kernels where the CPU, the dtype and the shapes allow, else torch. The kernels
    take float32 and bfloat16 only: float16 stays on torch. `flags`: the CPU flags to trust
    (--hide-cpu-flags removed), so a hidden capability is never executed."""
    widths = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim)
    fits = dtype in (torch.float32, torch.bfloat16) and all(w % 16 == 0 for w in widths)
    if device.type == "cpu" and fits:
        # Imported on use, as in FusedOps.
        from pipefill.kernels.fused_ops import fused_available
        if fused_available(flags=flags)[0]:
            return FusedOps()
    return TorchOps()
