"""Gemma 3's decode step on the lean path (model/decode_step.py; ARCHITECTURE.md, 'Model
families').

The Llama family's runner with Gemma's layer: the same reused buffers per batch size, GEMMs
bound once, fused ops called through their C entry points, and one attention kernel call per
layer for every sequence of the step; what Gemma adds, each one C call a layer:

* q and k normed per head and rotated in place in the qkv buffer (pf_qk_norm_rope), the local
  layers with their own rope base (the tables computed once a step);
* the attention over a local layer's window, from the window layers' own pages (the window
  tables packed once a step, as the global ones);
* the post-norm of the attention's output, the residual add and the pre-MLP norm in one pass
  (pf_norm_add_rms_norm), and so the post-MLP norm, the add and the next layer's input norm;
* GeGLU (pf_gelu_tanh_mul).

layer_forward runs the same kernels in the same order on the same values (the sandwich and
the q/k entry points are, row by row, its separate norm, add and rope kernels), so a step's
bits do not depend on the path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipefill.model.attention import VectorAttention
from pipefill.model.decode_step import DecodeBuffers, DecodeRunner
from pipefill.model.layers import FusedOps
from pipefill.model.rope import cos_sin


@dataclass
class GemmaLayerCalls:
    """One Gemma layer's GEMMs and fused-op arguments for one batch size."""
    packed: dict  # the layer's packed copies (the bench swaps them out to time torch)
    qkv: object  # kernels.decode_gemm.BoundLinear (or QuantLinear's): buf.x -> buf.qkv
    o_proj: object  # buf.attn2d -> buf.o
    gate_up: object  # buf.x -> buf.gate_up
    down: object  # buf.act -> buf.down; the stage's last layer: the linear itself (a fresh
    # output every step: it leaves the stage)
    qk_norm: tuple  # pf_qk_norm_rope's arguments but cos and sin
    post_attn: tuple  # pf_norm_add_rms_norm's after the residual: buf.o post-normed, added,
    # pre-MLP normed into buf.x
    next_norm: tuple | None  # the same over buf.down with the post-MLP norm and the next
    # layer's input norm; None: the stage's last layer
    post_mlp: torch.Tensor  # the post-MLP norm's weight (the last layer's output takes it)
    window: int  # the layer's sliding window; 0: global


class GemmaDecodeRunner(DecodeRunner):
    """Runs a Gemma 3 StageModel's layers for decode steps that `fits` accepts."""

    def __init__(self, model):
        super().__init__(model)
        # The kernel takes no window with a straddled head's key split: every layer attends
        # whole (a TP rank's unequal query groups go through q_first as on the general path).
        self.shared = None

    @staticmethod
    def supports(model) -> bool:
        """Fused ops and a vector attention kernel (which bounds windows)."""
        return isinstance(model.ops, FusedOps) and isinstance(model.attention, VectorAttention)

    def forward(self, hidden, residual, meta, cos, sin, k_cache, v_cache):
        buf = self._step_buffers(hidden.shape[0])
        residual = self._first_norm(hidden, residual, buf)
        res = (residual.data_ptr(), residual.stride(0))
        # `local` holds the local rope tables whose addresses `steps` passes: alive to the end.
        steps, local = self._steps(buf, meta, cos, sin)
        for calls, cache in zip(buf.calls, self._caches(k_cache, v_cache)):
            out = buf.down if calls.next_norm is not None else torch.empty_like(buf.down)
            self._gemma_layer(calls, buf, res, steps[calls.window > 0], cache, out)
        del local
        return out, residual

    def _steps(self, buf: DecodeBuffers, meta, cos, sin):
        """Per kind of layer (global, local): its rope tables' pointers and its attention
        tables, once a step; and the tensors behind the pointers, to keep until the step
        ends."""
        attend, model = self.model.attention, self.model
        whole = ((cos.data_ptr(), sin.data_ptr()), attend.decode_tables(meta.seqs))
        if not any(c.window for c in buf.calls):
            return (whole, whole), ()
        local = (cos, sin) if model.local_inv_freq is None else cos_sin(meta.positions,
                                                                         model.local_inv_freq)
        # The window layers' own pages where the stage keeps them apart ('Window pages').
        tables = (whole[1] if meta.window_seqs is None
                  else attend.decode_tables(meta.window_seqs))
        windowed = ((local[0].data_ptr(), local[1].data_ptr()), tables)
        return (whole, windowed), local

    def _gemma_layer(self, calls: GemmaLayerCalls, buf: DecodeBuffers, res, step, cache,
                     out) -> None:
        """One layer from its normed input (buf.x) to `out` post-normed, the residual updated
        in place; where another layer follows, its normed input in buf.x."""
        lib, model = self.lib, self.model
        rope, tables = step
        calls.qkv()
        self._check(lib.pf_qk_norm_rope(*calls.qk_norm, *rope), "qk_norm_rope")
        with model.attention.profiled():
            model.attention.decode_batch(*buf.qkv_heads, *cache, tables, model.scale, buf.attn,
                                         window=calls.window)
        calls.o_proj()
        o_sum, down_sum = buf.tp_sums  # tensor parallelism: the ranks' sums, before the norms
        if o_sum is not None:
            o_sum()
        self._check(lib.pf_norm_add_rms_norm(*res, *calls.post_attn), "norm_add_rms_norm")
        calls.gate_up()
        self._check(lib.pf_gelu_tanh_mul(*buf.silu), "gelu_tanh_mul")
        if calls.next_norm is not None:
            calls.down()  # into buf.down (= out)
            if down_sum is not None:
                down_sum()
            self._check(lib.pf_norm_add_rms_norm(*res, *calls.next_norm), "norm_add_rms_norm")
            return
        calls.down(buf.act, out=out)
        model.tp_sum(out)
        self._check(lib.pf_rms_norm(out.data_ptr(), self.code, out.stride(0),
                                    calls.post_mlp.data_ptr(), out.data_ptr(), self.code,
                                    out.stride(0), buf.rows, model.cfg.hidden_size,
                                    model.cfg.rms_norm_eps), "rms_norm")

    def _calls(self, buf: DecodeBuffers) -> list[GemmaLayerCalls]:
        """Every layer's GEMMs bound to buf and its fused-op arguments (pointers taken once)."""
        cfg, code, layers = self.model.cfg, self.code, self.model.w.layers
        eps = cfg.rms_norm_eps

        def sandwich(hidden, post, pre):  # pf_norm_add_rms_norm's after the residual
            return (hidden.data_ptr(), code, hidden.stride(0), post.data_ptr(), pre.data_ptr(),
                    buf.x.data_ptr(), code, buf.x.stride(0), buf.rows, cfg.hidden_size, eps)
        qk = (buf.qkv.data_ptr(), code, buf.qkv.stride(0), cfg.head_dim, buf.rows,
              cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        calls = []
        for i, w in enumerate(layers):
            last = i + 1 == len(layers)
            p = w.packed
            calls.append(GemmaLayerCalls(
                p, p["qkv"].bind(buf.x, buf.qkv), p["o_proj"].bind(buf.attn2d, buf.o),
                p["gate_up"].bind(buf.x, buf.gate_up),
                p["down"] if last else p["down"].bind(buf.act, buf.down),
                qk + (w.q_norm.data_ptr(), w.k_norm.data_ptr(), eps),
                sandwich(buf.o, w.post_attn_norm, w.pre_mlp_norm),
                None if last else sandwich(buf.down, w.post_mlp_norm, layers[i + 1].input_norm),
                w.post_mlp_norm, cfg.window_of(w.layer) or 0))
        return calls
