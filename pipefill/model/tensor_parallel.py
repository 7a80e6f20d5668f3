"""Tensor parallelism inside a stage: which heads and MLP columns a rank holds, the rank's
model config, and its slices of the checkpoint (ARCHITECTURE.md, 'Tensor parallelism inside a
stage').

A rank's layers are the family's own layers over a smaller config: its query heads, its KV
heads and its share of the MLP width. q/k/v and gate/up are split by output rows
(column-parallel), o_proj and down by input columns (row-parallel), so each rank's o_proj and
down give a partial sum of the full output, and the ranks sum them (the stage model's
`tp_sum`, twice a layer). The embedding and the LM head are split by vocabulary rows: a
rank looks up only the ids in its rows (zeros elsewhere) and the ranks sum the rows, and each
rank's head gives its share of the logits, which the ranks gather (`TPOps`).

Heads, one of two splits (`HEAD_SPLITS`, chosen by `choose_head_split`). "groups": with at
least as many KV heads as ranks, the KV heads are split (ceil/floor shares) and each rank takes
the query heads of its KV heads, whole GQA groups; with fewer KV heads than ranks, each KV head
goes to a run of ranks (ceil/floor shares of the ranks), which split its group's query heads
(ceil/floor again) and each keep a copy of that KV head. Every rank's query heads then map onto
its KV heads in equal groups. "queries": the query heads are split ceil/floor and each rank
holds the KV heads its query heads read, a KV head whose group straddles two ranks on both
(9 heads over 3 KV heads at TP 2: heads 0-4 on KV heads 0-1, heads 5-8 on KV heads 1-2), so a
rank's groups may differ in size (`TPShard.q_per_kv`, which the attention kernels take).

Mixture-of-experts layers: the router is whole on every rank (the same routing everywhere),
and the routed experts are split one of two ways (`MOE_SPLITS`): by width, every rank holding
a ceil/floor share of every expert's intermediate columns (cut as the dense MLP's), or by
expert, every rank holding whole experts, a contiguous ceil/floor share of them, and running
only its experts' rows. Either way a rank's output is a partial sum of the layer's, summed by
the MLP's all-reduce. A shared expert is always split by width.

Latent layers (DeepSeek, model/mla.py): the query heads are split ceil/floor, and a rank's
query rows (q_b_proj, or V2's q_proj), kv_b_proj's rows and o_proj's columns are those of its
heads (LATENT_SPLITS); q_a_proj and kv_a_proj_with_mqa with their norms stay whole, so every
rank computes the same latent and keeps the whole latent cache (it is one "KV head" shared by
all query heads).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from pipefill.kernels.gguf_blocks import block_weights, row_bytes, supports
from pipefill.kernels.quant_gemm import QuantLinear
from pipefill.model.config import ModelConfig
from pipefill.model.family import ModelFamily

# The families that run tensor parallel so far (their layer_forward and decode runner call
# the stage model's tp_sum; Gemma 3's q/k norms, shared by every head, and its four norms a
# layer stay whole on every rank); their checkpoints' split tensors by Hugging Face name
# suffix: (which split, the dimension cut: 0 rows of a column-parallel matrix, 1 columns of
# a row-parallel one).
TP_FAMILIES = ("llama", "moe", "deepseek", "gemma3")
SPLITS = {
    "self_attn.q_proj.weight": ("q", 0), "self_attn.q_proj.bias": ("q", 0),
    "self_attn.k_proj.weight": ("kv", 0), "self_attn.k_proj.bias": ("kv", 0),
    "self_attn.v_proj.weight": ("kv", 0), "self_attn.v_proj.bias": ("kv", 0),
    "self_attn.o_proj.weight": ("q", 1),
    "mlp.gate_proj.weight": ("mlp", 0), "mlp.up_proj.weight": ("mlp", 0),
    "mlp.down_proj.weight": ("mlp", 1),
    "mlp.shared_expert.gate_proj.weight": ("shared", 0),
    "mlp.shared_expert.up_proj.weight": ("shared", 0),
    "mlp.shared_expert.down_proj.weight": ("shared", 1),
    # DeepSeekMoE's (ungated) shared experts, one MLP of their summed width.
    "mlp.shared_experts.gate_proj.weight": ("shared", 0),
    "mlp.shared_experts.up_proj.weight": ("shared", 0),
    "mlp.shared_experts.down_proj.weight": ("shared", 1),
}
# A latent layer's tensors cut by query heads, checked before SPLITS (whose q_proj and o_proj
# assume head_dim rows a head): suffix -> (the dimension cut, a head's rows or columns there
# from the MLAConfig). GGUF's 3-D kv_b halves (k_b [heads, rank, nope], v_b [heads, v, rank])
# are cut along their first dimension, one a head.
LATENT_SPLITS = {
    "self_attn.q_proj.weight": (0, lambda m: m.qk_head_dim),  # V2: no q LoRA
    "self_attn.q_b_proj.weight": (0, lambda m: m.qk_head_dim),
    "self_attn.kv_b_proj.weight": (0, lambda m: m.qk_nope_head_dim + m.v_head_dim),
    "self_attn.k_b_proj.weight": (0, lambda m: 1),
    "self_attn.v_b_proj.weight": (0, lambda m: 1),
    "self_attn.o_proj.weight": (1, lambda m: m.v_head_dim),
}
# A routed expert's matrices (Qwen's names, Mixtral's w1/w3/w2) -> the dimension a width
# split cuts.
EXPERT_MATRIX = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
EXPERT_DIM = {"gate_proj": 0, "up_proj": 0, "w1": 0, "w3": 0, "down_proj": 1, "w2": 1}
# How the routed experts are split over a stage's ranks (--tp-moe-split); the default, "auto",
# is DEFAULT_MOE_SPLIT where the model has at least one expert per rank, else "width".
MOE_SPLITS = ("width", "expert")
DEFAULT_MOE_SPLIT = "expert"


def shares(n: int, parts: int) -> list[range]:
    """n items cut into `parts` contiguous runs, the first n % parts one longer."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class TPShard:
    """What rank `rank` of a stage's `size` TP ranks holds of every layer."""
    rank: int
    size: int
    q_heads: range  # global query head ids
    kv_heads: range  # global KV head ids (shared with other ranks when replicated)
    mlp: range  # global columns of the MLP's intermediate width
    vocab: range  # rows of the embedding and the LM head
    moe_split: str = "width"  # how the routed experts are split (MOE_SPLITS)
    experts: range = range(0)  # global ids of the routed experts this rank runs
    expert_cols: range = range(0)  # columns of each routed expert's width it holds
    shared_cols: range = range(0)  # columns of the shared expert's width it holds
    head_split: str = "groups"  # HEAD_SPLITS
    q_per_kv: tuple[int, ...] = ()  # query heads per local KV head where unequal (local_groups)

    def rows(self, split: str, head_dim: int) -> range:
        """The checkpoint rows (or columns) of a split tensor this rank keeps."""
        named = {"mlp": self.mlp, "vocab": self.vocab, "expert": self.expert_cols,
                 "shared": self.shared_cols}
        if split in named:
            return named[split]
        heads = self.q_heads if split == "q" else self.kv_heads
        return range(heads.start * head_dim, heads.stop * head_dim)


# How a stage's query heads are split over its ranks (module docstring); choose_head_split
# takes "queries" where it makes the busiest rank cheaper, else "groups" (no unequal groups).
HEAD_SPLITS = ("groups", "queries")
# The prompt the head split is costed at: 8K tokens, whose queries see 4K keys on average.
SPLIT_PROMPT_TOKENS = 8192
# "queries" must make the busiest rank this much cheaper: a KV head copied for nothing costs
# cache memory and an attention call per rank.
SPLIT_MIN_GAIN = 0.01


def head_shares(num_heads: int, num_kv_heads: int, size: int,
                split: str = "groups") -> list[tuple[range, range]]:
    """(query heads, KV heads) of each of `size` ranks under `split` (HEAD_SPLITS)."""
    if split == "queries":
        return query_head_shares(num_heads, num_kv_heads, size)
    assert split == "groups", split
    return group_head_shares(num_heads, num_kv_heads, size)


def group_head_shares(num_heads: int, num_kv_heads: int, size: int) -> list[tuple[range, range]]:
    """(query heads, KV heads) of each of `size` ranks, whole GQA groups per rank."""
    group = num_heads // num_kv_heads
    if size <= num_kv_heads:
        return [(range(kv.start * group, kv.stop * group), kv)
                for kv in shares(num_kv_heads, size)]
    out = []
    for kv, ranks in enumerate(shares(size, num_kv_heads)):  # ranks sharing KV head kv
        for q in shares(group, len(ranks)):
            out.append((range(kv * group + q.start, kv * group + q.stop), range(kv, kv + 1)))
    return out


def query_head_shares(num_heads: int, num_kv_heads: int, size: int) -> list[tuple[range, range]]:
    """(query heads, KV heads) of each of `size` ranks: ceil/floor shares of the query heads,
    each rank with the KV heads they read (a straddled group's KV head on both ranks)."""
    group = num_heads // num_kv_heads
    return [(q, range(q.start // group, (q.stop - 1) // group + 1))
            for q in shares(num_heads, size)]


def local_groups(q_heads: range, kv_heads: range, group: int) -> tuple[int, ...]:
    """The rank's query heads per local KV head, in order (its query heads are consecutive);
    () where they are equal (an ordinary GQA layer to the kernels)."""
    counts = tuple(sum(1 for h in q_heads if h // group == kv) for kv in kv_heads)
    return () if len(set(counts)) == 1 else counts


def rank_costs(cfg: ModelConfig, size: int, split: str,
               prompt_tokens: int = SPLIT_PROMPT_TOKENS) -> list[float]:
    """Each rank's multiply-adds for one prompt token of a layer under `split`: its q/k/v/o
    rows and MLP columns (mlp_shares evens these out), and its query heads' attention (q.k
    and p.v, head_dim each) over the prompt's mean keys, half of it (causal)."""
    heads = head_shares(cfg.num_heads, cfg.num_kv_heads, size, split)
    attention = [attention_columns(cfg, len(q), len(kv)) for q, kv in heads]
    mlp = mlp_shares(cfg.intermediate_size, size, attention)
    keys = prompt_tokens / 2
    return [3 * cfg.hidden_size * (a + len(m)) + len(q) * 2 * cfg.head_dim * keys
            for a, m, (q, _) in zip(attention, mlp, heads)]


def choose_head_split(cfg: ModelConfig, size: int) -> tuple[str, str]:
    """(the head split, why): "queries" where its busiest rank costs at least SPLIT_MIN_GAIN
    less than under "groups" (rank_costs at SPLIT_PROMPT_TOKENS), else "groups"."""
    if size == 1 or cfg.mla is not None or size > cfg.num_heads:
        return "groups", ("one rank" if size == 1 else "latent attention" if cfg.mla is not None
                          else "more ranks than query heads")
    groups, queries = (max(rank_costs(cfg, size, s)) for s in HEAD_SPLITS)
    mean = sum(rank_costs(cfg, size, "groups")) / size
    costs = (f"busiest rank {groups / mean:.2f}x the mean by whole groups, "
             f"{queries / mean:.2f}x by query heads, at a {SPLIT_PROMPT_TOKENS}-token prompt")
    if queries < groups * (1 - SPLIT_MIN_GAIN):
        return "queries", costs
    return "groups", costs


@dataclass(frozen=True)
class StraddledHead:
    """The KV head whose query group two ranks share (TP 2 split by query heads: SmolLM2's KV
    head 1, query heads 3-4 on rank 0 and 5 on rank 1). Each rank reads all of its keys for
    its own query heads, so each reads 2 of the 3 KV heads where one process's threads share
    3; at decode over a long context the two ranks split its keys instead
    (model/shared_head.py)."""
    local_kv: int  # its index among this rank's KV heads
    group: int  # the model's query heads per KV head
    peer_heads: int  # how many of its query heads the other rank holds
    peer_first: bool  # the other rank's heads of the group come before this rank's (rank 1)


def straddled_head(cfg: ModelConfig, shard: TPShard) -> StraddledHead | None:
    """The rank's straddled KV head at TP 2 split by query heads (unequal groups), else None
    (more ranks can straddle two heads a rank; not split by keys yet)."""
    if shard.size != 2 or shard.head_split != "queries" or not shard.q_per_kv:
        return None
    local_kv = len(shard.kv_heads) - 1 if shard.rank == 0 else 0
    group = cfg.num_heads // cfg.num_kv_heads
    return StraddledHead(local_kv, group, group - shard.q_per_kv[local_kv], shard.rank == 1)


def has_unequal_groups(cfg: ModelConfig, size: int) -> bool:
    """Whether some rank's query groups differ in size under the split tp_shard takes (the
    AMX kernel does not take such a rank)."""
    if size == 1 or cfg.mla is not None:
        return False
    group = cfg.num_heads // cfg.num_kv_heads
    return any(local_groups(q, kv, group) for q, kv in
               head_shares(cfg.num_heads, cfg.num_kv_heads, size, choose_head_split(cfg, size)[0]))


# The fused elementwise kernels take widths in multiples of this (model/layers.py): an MLP
# width that is one is shared out in such units, so every rank's width stays one.
MLP_GRAIN = 16


def mlp_shares(width: int, size: int, attention: list[float] | None = None) -> list[range]:
    """The MLP's intermediate columns of each rank, in units of MLP_GRAIN where the width is
    a multiple of it and has at least one unit per rank. `attention`: each rank's attention
    weights in MLP columns (its q/k/v/o rows over 3 x hidden, see attention_columns). Equal
    (or None): ceil/floor shares. Unequal (heads split by whole GQA groups, 6:3 for 9 heads
    over 3 KV heads; 5:4 by query heads, a little): a rank with fewer heads takes more
    columns, so every rank holds (and multiplies a token by) the same weight, the
    largest-remainder rounding of that split."""
    grain = MLP_GRAIN if width % MLP_GRAIN == 0 and width // MLP_GRAIN >= size else 1
    units = width // grain
    if attention is None or len(set(attention)) == 1:
        return [range(r.start * grain, r.stop * grain) for r in shares(units, size)]
    counts = balanced_counts(units, [a / grain for a in attention])
    out, start = [], 0
    for count in counts:
        out.append(range(start * grain, (start + count) * grain))
        start += count
    out[-1] = range(out[-1].start, width)  # the remainder of a non-grain width
    return out


def balanced_counts(units: int, fixed: list[float]) -> list[int]:
    """`units` shared out so that fixed[r] + count[r] is as even as whole units allow, every
    rank one unit at least (it keeps an MLP to run)."""
    level = (units + sum(fixed)) / len(fixed)
    want = [max(1.0, level - f) for f in fixed]
    scale = units / sum(want)  # the clamp at one unit leaves the others a little less
    want = [w * scale for w in want]
    counts = [max(1, int(w)) for w in want]
    by_remainder = sorted(range(len(want)), key=lambda r: want[r] - int(want[r]), reverse=True)
    for r in by_remainder[:units - sum(counts)]:
        counts[r] += 1
    while sum(counts) > units:  # clamps pushed past the total: take from the largest
        counts[counts.index(max(counts))] -= 1
    return counts


def attention_columns(cfg: ModelConfig, q_heads: int, kv_heads: int) -> float:
    """A rank's q/k/v/o weights in MLP columns (each column is gate + up + down: 3 x hidden);
    a latent layer's per-head weights (its q rows, kv_b rows and o columns: the parts every
    rank holds whole are alike on all)."""
    if cfg.mla is not None:
        m = cfg.mla
        per_head = ((m.q_lora_rank or cfg.hidden_size) * m.qk_head_dim
                    + m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim)
                    + m.v_head_dim * cfg.hidden_size)
        return q_heads * per_head / (3 * cfg.hidden_size)
    return 2 * (q_heads + kv_heads) * cfg.head_dim / 3


def resolve_moe_split(requested: str, cfg: ModelConfig, size: int) -> tuple[str, str]:
    """(the routed experts' split, why): `requested` unless "auto", which takes
    DEFAULT_MOE_SPLIT where every rank gets an expert, else the width split."""
    if requested != "auto":
        return requested, "requested"
    if DEFAULT_MOE_SPLIT == "expert" and cfg.moe is not None and cfg.moe.num_experts < size:
        return "width", f"fewer experts ({cfg.moe.num_experts}) than ranks"
    return DEFAULT_MOE_SPLIT, "the default: faster in prefill, as fast in decode"


def tp_shard(cfg: ModelConfig, rank: int, size: int, moe_split: str = "width",
             head_split: str | None = None) -> TPShard:
    """What rank `rank` of `size` holds; head_split None: choose_head_split's."""
    head_split = head_split or choose_head_split(cfg, size)[0]
    heads = head_shares(cfg.num_heads, cfg.num_kv_heads, size, head_split)
    attention = [attention_columns(cfg, len(q), len(kv)) for q, kv in heads]
    q, kv = heads[rank]
    shard = TPShard(rank, size, q, kv, mlp_shares(cfg.intermediate_size, size, attention)[rank],
                    shares(cfg.vocab_size, size)[rank], head_split=head_split,
                    q_per_kv=local_groups(q, kv, cfg.num_heads // cfg.num_kv_heads))
    moe = cfg.moe
    if moe is None:
        return shard
    by_expert = moe_split == "expert"
    return dataclasses.replace(
        shard, moe_split=moe_split,
        experts=shares(moe.num_experts, size)[rank] if by_expert else range(moe.num_experts),
        expert_cols=(range(moe.expert_width) if by_expert
                     else mlp_shares(moe.expert_width, size)[rank]),
        shared_cols=mlp_shares(moe.shared_width, size)[rank] if moe.shared_width else range(0))


def shard_config(cfg: ModelConfig, shard: TPShard) -> ModelConfig:
    """The config a rank's layers run: its heads, MLP width and experts (their ids and
    widths), everything else the model's."""
    moe = cfg.moe and dataclasses.replace(
        cfg.moe, expert_width=len(shard.expert_cols), shared_width=len(shard.shared_cols),
        local_experts=shard.experts)
    return dataclasses.replace(cfg, num_heads=len(shard.q_heads),
                               num_kv_heads=len(shard.kv_heads), q_per_kv=shard.q_per_kv,
                               intermediate_size=len(shard.mlp), moe=moe)


def check_tensor_parallel(cfg: ModelConfig, family: ModelFamily, tp_size: int,
                          moe_split: str = "auto") -> None:
    """A sentence (ValueError) for a model --tp-size cannot split."""
    if tp_size == 1:
        return
    if family.name not in TP_FAMILIES:
        raise ValueError(f"--tp-size {tp_size}: tensor parallelism runs the Llama, Mistral, "
                         "Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2/V3 and Gemma "
                         f"3 families so far, not {cfg.model_type} (use --pp-size to spread it "
                         "over processes)")
    if cfg.moe is not None:
        check_moe_split(cfg, tp_size, moe_split)
    if tp_size > cfg.num_heads:
        raise ValueError(f"--tp-size {tp_size} is larger than the model's {cfg.num_heads} "
                         "attention heads: every rank needs at least one head")
    if tp_size > cfg.intermediate_size:
        raise ValueError(f"--tp-size {tp_size} is larger than the model's MLP width "
                         f"{cfg.intermediate_size}")


def check_moe_split(cfg: ModelConfig, tp_size: int, moe_split: str) -> None:
    """Every rank needs an expert (split by expert) or columns of each (by width, and of a
    shared expert either way)."""
    moe, split = cfg.moe, resolve_moe_split(moe_split, cfg, tp_size)[0]
    if split == "expert" and moe.num_experts < tp_size:
        raise ValueError(f"--tp-moe-split expert: the model's {moe.num_experts} experts are "
                         f"fewer than --tp-size {tp_size} ranks; use --tp-moe-split width")
    width = min(moe.expert_width if split == "width" else tp_size, moe.shared_width or tp_size)
    if tp_size > width:
        raise ValueError(f"--tp-size {tp_size} is larger than the experts' width {width}")


class ShardedSource:
    """A WeightSource as one TP rank sees it: the split tensors cut to the rank's rows or
    columns (shape, load, load_rows), the rest whole, and the rank's config; GGUF blocks kept
    are cut likewise (quant_linear)."""

    def __init__(self, source, shard: TPShard):
        self.source, self.shard = source, shard
        self.path, self.family, self.gguf = source.path, source.family, source.gguf
        # FP8 checkpoints read dequantized under TP (loader.stage_keeps_blocks): load_rows
        # dequantizes whole blocks before the cut, so a cut need not fall on the 128 grid.
        self.fp8 = source.fp8
        self.config = shard_config(source.config, shard)
        self.head_dim, self.mla = source.config.head_dim, source.config.mla

    def _cut(self, name: str) -> tuple[int, range] | None:
        """(dimension, kept indices) of a split tensor; None for a whole one."""
        if name in (self.family.embed_name, self.family.lm_head_name):
            return 0, self.shard.vocab
        expert = EXPERT_MATRIX.search(name)
        if expert is not None:  # whole experts under the expert split
            return ((EXPERT_DIM[expert.group(1)], self.shard.expert_cols)
                    if self.shard.moe_split == "width" else None)
        for suffix, (dim, head_rows) in (LATENT_SPLITS.items() if self.mla else ()):
            if name.endswith(suffix):
                return dim, self.shard.rows("q", head_rows(self.mla))
        for suffix, (split, dim) in SPLITS.items():
            if name.endswith(suffix):
                return dim, self.shard.rows(split, self.head_dim)
        return None

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def shape(self, name: str) -> tuple[int, ...]:
        shape, cut = self.source.shape(name), self._cut(name)
        if cut is None:
            return shape
        dim, kept = cut
        return shape[:dim] + (len(kept),) + shape[dim + 1:]

    def load(self, name: str) -> torch.Tensor:
        return self._slice(name, self.source.load(name))

    def row_blocks(self, name: str, shape: tuple[int, ...]) -> list[tuple[int, int]]:
        if self.gguf is not None and self._cut(name) is not None:
            return [(0, shape[0])]  # load_rows reads the whole tensor: once
        return self.source.row_blocks(name, shape)

    def load_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        cut = self._cut(name)
        if cut is None:
            return self.source.load_rows(name, start, end)
        dim, kept = cut
        if self.gguf is not None:  # GGUF rows are read whole (rotary reorder, block rows)
            return self.load(name)[start:end]
        if dim == 0:
            return self.source.load_rows(name, kept.start + start, kept.start + end)
        return self.source.load_rows(name, start, end)[:, kept.start:kept.stop].contiguous()

    def _slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        cut = self._cut(name)
        if cut is None:
            return tensor
        dim, kept = cut
        return tensor.narrow(dim, kept.start, len(kept)).contiguous()

    def quant_linear(self, names, disable=(), max_rows: int = 32, order=None):
        """The rank's slices of the named GGUF matrices kept as blocks (QuantLinear, laid out
        for the decode kernel per shard: the 16-row layout pads the rank's own rows), or None
        (loaded dequantized) where a type is not kept or a row-parallel cut falls inside a
        block. A column-parallel cut takes whole rows of blocks; a row-parallel one whole
        blocks of every row (o_proj by heads, down by MLP columns). order: the rank's
        stacked rows then in this order (WeightSource.quant_linear's)."""
        if self.gguf is None:
            return None  # FP8 checkpoints load dequantized under TP (stage_keeps_blocks)
        parts, width = [], None
        for name in names:
            held = self.source.gguf_blocks(name)
            if held is None:
                return None
            raw, qtype = held
            cut = self._cut(name)
            if cut is None:
                parts.append((raw, qtype))
                continue
            dim, kept = cut
            if dim == 0:
                parts.append((raw[kept.start:kept.stop], qtype))
                continue
            if kept.start % block_weights(qtype) or not supports(qtype, len(kept)):
                return None
            start = row_bytes(qtype, kept.start)
            parts.append((raw[:, start:start + row_bytes(qtype, len(kept))], qtype))
            width = len(kept)
        in_features = width or self.source.shape(names[0])[1]
        return QuantLinear.from_parts(parts, in_features, max_rows=max_rows, disable=disable,
                                      order=order)

    def tensor_type(self, name: str) -> str:
        return self.source.tensor_type(name)

    def is_fp8(self, name: str) -> bool:
        return self.source.is_fp8(name)


class TPOps:
    """A TP rank's collectives as its StageModel calls them. `comm` sums and gathers over the
    stage's ranks: all_reduce_(t) in place, all_gather(t) -> [ranks, *t.shape], every rank the
    same bits (runtime/tp.py's TPLink)."""

    def __init__(self, comm, shard: TPShard, vocab_size: int,
                 straddled: StraddledHead | None = None):
        self.comm, self.size = comm, shard.size
        self.vocab = shard.vocab
        self.straddled = straddled  # the decode step may split its keys (shared_head.py)
        self.vocab_shares = shares(vocab_size, shard.size)

    def sum_(self, partial: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce_(partial)

    def bind_sum(self, partial: torch.Tensor):
        """sum_(partial) as a call without arguments: the comm's own bound sum where it has
        one (TPLink.bind_sum: its checks done once), else a plain call."""
        bind = getattr(self.comm, "bind_sum", None)
        return bind(partial) if bind is not None else lambda: self.sum_(partial)

    def embed(self, ids: torch.Tensor, rows, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The embedding of `ids` from every rank's `rows` (this rank's vocabulary share, a
        tensor or GGUF blocks whose looked-up rows are dequantized into `dtype`): each rank
        looks up its own ids, zeros for the others, and the ranks sum (exact: every value is
        one rank's plus zeros)."""
        mine = (ids >= self.vocab.start) & (ids < self.vocab.stop)
        local = torch.where(mine, ids - self.vocab.start, 0)
        x = (torch.nn.functional.embedding(local, rows) if isinstance(rows, torch.Tensor)
             else rows.rows(local, dtype))
        x[~mine] = 0
        return self.sum_(x)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's share of the logits ([rows, its vocabulary]) -> [rows, vocab]."""
        width = len(self.vocab_shares[0])  # the widest share: every rank sends this many
        if logits.shape[1] < width:
            logits = torch.nn.functional.pad(logits, (0, width - logits.shape[1]))
        parts = self.comm.all_gather(logits.contiguous())
        return torch.cat([parts[r, :, :len(share)] for r, share in
                          enumerate(self.vocab_shares)], dim=1)
