"""The per-operation cost model of one layout (ARCHITECTURE.md, 'The deployment planner'): a
chunk's seconds on each stage from FLOPs and bytes, the border crossings' delays, each
device's memory and the bytes it puts on links.

Per layer and TP rank, for a chunk of C tokens after H computed ones:
  GEMMs      2·C·(weights a token multiplies by)/TP FLOPs (a sparse layer's router, shared
             expert and top-k experts only), against the weights they read (a sparse layer
             touches min(E, C·k) experts): the slower of compute and memory;
  attention  2·width·keys FLOPs over the rank's heads, keys = C·H + C(C+1)/2 (fewer under a
             sliding window), against reading the cache once;
  TP         two all-reduces of C·hidden activations, ring cost 2(n−1)·latency +
             2(n−1)/n·bytes/bandwidth over the links the ranks share.
A stage boundary sends hidden state and residual, 2·C·hidden activations, per chunk; and a
chunk costs each stage the hardware's fixed overhead besides.

A decode step (decode_step_seconds) is the same terms at C = batch rows: each rank streams its
weights and reads its KV share of every cached token, two all-reduces a layer (latency-bound
at a few rows), stage after stage for one token; no chunk overhead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipefill.base.partition import partition_layers
from pipefill.model.config import ModelConfig
from pipefill.model.shared_head import MIN_KEYS
from pipefill.model.tensor_parallel import choose_head_split, head_shares
from pipefill.planner.hardware import BYTES_OF, Hardware, Link

# What crosses a stage border per token: the hidden state and the residual stream.
BORDER_TENSORS = 2


@dataclass(frozen=True)
class Layout:
    """PP stages × TP ranks per stage × devices per rank (CPU cores running one rank's
    threads; 1 on GPUs)."""
    pp: int
    tp: int
    threads: int = 1

    @property
    def devices(self) -> int:
        return self.pp * self.tp * self.threads

    def __str__(self) -> str:
        text = f"PP{self.pp}xTP{self.tp}"
        return text + (f"x{self.threads}thr" if self.threads > 1 else "")


@dataclass(frozen=True)
class Precision:
    weights: str  # the GEMMs' weight dtype ("fp8" for an FP8 checkpoint)
    compute: str  # activations and attention
    kv: str  # the KV cache


@dataclass(frozen=True)
class LayerKind:
    """What one layer costs; the layers of a model come in a few kinds (dense and sparse,
    windowed or not), and a stage's cost sums its kinds times their counts."""
    fixed_weights: int  # read and multiplied by every token (attention, dense MLP, router)
    expert_weights: int  # one routed expert's; 0 in a dense layer
    num_experts: int
    top_k: int
    attention_width: int  # multiply-adds of one query against one key (all heads)
    heads: int
    kv_values: int  # a token's cached values in this layer (all KV heads, or the latent)
    kv_heads: int  # 0: a latent, which every TP rank keeps whole
    window: int | None


def layer_kinds(cfg: ModelConfig) -> list[LayerKind]:
    kinds = []
    for i in range(cfg.num_layers):
        sparse = cfg.is_sparse(i)
        fixed = cfg.attention_weights + (cfg.router_and_shared_weights if sparse
                                         else cfg.mlp_weights(i))
        kinds.append(LayerKind(
            fixed, cfg.expert_weights if sparse else 0, cfg.moe.num_experts if sparse else 0,
            cfg.moe.top_k if sparse else 0, cfg.attention_width, cfg.num_heads,
            cfg.kv_values(i), 0 if cfg.mla else cfg.num_kv_heads, cfg.window_of(i)))
    return kinds


def keys_seen(size: int, history: int, window: int | None) -> float:
    """Query-key pairs of a chunk's queries at positions [history, history + size): position
    p sees p + 1 keys, at most `window`."""
    def pairs_before(n):  # sum over p < n of min(p + 1, window)
        if window is None or n <= window:
            return n * (n + 1) / 2
        return window * (window + 1) / 2 + (n - window) * window
    return pairs_before(history + size) - pairs_before(history)


def ring_allreduce_seconds(num_bytes: float, ranks: int, link: Link) -> float:
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * link.latency + steps / ranks * num_bytes / link.bandwidth


def device_of(layout: Layout, stage: int, rank: int) -> int:
    """Devices are filled stage by stage, a rank's threads next to each other."""
    return (stage * layout.tp + rank) * layout.threads


def tp_link(hw: Hardware, layout: Layout, stage: int) -> Link:
    """The link a stage's all-reduce crosses: within a node, or the network where its ranks
    span nodes (the slower of the two bounds a ring)."""
    first = hw.node_of(device_of(layout, stage, 0))
    last = hw.node_of(device_of(layout, stage + 1, 0) - 1)
    return hw.intra_node if first == last else hw.inter_node


def border_link(hw: Hardware, layout: Layout, stage: int) -> Link:
    """The link between stage `stage` and the next (rank i sends to rank i)."""
    same = all(hw.node_of(device_of(layout, stage, r))
               == hw.node_of(device_of(layout, stage + 1, r)) for r in range(layout.tp))
    return hw.intra_node if same else hw.inter_node


class LayoutCosts:
    """The cost model of one model on one machine in one layout."""

    def __init__(self, cfg: ModelConfig, hw: Hardware, layout: Layout, precision: Precision):
        self.cfg, self.hw, self.layout, self.precision = cfg, hw, layout, precision
        self.head_split = choose_head_split(cfg, layout.tp)[0]  # as the ranks split heads
        kinds = layer_kinds(cfg)
        costs = [k.fixed_weights + k.top_k * k.expert_weights for k in kinds]
        self.stage_layers = partition_layers(cfg.num_layers, layout.pp, costs=costs)
        # Per stage: {kind: how many of its layers are of it}.
        self.stage_kinds = []
        for layers in self.stage_layers:
            counts: dict[LayerKind, int] = {}
            for i in layers:
                counts[kinds[i]] = counts.get(kinds[i], 0) + 1
            self.stage_kinds.append(counts)
        threads = layout.threads
        self.gemm_rate = hw.rate(precision.weights, precision.compute) * threads
        self.attention_rate = hw.rate(precision.compute, precision.compute) * threads
        self.memory_bandwidth = hw.memory_bandwidth * threads
        self.act_bytes = BYTES_OF[precision.compute]
        self.weight_bytes = BYTES_OF[precision.weights]
        self.kv_bytes = BYTES_OF[precision.kv]

    # -- time --------------------------------------------------------------------------------
    def _head_shares(self, kind: LayerKind) -> list[tuple[range, range]]:
        """The ranks' own split (model/tensor_parallel.choose_head_split: 5 and 4 of 9 heads
        at TP 2 over 3 KV heads, the straddled KV head on both ranks)."""
        return head_shares(kind.heads, kind.kv_heads, self.layout.tp, self.head_split)

    def shard(self, kind: LayerKind) -> float:
        """The share of the layer's query heads the busiest TP rank attends with: the ranks'
        own split (_head_shares), or ceil shares of a latent's heads."""
        if kind.kv_heads == 0:
            return math.ceil(kind.heads / self.layout.tp) / kind.heads
        return max(len(q) for q, _ in self._head_shares(kind)) / kind.heads

    def kv_share(self, kind: LayerKind) -> float:
        """The share of a token's cached values one rank keeps: its KV heads (one at least,
        replicated when fewer than ranks or where a group straddles two ranks), or the whole
        latent."""
        if kind.kv_heads == 0:
            return 1.0
        return max(len(kv) for _, kv in self._head_shares(kind)) / kind.kv_heads

    def decode_kv_share(self, kind: LayerKind, keys: int) -> float:
        """The share of a token's cached values one rank reads at decode: kv_share, except
        where two ranks split a straddled KV head by keys (model/shared_head.py: TP 2 split by
        query heads, past MIN_KEYS keys), which leaves each half of the heads."""
        straddled = (self.layout.tp == 2 and self.head_split == "queries"
                     and kind.kv_heads > 0 and keys >= MIN_KEYS)
        return 0.5 if straddled else self.kv_share(kind)

    def decode_layer_seconds(self, kind: LayerKind, rows: int, context: int,
                             link: Link) -> float:
        """One layer of a decode step of `rows` sequences at `context` cached tokens each."""
        tp = self.layout.tp
        touched = kind.fixed_weights + min(kind.num_experts, rows * kind.top_k) \
            * kind.expert_weights
        active = kind.fixed_weights + kind.top_k * kind.expert_weights
        gemm = max(2 * rows * active / tp / self.gemm_rate,
                   touched / tp * self.weight_bytes / self.memory_bandwidth)
        keys = min(kind.window or context + 1, context + 1)
        attention = max(
            2 * kind.attention_width * self.shard(kind) * rows * keys / self.attention_rate,
            rows * keys * kind.kv_values * self.decode_kv_share(kind, keys) * self.kv_bytes
            / self.memory_bandwidth)
        reduce = 2 * ring_allreduce_seconds(rows * self.cfg.hidden_size * self.act_bytes, tp,
                                            link)
        return gemm + attention + reduce

    def decode_step_seconds(self, context: int, rows: int = 1) -> float:
        """A decode step: every stage in turn (one token crosses them all) and its borders."""
        total = 0.0
        for stage, kinds in enumerate(self.stage_kinds):
            link = tp_link(self.hw, self.layout, stage)
            total += sum(n * self.decode_layer_seconds(kind, rows, context, link)
                         for kind, n in kinds.items())
        return total + (self.layout.pp - 1) * self.border_delay(rows)

    def layer_seconds(self, kind: LayerKind, size: int, history: int, link: Link) -> float:
        tp = self.layout.tp
        touched = kind.fixed_weights + min(kind.num_experts, size * kind.top_k) \
            * kind.expert_weights
        active = kind.fixed_weights + kind.top_k * kind.expert_weights
        gemm = max(2 * size * active / tp / self.gemm_rate,
                   touched / tp * self.weight_bytes / self.memory_bandwidth)
        attention = max(
            2 * kind.attention_width * self.shard(kind)
            * keys_seen(size, history, kind.window) / self.attention_rate,
            (history + size) * kind.kv_values * self.kv_share(kind) * self.kv_bytes
            / self.memory_bandwidth)
        reduce = 2 * ring_allreduce_seconds(size * self.cfg.hidden_size * self.act_bytes, tp,
                                            link)
        return gemm + attention + reduce

    def chunk_seconds(self, stage: int, size: int, history: int) -> float:
        link = tp_link(self.hw, self.layout, stage)
        return self.hw.chunk_overhead + sum(n * self.layer_seconds(kind, size, history, link)
                                            for kind, n in self.stage_kinds[stage].items())

    def border_bytes(self, size: int) -> float:
        return BORDER_TENSORS * size * self.cfg.hidden_size * self.act_bytes

    def border_delay(self, size: int) -> float:
        """A chunk's crossing of the slowest stage border (the simulator takes one delay per
        chunk for every border)."""
        if self.layout.pp == 1:
            return 0.0
        return max(border_link(self.hw, self.layout, s).seconds(self.border_bytes(size))
                   for s in range(self.layout.pp - 1))

    # -- memory and links --------------------------------------------------------------------
    def stage_weight_bytes(self, stage: int) -> float:
        """One rank's weights: its shard of the stage's layers (every expert stored), plus
        the embedding on the first stage and the head on the last (vocabulary-parallel), kept
        in the compute dtype."""
        tp = self.layout.tp
        layers = sum(n * (k.fixed_weights + k.num_experts * k.expert_weights)
                     for k, n in self.stage_kinds[stage].items())
        out = layers / tp * self.weight_bytes
        table = self.cfg.vocab_size * self.cfg.hidden_size / tp * self.act_bytes
        first, last = stage == 0, stage == self.layout.pp - 1
        # A tied head is the embedding itself where one stage holds both.
        tables = 1 if first and last and self.cfg.tie_word_embeddings else first + last
        return out + tables * table

    def stage_kv_bytes(self, stage: int, tokens: int) -> float:
        return tokens * self.kv_bytes * sum(
            n * min(k.window or tokens, tokens) / tokens * k.kv_values * self.kv_share(k)
            for k, n in self.stage_kinds[stage].items())

    def stage_link_bytes(self, stage: int, tokens: int) -> dict[str, float]:
        """Bytes one rank of `stage` sends over each kind of link for a prompt: its ring
        all-reduces (two a layer) and its border crossing."""
        out = {"intra_node": 0.0, "inter_node": 0.0}
        tp = self.layout.tp
        if tp > 1:
            layers = len(self.stage_layers[stage])
            ring = 2 * layers * 2 * (tp - 1) / tp * tokens * self.cfg.hidden_size \
                * self.act_bytes
            out[self.link_name(tp_link(self.hw, self.layout, stage))] += ring
        if stage < self.layout.pp - 1:
            out[self.link_name(border_link(self.hw, self.layout, stage))] += \
                self.border_bytes(tokens)
        return out

    def link_name(self, link: Link) -> str:
        return "intra_node" if link is self.hw.intra_node else "inter_node"
