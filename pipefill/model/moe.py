"""Mixture-of-experts MLP: a router picks top-k experts per token, the tokens are grouped by
expert with one sort, each expert's rows go through its two GEMMs at once, and the outputs come
back to their tokens weighted by the router (ARCHITECTURE.md, 'Mixture-of-experts layers').

Grouping by sort rather than by a mask per expert: one argsort of the (tokens x k) expert ids
gives every expert a contiguous run of rows, so each expert costs two GEMMs of its own rows and
the whole layer reads each expert's weights once — in decode too, however many sequences of the
batch route to the same expert, and never an expert no token chose.

Each expert's GEMMs run on the copies the loader made once (`pack_decode`, `reorder_prefill`):
an expert with few rows (a decode step, or a rarely chosen expert in a prefill chunk) on the
packed small-M decode GEMM, one with more on the prefill GEMM (oneDNN's layout where the stage
uses it, else F.linear) — the same choice `model.layers.linear` makes for dense layers. Experts
read quantized (an FP8 checkpoint's, kernels.quant_gemm.QuantLinear) are their own decode copy
and dequantize per call for more rows (`Experts.held`); nothing is packed or reordered for them.

The routers of Qwen2-MoE, Qwen3-MoE and Mixtral are one rule: softmax over all experts in
float32, top-k, and (Mixtral always, the Qwens with `norm_topk_prob`) the k weights renormalised
to sum to one (for Mixtral this equals a softmax over its top-k logits). Qwen2-MoE adds a shared
expert that every token passes, scaled by a sigmoid gate of its own; that gate's row is stacked
under the router's, so router and gate are one GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from pipefill.model.attention import profiled
from pipefill.model.layers import linear

# The name of the experts' range in a profile (bench/time_split.py sums it).
EXPERTS_RANGE = "pipefill::moe_experts"


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    normalize: bool  # renormalise the top-k weights to sum to one

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"a router choosing {self.top_k} of {self.num_experts} experts: "
                             "top-k must be between 1 and the number of experts")


@dataclass
class ExpertLinears:
    """One matrix of every expert, as the GEMMs read it: the plain (experts, N, K) stack
    (None once moved into oneDNN's layout), and per expert its decode and prefill copies."""
    plain: torch.Tensor | None
    packed: list | None = None  # kernels.decode_gemm.PackedLinear per expert
    prefill: list | None = None  # kernels.prefill_gemm.OneDnnLinear per expert

    def __call__(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return linear(x, None if self.plain is None else self.plain[e], None,
                      None if self.packed is None else self.packed[e],
                      None if self.prefill is None else self.prefill[e])

    def expert_bytes(self, decode: bool) -> int:
        """Bytes one expert's matrix costs to read (its decode copy where there is one)."""
        if decode and self.packed is not None:
            return self.packed[0].nbytes
        if self.plain is not None:
            return self.plain[0].numel() * self.plain.element_size()
        return self.prefill[0].nbytes


@dataclass
class Experts:
    """Every expert's weights: gate and up stacked row-wise (one GEMM per expert instead of
    two), down separate."""
    gate_up: torch.Tensor | None  # (experts, 2 * width, hidden); None once reordered
    down: torch.Tensor | None  # (experts, hidden, width)
    num_experts: int = field(init=False)
    width: int = field(init=False)
    linears: tuple[ExpertLinears, ExpertLinears] = field(init=False)
    # The router's id of expert 0 here: a tensor-parallel rank split by expert holds the
    # experts first .. first + num_experts - 1 only (model/tensor_parallel.py).
    first: int = field(default=0, kw_only=True)

    def __post_init__(self):
        if self.down is None:  # held quantized: `held` sets the fields
            return
        self.num_experts, self.width = self.down.shape[0], self.down.shape[2]
        self.linears = (ExpertLinears(self.gate_up), ExpertLinears(self.down))

    @classmethod
    def pack(cls, gates: list[torch.Tensor], ups: list[torch.Tensor],
             downs: list[torch.Tensor]) -> "Experts":
        if not (len(gates) == len(ups) == len(downs)) or not gates:
            raise ValueError("every expert needs a gate, an up and a down projection")
        return cls(torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)]),
                   torch.stack(downs))

    @classmethod
    def read(cls, reader, names: list[tuple[str, str, str]]) -> "Experts":
        """Every expert's (gate, up, down) matrices by name, through a family's WeightReader
        (model/family.py), gate and up stacked as they are read: its linear layers, held
        quantized where the reader keeps them so (all of them, or else none)."""
        gate_ups = [reader.linear(gate, up) for gate, up, _ in names]
        downs = [reader.linear(down) for _, _, down in names]
        plain = [m for m in gate_ups + downs if isinstance(m, torch.Tensor)]
        if not plain:
            return cls.held(gate_ups, downs)
        gate_ups, downs = ([m if isinstance(m, torch.Tensor) else m.dequantize(plain[0].dtype)
                            for m in ms] for ms in (gate_ups, downs))
        return cls(torch.stack(gate_ups), torch.stack(downs))

    @classmethod
    def held(cls, gate_ups: list, downs: list) -> "Experts":
        """Experts whose matrices are quantized linears (QuantLinear): each its own decode
        copy, dequantized per call for prefill-sized rows."""
        experts = cls(None, None)
        experts.num_experts, experts.width = len(downs), downs[0].in_features
        experts.linears = tuple(ExpertLinears(None, list(ms), [m.prefill for m in ms])
                                for ms in (gate_ups, downs))
        return experts

    def run(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """down_e(silu(gate_e(rows)) * up_e(rows))."""
        gate_up, down = self.linears
        h = gate_up(e, rows)
        return down(e, F.silu(h[:, :self.width]).mul_(h[:, self.width:]))

    def expert_bytes(self, decode: bool = True) -> int:
        return sum(m.expert_bytes(decode) for m in self.linears)


def route(x: torch.Tensor, router: torch.Tensor, spec: RouterSpec, packed=None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), each (tokens, k): the router's choice for every row of x.
    `router` may carry extra rows after the experts' (a shared expert's gate): they are
    ignored here. Ties go to the lower expert id, as torch.topk (and so HF) breaks them."""
    logits = linear(x, router, None, packed)
    return choose(logits[:, :spec.num_experts], spec, x.dtype)


def choose(logits: torch.Tensor, spec: RouterSpec, dtype: torch.dtype):
    """softmax in float32, top-k, renormalised where the spec says: torch ops, which cost
    about 1% of a decode step of the qwen3-30b-a3b shape (`bench decode` prints the share)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def group_by_expert(ids: torch.Tensor, num_experts: int
                    ) -> tuple[torch.Tensor, list[int]]:
    """The (token, choice) slots sorted by expert, as flat indices into ids.view(-1), and how
    many rows each expert got (a stable sort: an expert's rows stay in token order)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def experts_forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: Experts) -> torch.Tensor:
    """sum over the chosen experts e of weight_e * down_e(silu(gate_e(x)) * up_e(x)), over
    the experts held here (all of them but on a rank split by expert: its own experts'
    slots are a contiguous run of the sorted ones, the rest contribute zeros)."""
    k, first = ids.shape[1], experts.first
    order, counts = group_by_expert(ids, first + experts.num_experts)
    skipped = sum(counts[:first])
    counts = counts[first:first + experts.num_experts]
    order = order[skipped:skipped + sum(counts)]
    token = order // k
    rows = x.index_select(0, token)
    out_rows = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        end = start + n
        out_rows[start:end] = experts.run(e, rows[start:end])
        start = end
    out_rows *= weights.reshape(-1).index_select(0, order).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token, out_rows)


@dataclass
class SharedExpert:
    """An expert every token passes (Qwen2-MoE), scaled by sigmoid(gate · x) when gated (the
    gate's logit is computed with the router's, see MoEBlock)."""
    gate_up: torch.Tensor | None  # (2 * width, hidden)
    down: torch.Tensor | None  # (hidden, width)
    gate: torch.Tensor | None = None  # (1, hidden)
    packed: dict = field(default_factory=dict)  # "gate_up", "down": decode copies
    prefill: dict = field(default_factory=dict)  # "gate_up", "down": oneDNN copies

    def __call__(self, x: torch.Tensor, gate_logit: torch.Tensor | None = None) -> torch.Tensor:
        h = linear(x, self.gate_up, None, self.packed.get("gate_up"), self.prefill.get("gate_up"))
        width = h.shape[1] // 2
        y = linear(F.silu(h[:, :width]).mul_(h[:, width:]), self.down, None,
                   self.packed.get("down"), self.prefill.get("down"))
        if gate_logit is None and self.gate is not None:
            gate_logit = F.linear(x, self.gate)
        return y if gate_logit is None else torch.sigmoid(gate_logit) * y

    def nbytes(self, decode: bool = True) -> int:
        total = 0
        for name in ("gate_up", "down"):
            copy = (self.packed.get(name) if decode else None) or self.prefill.get(name)
            plain = getattr(self, name)
            total += copy.nbytes if copy is not None else plain.numel() * plain.element_size()
        return total


@dataclass
class MoEBlock:
    """One sparse MLP layer: router, routed experts, and an optional shared expert. The
    shared expert's gate row is stacked under the router (`router` is then experts + 1 rows)."""
    router: torch.Tensor  # (experts [+ 1], hidden)
    spec: RouterSpec
    experts: Experts
    shared: SharedExpert | None = None
    router_packed: object | None = None  # kernels.decode_gemm.PackedLinear of `router`
    # The expert ids of the last call: the decode bench counts the distinct experts a step read.
    last_ids: torch.Tensor | None = None
    # (logits [rows, experts], spec, dtype) -> (weights, ids), each [rows, k]: `choose` (the
    # softmax top-k) unless a family routes otherwise (DeepSeek's grouped routers).
    rule: Callable | None = None

    def __post_init__(self):
        if self.shared is not None and self.shared.gate is not None \
                and self.router.shape[0] == self.spec.num_experts:
            self.router = torch.cat([self.router, self.shared.gate])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = linear(x, self.router, None, self.router_packed)
        weights, ids = (self.rule or choose)(logits[:, :self.spec.num_experts], self.spec,
                                             x.dtype)
        self.last_ids = ids
        with profiled(EXPERTS_RANGE):
            out = experts_forward(x, weights, ids, self.experts)
        if self.shared is not None:
            gate = logits[:, self.spec.num_experts:] if self.shared.gate is not None else None
            out = out + self.shared(x, gate)
        return out.reshape(shape)

    def expert_bytes_read(self, ids: torch.Tensor) -> int:
        """Bytes of routed-expert weights a step with these choices reads: each distinct
        expert once (the decode floor's expert term)."""
        return torch.unique(ids).numel() * self.experts.expert_bytes(decode=True)

    def fixed_bytes_read(self) -> int:
        """Bytes every step reads whatever the routing: the router (and shared gate) and the
        shared expert."""
        router = (self.router_packed.nbytes if self.router_packed is not None
                  else self.router.numel() * self.router.element_size())
        return router + (self.shared.nbytes() if self.shared is not None else 0)

    def pack_decode(self, pack) -> int:
        """Decode copies (pack: matrix -> PackedLinear or None) of the router, every expert's
        two matrices and the shared expert's; returns their bytes."""
        total = 0
        self.router_packed = pack(self.router)
        for m in self.experts.linears:
            if m.plain is None:  # held quantized (Experts.held)
                continue
            m.packed = [pack(w) for w in m.plain]
            if any(p is None for p in m.packed):
                m.packed = None
                continue
            total += sum(p.nbytes for p in m.packed)
        if self.shared is not None:
            for name in ("gate_up", "down"):
                self.shared.packed[name] = pack(getattr(self.shared, name))
            total += sum(p.nbytes for p in self.shared.packed.values() if p is not None)
        return total + (self.router_packed.nbytes if self.router_packed is not None else 0)

    def reorder_prefill(self, reorder) -> int:
        """Moves every expert's matrices (and the shared expert's) into the prefill GEMM's
        layout (reorder: matrix -> OneDnnLinear) and drops the plain stacks; returns bytes."""
        total = 0
        for m in self.experts.linears:
            if m.plain is None:  # held quantized (Experts.held)
                continue
            m.prefill = [reorder(w) for w in m.plain]
            m.plain = None
            total += sum(p.nbytes for p in m.prefill)
        self.experts.gate_up = self.experts.down = None
        if self.shared is not None:
            for name in ("gate_up", "down"):
                self.shared.prefill[name] = reorder(getattr(self.shared, name))
                setattr(self.shared, name, None)
            total += sum(p.nbytes for p in self.shared.prefill.values())
        return total
