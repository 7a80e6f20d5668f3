"""A decoder over a contiguous slice of layers: one pipeline stage, of any family.

Stage 0 has the embedding, the last stage the final norm and lm_head; missing parts are None.
Activations between layers (and between stages) are `hidden` in the compute dtype and `residual`
in float32, so the residual stream keeps full precision across layers and stage borders. The
layers themselves are the family's (model/family.py): its layer weights and its layer_forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pipefill.kernels.prefill_gemm import torch_linear
from pipefill.model.attention import SeqMeta, kv_writer, paged_attention
from pipefill.model.config import ModelConfig
from pipefill.model.families import family_of
from pipefill.model.layers import TorchOps, rms_norm
from pipefill.model.rope import cos_sin, inverse_frequencies, rope_attention_factor


# The float32 logits a block of prompt-logprob rows holds at once (StageModel.logit_blocks).
LOGIT_BLOCK_BYTES = 256 << 20


@dataclass
class ForwardMeta:
    """Per-forward metadata, built per stage from the micro-batch's plan."""
    positions: torch.Tensor  # [num_tokens] long
    seqs: list[SeqMeta]
    # Last stage: per sequence, whether its last row's output is used (logits); None = every
    # row of every sequence is. With a list, forward returns only those rows, in order: the
    # last layer then computes K/V for all rows but attention and MLP for those rows only.
    last_rows: list[bool] | None = None
    # Where the window layers keep pages of their own (kv.cache.WindowedKVCache): the same
    # sequences over their window pages, which those layers read and write instead of `seqs`.
    window_seqs: list[SeqMeta] | None = None
    # With window_seqs: the window layers compute a chunk in pieces cut at multiples of this
    # many tokens, in order (attention.window_pieces), because a request's window pages form a
    # ring that a later page of a long chunk wraps onto (ARCHITECTURE.md, 'Window pages');
    # 0: whole chunks.
    window_piece: int = 0
    # What a family derives from the plan once for all the forward's layers (the latent
    # decode kernel's slot index: model/mla.py), filled on first use.
    derived: dict = field(default_factory=dict)


@dataclass
class StageWeights:
    layers: list  # the family's layer weights, one per local layer
    embed: object | None  # [vocab, hidden], first stage only; a QuantLinear of GGUF blocks
    # where they are kept (rows dequantized as they are looked up: StageModel.embed)
    final_norm: torch.Tensor | None  # last stage only
    lm_head: torch.Tensor | None  # [vocab, hidden], last stage only (None: lm_head_quant)
    lm_head_packed: object | None = None  # kernels.decode_gemm.PackedLinear or QuantLinear
    # --weight-dtype gguf: the head as GGUF blocks (kernels.quant_gemm.QuantLinear); it is the
    # only head when lm_head is None (a tied head on a stage that holds the embedding: its
    # blocks, the same object as embed).
    lm_head_quant: object | None = None
    # --weight-dtype gguf: "name: type" of the linear layers whose types stayed dequantized.
    kept_dequantized: list | None = None

    def tensor_bytes(self) -> dict[str, int]:
        """Bytes of the tensors the stage holds as weights, by part: "layers" (matrices, their
        decode and prefill copies, norms), "embed", "head" (an LM head that is not the
        embedding's own tensors), "final_norm"; each storage counted once, so a tied head, a
        view or a copy shared between the decode and prefill paths is not counted twice."""
        seen: set[int] = set()
        parts = {"layers": self.layers, "embed": self.embed,
                 "head": (self.lm_head, self.lm_head_packed, self.lm_head_quant),
                 "final_norm": self.final_norm}
        return {name: _storage_bytes(held, seen) for name, held in parts.items()}


def _storage_bytes(obj, seen: set[int], depth: int = 0) -> int:
    """Bytes of the distinct tensors reachable from obj through containers,
    dataclasses and pipefill objects (the kernels' weight holders), adding each to `seen`."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:  # an opaque (oneDNN) tensor: no storage to share
            return obj.numel() * obj.element_size()
        # A tensor's own bytes, once per address: a tied head or a view at the same address
        # is not counted twice, and a piece of a shared 2 MiB-page mapping
        # (kernels/huge_pages.py) counts its piece, not the whole mapping.
        if obj.data_ptr() in seen:
            return 0
        seen.add(obj.data_ptr())
        return obj.numel() * obj.element_size()
    if depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return 0
    if isinstance(obj, dict):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif type(obj).__module__.startswith("pipefill."):
        children = (getattr(obj, name) for name in _field_names(obj))
    else:
        return 0  # bound methods (a layer's prefill entries) and foreign objects
    return sum(_storage_bytes(child, seen, depth + 1) for child in children)


def _field_names(obj) -> list[str]:
    names = list(getattr(obj, "__dict__", ()))
    for cls in type(obj).__mro__:
        names += [n for n in getattr(cls, "__slots__", ()) if hasattr(obj, n)]
    return names


def _nothing() -> None:
    pass


class StageModel:
    def __init__(self, cfg: ModelConfig, layer_start: int, weights: StageWeights,
                 dtype: torch.dtype, attention=paged_attention, ops=None, tp=None):
        self.cfg = cfg  # a TP rank's own heads and MLP width (model.tensor_parallel)
        # Tensor parallelism: model.tensor_parallel.TPOps over the stage's ranks (None: one).
        self.tp = tp
        self.family = family_of(cfg)
        self.attention = attention  # (q, k, v, k_cache, v_cache, seqs, scale) -> out
        self.kv_writer = kv_writer(attention)  # K/V into the cache without attention, or None
        self.ops = ops or TorchOps()
        self.layer_start = layer_start
        self.w = weights
        self.dtype = dtype
        self.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.rope_factor = rope_attention_factor(cfg.rope_scaling)  # yarn's, in cos and sin
        # Sliding-window layers with a rope base of their own (Gemma 3's local layers).
        self.local_inv_freq = (None if cfg.local_rope_theta is None else
                               inverse_frequencies(cfg.head_dim, cfg.local_rope_theta, {}))
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        # Decode steps the family's lean path fits (model.decode_step for Llama: same kernels,
        # same bits, no per-call overhead) take it; tests and benchmarks set fast_decode = False
        # to run the family's layer_forward instead.
        self.fast_decode = True
        self._decode = self.family.decode_runner(self)
        # Called after each layer of the general path: the runtime's stall watchdog counts
        # layers, so one long chunk is progress, not silence (ARCHITECTURE.md, 'A request's path').
        self.after_layer = _nothing

    def tp_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output (o_proj, down) summed over the stage's TP ranks, in
        place; the tensor itself on a stage of one rank."""
        if self.tp is not None and partial.numel():
            self.tp.sum_(partial)
        return partial

    def bind_tp_sum(self, partial: torch.Tensor):
        """tp_sum(partial) as a call without arguments, for a buffer summed every layer (the
        lean decode step's); None on a stage of one rank."""
        if self.tp is None or not partial.numel():
            return None
        return self.tp.bind_sum(partial)

    @property
    def num_layers(self) -> int:
        return len(self.w.layers)

    @property
    def is_first(self) -> bool:
        return self.w.embed is not None

    @property
    def is_last(self) -> bool:
        return self.w.lm_head is not None or self.w.lm_head_quant is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:  # this rank's vocabulary rows, summed over the ranks
            x = self.tp.embed(input_ids, self.w.embed, self.dtype)
        elif not isinstance(self.w.embed, torch.Tensor):  # GGUF blocks: the ids' rows only
            x = self.w.embed.rows(input_ids, self.dtype)
        else:
            x = F.embedding(input_ids, self.w.embed)
        if self.cfg.embed_scale is not None:  # in the embedding's dtype, as HF multiplies
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    @torch.inference_mode()
    def forward(self, hidden, residual, meta: ForwardMeta, k_cache, v_cache):
        """Runs this stage's layers. k_cache/v_cache: per local layer, indexed [i]
        (KVCache.per_layer)."""
        cos, sin = cos_sin(meta.positions, self.inv_freq, self.rope_factor)
        # A step of one-token rows where some row feeds no logit (a one-token prompt chunk)
        # trims on the general path: the lean decode path returns every row.
        trim = self.trims(meta)
        if (not trim and self.fast_decode and self._decode is not None
                and self._decode.fits(hidden, meta)):
            return self._decode.forward(hidden, residual, meta, cos, sin, k_cache, v_cache)
        last = len(self.w.layers) - 1
        local = None if self.local_inv_freq is None else cos_sin(meta.positions,
                                                                 self.local_inv_freq)
        for i, layer in enumerate(self.w.layers):
            rope = (cos, sin)
            if local is not None and self.cfg.window_of(self.layer_start + i) is not None:
                rope = local
            hidden, residual = self.family.layer_forward(self, layer, hidden, residual, meta,
                                                         *rope, k_cache[i], v_cache[i],
                                                         trim and i == last)
            self.after_layer()
        return hidden, residual

    def trims(self, meta: ForwardMeta) -> bool:
        """Whether the last layer computes only the rows meta.last_rows asks for (the last
        stage's final layer feeds nothing but the logits; its K/V are still written for all)."""
        return meta.last_rows is not None and self.is_last and self.kv_writer is not None

    @torch.inference_mode()
    def logits(self, hidden, residual, rows: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head on the selected rows only -> float32 [len(rows), vocab].
        Under tensor parallelism every rank of the stage calls this together: each computes
        its vocabulary share, and all get the whole."""
        blocks = list(self.logit_blocks(hidden, residual, rows, max(1, len(rows))))
        return torch.cat(blocks) if blocks else torch.empty(0, self.cfg.vocab_size)

    @torch.inference_mode()
    def logit_blocks(self, hidden, residual, rows: torch.Tensor, block_rows: int | None = None):
        """logits() of the selected rows, `block_rows` rows at a time (by default as many as
        LOGIT_BLOCK_BYTES of float32 logits hold), so that prompt logprobs of a long chunk
        never hold its whole [rows, vocab] (2 GiB for 2,048 rows of a 262K-word vocabulary,
        and log_softmax as much again). The head runs on the path one call on all the rows
        takes (GGUF blocks dequantized once for every block where that call dequantizes),
        so each row's logits are logits()'s. Under tensor parallelism every rank iterates
        through the same blocks together."""
        final = residual[rows].add_(hidden[rows])
        x = rms_norm(final, self.w.final_norm, self.cfg.rms_norm_eps, self.dtype)
        head = self._head_for(x.shape[0])
        step = block_rows or max(1, LOGIT_BLOCK_BYTES // (4 * self.cfg.vocab_size))
        for at in range(0, x.shape[0], step):
            logits = head(x[at:at + step])
            if self.tp is not None:
                logits = self.tp.gather_logits(logits)
            yield self._softcap(logits)

    def _head_for(self, rows: int):
        """The head as a function of a piece of `rows` rows -> float32 logits, on the path
        a call on all of them takes."""
        head = self.w.lm_head_packed
        if head is not None and rows <= head.max_rows:  # float32 logits straight away
            return lambda x: head(x, out=torch.empty(x.shape[0], head.out_features))
        if self.w.lm_head is None:  # GGUF blocks only: the integer path, or dequantized once
            quant = self.w.lm_head_quant.prefill_for(rows, self.dtype)
            return lambda x: quant(x).float()
        return lambda x: torch_linear(x, self.w.lm_head).float()

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)
