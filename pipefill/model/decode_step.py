"""The decode step's lean path: every sequence adds one token after a cached prefix.

A decode step at batch 1 is ~300 small calls (9 per layer); in the Llama family's
`layer_forward` (model/families/llama.py) each call paid for Python argument checks, a fresh
output tensor, slicing views and a profiler range, which together cost about as much as
streaming the weights. Here the same kernels run in the same order on the same inputs (so the results are bit-identical to `layer_forward`), but:

* the per-row buffers of a step with M rows (normed x, qkv, attention out, o_proj, gate_up, the
  SiLU product, the down projection) are allocated once per M and reused by every layer and every
  step, with their q/k/v views built once;
* the attention is one kernel call per layer for all sequences (each one's KV write and
  attention; the page tables and lengths are packed once per step for all layers);
* the fused elementwise ops are called straight through their C entry points with pointers taken
  once, since the buffers guarantee the shapes their wrappers check;
* each GEMM whose input and output are such buffers is bound to them once per M
  (`PackedLinear.bind`: checked once, then one C call with prebuilt arguments);
* the attention's profiler range is opened only while a profiler records.

A mixture-of-experts layer runs its sparse block (model/moe.py) on buf.x in place of the dense
MLP: its experts' GEMMs are the packed decode copies too, each chosen expert read once for all
rows of the step. Per-head q/k norms (Qwen3-MoE) are applied in place in the qkv buffer before
the rotation, for the families that ask for them (`supports(model, qk_norm=True)`).

Gemma 3's runner (families/gemma3_decode.py) is this one with Gemma's layer: sandwich norms,
per-head q/k norms with rope in one call, GeGLU, local rope tables and per-layer windows.

Tensors that leave the stage (the residual stream, the last layer's output) are fresh each step:
a pipeline send of step s may still read them while step s + 1 runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipefill.model.layers import FusedOps, rms_norm
from pipefill.model.shared_head import SharedHeadDecode


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
    qkv_heads: tuple  # (q, k, v): qkv's [M, heads, D] views, the attention's inputs
    attn2d: torch.Tensor  # attn as [M, q_size]
    rope: tuple  # pf_rope's arguments but cos and sin
    silu: tuple  # pf_silu_mul's arguments
    calls: list | None = None  # LayerCalls per layer, built at first use
    # Tensor parallelism: the sums of o and down over the ranks, bound once (no checks per
    # call: 'Tensor parallelism inside a stage'); None on a stage of one rank.
    tp_sums: tuple = (None, None)


@dataclass
class LayerCalls:
    """One layer's GEMMs and fused-op arguments for one batch size."""
    packed: dict  # the layer's packed copies (the bench swaps them out to time torch)
    qkv: object  # kernels.decode_gemm.BoundLinear: buf.x -> buf.qkv
    o_proj: object  # buf.attn2d -> buf.o
    gate_up: object | None  # buf.x -> buf.gate_up; None in a sparse layer
    down: object | None  # BoundLinear buf.act -> buf.down; the stage's last layer: the
    # PackedLinear itself (its output leaves the stage, so it is a fresh tensor every step)
    post_norm: tuple  # pf_add_rms_norm's arguments after the residual's pointer and stride
    next_norm: tuple | None  # the next layer's input norm over buf.down; None: the last layer
    moe: object | None = None  # model.moe.MoEBlock of a sparse layer: buf.x -> its MLP output
    qk_norm: tuple | None = None  # (q_norm, k_norm) weights of per-head norms, or None


def _buffers(cfg, dtype: torch.dtype, code: int, rows: int) -> DecodeBuffers:
    def empty(*shape):
        return torch.empty(*shape, dtype=dtype)
    qkv = empty(rows, cfg.q_size + 2 * cfg.kv_size)
    attn = empty(rows, cfg.num_heads, cfg.head_dim)
    q = qkv[:, :cfg.q_size].view(rows, cfg.num_heads, cfg.head_dim)
    k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].view(rows, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, cfg.q_size + cfg.kv_size:].view(rows, cfg.num_kv_heads, cfg.head_dim)
    gate_up, act = empty(rows, 2 * cfg.intermediate_size), empty(rows, cfg.intermediate_size)
    rope = (qkv.data_ptr(), code, qkv.stride(0), cfg.head_dim, rows,
            cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
    silu = (gate_up.data_ptr(), code, gate_up.stride(0), act.data_ptr(), act.stride(0), rows,
            cfg.intermediate_size)
    return DecodeBuffers(rows, empty(rows, cfg.hidden_size), qkv, attn,
                         empty(rows, cfg.hidden_size), gate_up, act,
                         empty(rows, cfg.hidden_size), (q, k, v), attn.view(rows, cfg.q_size),
                         rope, silu)


class DecodeRunner:
    """Runs a StageModel's layers for decode steps that `fits` accepts."""

    def __init__(self, model):
        # Imported on use: the module brings the kernel build (torch.utils.cpp_extension).
        from pipefill.kernels import fused_ops
        self.model = model
        self.lib = fused_ops.unchecked_lib()
        self.code = fused_ops.dtype_code(model.dtype)
        self.buffers: dict[int, DecodeBuffers] = {}
        self._layer_caches = (None, None, [])  # (k_cache, v_cache, per-layer (k, v) views)
        # A TP rank's straddled KV head, split by keys with the other rank over long contexts.
        self.shared = SharedHeadDecode.build(model)

    @staticmethod
    def supports(model, qk_norm: bool = False) -> bool:
        """The model's parts this path needs: fused ops, a vector attention kernel, and no
        per-head q/k norms unless qk_norm (dense Qwen3 keeps the general path)."""
        return (isinstance(model.ops, FusedOps) and hasattr(model.attention, "isa")
                and (qk_norm or all(w.q_norm is None for w in model.w.layers)))

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

    def _step_buffers(self, rows: int) -> DecodeBuffers:
        """The buffers of a step with `rows` sequences, their layer calls bound (again where
        the layers' packed copies changed)."""
        buf = self.buffers.get(rows)
        if buf is None:
            buf = self.buffers[rows] = _buffers(self.model.cfg, self.model.dtype, self.code,
                                                 rows)
            buf.tp_sums = (self.model.bind_tp_sum(buf.o), self.model.bind_tp_sum(buf.down))
        layers = self.model.w.layers
        if buf.calls is None or any(c.packed is not w.packed for c, w in zip(buf.calls, layers)):
            buf.calls = self._calls(buf)
        return buf

    def forward(self, hidden, residual, meta, cos, sin, k_cache, v_cache):
        buf = self._step_buffers(hidden.shape[0])
        residual = self._first_norm(hidden, residual, buf)
        res = (residual.data_ptr(), residual.stride(0))
        rope = buf.rope + (cos.data_ptr(), sin.data_ptr())
        caches = self._caches(k_cache, v_cache)
        tables = self.model.attention.decode_tables(meta.seqs)  # once per step, every layer's
        split = self.shared and self.shared.plan(tables[1])
        for calls, cache in zip(buf.calls, caches):
            out = buf.down if calls.next_norm is not None else torch.empty_like(buf.down)
            self._layer(calls, buf, res, rope, (tables, split), cache, out)
            if calls.next_norm is not None:
                self._check(self.lib.pf_add_rms_norm(*res, *calls.next_norm), "add_rms_norm")
        return out, residual

    def _layer(self, calls: LayerCalls, buf: DecodeBuffers, res, rope, step, cache, out):
        """One layer from its normed input (buf.x) to `out`; the residual is updated in place."""
        lib = self.lib
        calls.qkv()
        if calls.qk_norm is not None:
            self._qk_norm(buf, *calls.qk_norm)
        self._check(lib.pf_rope(*rope), "rope")  # q and k heads (adjacent columns) in one pass
        self._attend(buf, step, cache)
        calls.o_proj()
        o_sum, down_sum = buf.tp_sums  # tensor parallelism: the ranks' partial sums
        if o_sum is not None:
            o_sum()
        self._check(lib.pf_add_rms_norm(*res, *calls.post_norm), "add_rms_norm")
        if calls.moe is not None:
            out.copy_(calls.moe(buf.x))
            self.model.tp_sum(out)
            return
        calls.gate_up()
        self._check(lib.pf_silu_mul(*buf.silu), "silu_mul")
        if calls.next_norm is None:
            calls.down(buf.act, out=out)
            self.model.tp_sum(out)
            return
        calls.down()  # into buf.down (= out)
        if down_sum is not None:
            down_sum()

    def _calls(self, buf: DecodeBuffers) -> list[LayerCalls]:
        """Every layer's GEMMs bound to buf and its fused-op arguments (pointers taken once)."""
        cfg, code, layers = self.model.cfg, self.code, self.model.w.layers

        def norm(hidden, weight):  # pf_add_rms_norm's arguments after the residual's
            return (hidden.data_ptr(), code, hidden.stride(0), weight.data_ptr(),
                    buf.x.data_ptr(), code, buf.x.stride(0), buf.rows, cfg.hidden_size,
                    cfg.rms_norm_eps)
        calls = []
        for i, w in enumerate(layers):
            nxt = norm(buf.down, layers[i + 1].input_norm) if i + 1 < len(layers) else None
            p = w.packed
            moe = getattr(w, "moe", None)
            gate_up = down = None
            if moe is None:
                gate_up = p["gate_up"].bind(buf.x, buf.gate_up)
                down = p["down"] if nxt is None else p["down"].bind(buf.act, buf.down)
            calls.append(LayerCalls(p, p["qkv"].bind(buf.x, buf.qkv),
                                    p["o_proj"].bind(buf.attn2d, buf.o), gate_up, down,
                                    norm(buf.o, w.post_norm), nxt, moe,
                                    None if w.q_norm is None else (w.q_norm, w.k_norm)))
        return calls

    def _qk_norm(self, buf: DecodeBuffers, q_norm, k_norm) -> None:
        """Per-head RMSNorm of q and k, in place in buf.qkv (the general path's values)."""
        cfg, dtype = self.model.cfg, self.model.dtype
        q, k, _ = buf.qkv_heads
        q.copy_(rms_norm(q, q_norm, cfg.rms_norm_eps, dtype))
        k.copy_(rms_norm(k, k_norm, cfg.rms_norm_eps, dtype))

    @staticmethod
    def _check(rc: int, op: str) -> None:
        if rc:
            raise RuntimeError(f"pipefill fused {op} failed (rc={rc})")

    def _attend(self, buf: DecodeBuffers, step, cache) -> None:
        """Every sequence's KV write and attention in one kernel call (bits as decode_one's);
        step: (the decode tables, this step's shared-head split or None)."""
        attend, (tables, split) = self.model.attention, step
        with attend.profiled():
            if split:
                self.shared.attend(*buf.qkv_heads, *cache, tables, split, buf.attn)
            else:
                attend.decode_batch(*buf.qkv_heads, *cache, tables, self.model.scale, buf.attn)

    def _first_norm(self, hidden, residual, buf: DecodeBuffers) -> torch.Tensor:
        """The stage's first layer's normed input into buf.x, the residual stream added up;
        returns the residual stream (float32, fresh on the model's first stage)."""
        weight = self.model.w.layers[0].input_norm
        if residual is None:  # layer 0 of the model: the residual stream starts as the input
            residual = hidden.float()
            self._norm(residual, None, weight, buf.x)
        else:
            self._norm(residual, hidden, weight, buf.x)
        return residual

    def _norm(self, residual, hidden, weight, out) -> None:
        rows, width = residual.shape
        if hidden is None:
            hptr, hcode, hstride = None, 0, 0
        else:
            hptr, hcode, hstride = hidden.data_ptr(), self.code, hidden.stride(0)
        self._check(self.lib.pf_add_rms_norm(
            residual.data_ptr(), residual.stride(0), hptr, hcode, hstride, weight.data_ptr(),
            out.data_ptr(), self.code, out.stride(0), rows, width, self.model.cfg.rms_norm_eps),
            "add_rms_norm")
