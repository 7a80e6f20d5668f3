"""The decode step's lean path: every sequence adds one token after a cached prefix.

A decode step at batch 1 is ~300 small calls (9 per layer); in `StageModel._layer` each call
paid for Python argument checks, a fresh output tensor, slicing views and a profiler range, which
together cost about as much as streaming the weights (issue 14). Here the same kernels run in the
same order on the same inputs (so the results are bit-identical to `_layer`), but:

* the per-row buffers of a step with M rows (normed x, qkv, attention out, o_proj, gate_up, the
  SiLU product, the down projection) are allocated once per M and reused by every layer and every
  step, with their q/k/v/per-sequence views built once;
* the fused elementwise ops are called straight through their C entry points with pointers taken
  once, since the buffers guarantee the shapes their wrappers check;
* the attention's profiler range is opened only while a profiler records.

Tensors that leave the stage (the residual stream, the last layer's output) are fresh each step:
a pipeline send of step s may still read them while step s + 1 runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeBuffers:
    """Reused activations of a decode step with `rows` sequences (compute dtype)."""
    rows: int
    x: torch.Tensor  # [M, hidden] normed input of a linear layer
    qkv: torch.Tensor  # [M, q + 2 kv]
    attn: torch.Tensor  # [M, Hq, D]
    o: torch.Tensor  # [M, hidden]
    gate_up: torch.Tensor  # [M, 2 I]
    act: torch.Tensor  # [M, I]
    down: torch.Tensor  # [M, hidden] output of every layer but the stage's last
    per_seq: list  # (q, k, v, out) views of row j


def _buffers(cfg, dtype: torch.dtype, rows: int) -> DecodeBuffers:
    def empty(*shape):
        return torch.empty(*shape, dtype=dtype)
    qkv = empty(rows, cfg.q_size + 2 * cfg.kv_size)
    attn = empty(rows, cfg.num_heads, cfg.head_dim)
    q = qkv[:, :cfg.q_size].view(rows, cfg.num_heads, cfg.head_dim)
    k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].view(rows, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, cfg.q_size + cfg.kv_size:].view(rows, cfg.num_kv_heads, cfg.head_dim)
    per_seq = [(q[j:j + 1], k[j:j + 1], v[j:j + 1], attn[j:j + 1]) for j in range(rows)]
    return DecodeBuffers(rows, empty(rows, cfg.hidden_size), qkv, attn,
                         empty(rows, cfg.hidden_size), empty(rows, 2 * cfg.intermediate_size),
                         empty(rows, cfg.intermediate_size), empty(rows, cfg.hidden_size),
                         per_seq)


class DecodeRunner:
    """Runs a StageModel's layers for decode steps that `fits` accepts."""

    def __init__(self, model):
        from pipefill.kernels import fused_ops
        self.model = model
        self.lib = fused_ops.unchecked_lib()
        self.code = fused_ops.dtype_code(model.dtype)
        self.buffers: dict[int, DecodeBuffers] = {}
        self._layer_caches = (None, None, [])  # (k_cache, v_cache, per-layer (k, v) views)

    @staticmethod
    def supports(model) -> bool:
        """The model's parts this path needs: fused ops, a vector attention kernel, no per-head
        q/k norms (Qwen3 keeps the general path)."""
        from pipefill.model.llama import FusedOps
        return (isinstance(model.ops, FusedOps) and hasattr(model.attention, "isa")
                and all(w.q_norm is None for w in model.w.layers))

    def fits(self, hidden: torch.Tensor, meta) -> bool:
        """A decode step whose linear layers all run the packed GEMM (the bench switches the
        packed copies off to time torch: that step takes the general path)."""
        layers = self.model.w.layers
        if not layers or layers[0].packed is None or hidden.dtype != self.model.dtype:
            return False
        if hidden.shape[0] > layers[0].packed["qkv"].max_rows or hidden.device.type != "cpu":
            return False
        return all(s.num_new == 1 and s.prefix_len > 0 for s in meta.seqs)

    def _caches(self, k_cache, v_cache):
        kc, vc, views = self._layer_caches
        if kc is not k_cache or vc is not v_cache:
            views = [(k_cache[i], v_cache[i]) for i in range(self.model.num_layers)]
            self._layer_caches = (k_cache, v_cache, views)
        return views

    def forward(self, hidden, residual, meta, cos, sin, k_cache, v_cache):
        rows = hidden.shape[0]
        buf = self.buffers.get(rows)
        if buf is None:
            buf = self.buffers[rows] = _buffers(self.model.cfg, self.model.dtype, rows)
        if residual is None:  # layer 0 of the model: the residual stream starts as the input
            residual = hidden.float()
            self._norm(residual, None, self.model.w.layers[0].input_norm, buf.x)
        else:
            self._norm(residual, hidden, self.model.w.layers[0].input_norm, buf.x)
        caches = self._caches(k_cache, v_cache)
        last = self.model.num_layers - 1
        for i, w in enumerate(self.model.w.layers):
            out = buf.down if i < last else torch.empty_like(buf.down)
            self._layer(w, buf, residual, meta.seqs, cos, sin, caches[i], out)
            if i < last:
                self._norm(residual, out, self.model.w.layers[i + 1].input_norm, buf.x)
            hidden = out
        return hidden, residual

    def _layer(self, w, buf: DecodeBuffers, residual, seqs, cos, sin, cache, out) -> None:
        """One layer from its normed input (buf.x) to `out`; the residual is updated in place."""
        cfg, packed, rows = self.model.cfg, w.packed, buf.rows
        packed["qkv"](buf.x, out=buf.qkv)
        self._rope(buf.qkv, rows, cos, sin)
        self._attend(buf, seqs, cache)
        packed["o_proj"](buf.attn.view(rows, cfg.q_size), out=buf.o)
        self._norm(residual, buf.o, w.post_norm, buf.x)
        packed["gate_up"](buf.x, out=buf.gate_up)
        self._silu_mul(buf.gate_up, buf.act)
        packed["down"](buf.act, out=out)

    def _attend(self, buf: DecodeBuffers, seqs, cache) -> None:
        k_cache, v_cache = cache
        attend, scale = self.model.attention, self.model.scale
        with attend.profiled():
            for seq, (q, k, v, out) in zip(seqs, buf.per_seq):
                attend.decode_one(q, k, v, k_cache, v_cache, seq, scale, out)

    # The fused kernels' C entry points; shapes and strides come from the buffers above.
    def _norm(self, residual, hidden, weight, out) -> None:
        rows, width = residual.shape
        if hidden is None:
            hptr, hcode, hstride = None, 0, 0
        else:
            hptr, hcode, hstride = hidden.data_ptr(), self.code, hidden.stride(0)
        rc = self.lib.pf_add_rms_norm(residual.data_ptr(), residual.stride(0), hptr, hcode,
                                      hstride, weight.data_ptr(), out.data_ptr(), self.code,
                                      out.stride(0), rows, width, self.model.cfg.rms_norm_eps)
        if rc:
            raise RuntimeError(f"pipefill fused add_rms_norm failed (rc={rc})")

    def _rope(self, qkv, rows, cos, sin) -> None:
        # q and k are adjacent columns of qkv: every q and k head rotates in one pass.
        cfg = self.model.cfg
        rc = self.lib.pf_rope(qkv.data_ptr(), self.code, qkv.stride(0), cfg.head_dim, rows,
                              cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, cos.data_ptr(),
                              sin.data_ptr())
        if rc:
            raise RuntimeError(f"pipefill fused rope failed (rc={rc})")

    def _silu_mul(self, gate_up, out) -> None:
        rc = self.lib.pf_silu_mul(gate_up.data_ptr(), self.code, gate_up.stride(0),
                                  out.data_ptr(), out.stride(0), gate_up.shape[0],
                                  out.shape[1])
        if rc:
            raise RuntimeError(f"pipefill fused silu_mul failed (rc={rc})")
