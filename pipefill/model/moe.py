"""Mixture-of-experts MLP: a router picks top-k experts per token, the tokens are grouped by
expert with one sort, each expert's rows go through its two GEMMs at once, and the outputs come
back to their tokens weighted by the router.

Grouping by sort rather than by a mask per expert: one argsort of the (tokens x k) expert ids
gives every expert a contiguous run of rows, so each expert costs two GEMMs of its own rows and
the whole layer reads each expert's weights once — in decode too, however many sequences of the
batch route to the same expert, and never an expert no token chose.

The routers of Qwen2-MoE, Qwen3-MoE and Mixtral are one rule: softmax over all experts in
float32, top-k, and (Mixtral always, the Qwens with `norm_topk_prob`) the k weights renormalised
to sum to one (for Mixtral this equals a softmax over its top-k logits). Qwen2-MoE adds a shared
expert that every token passes, scaled by a sigmoid gate of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
class Experts:
    """Every expert's weights packed once at load: gate and up stacked row-wise (one GEMM per
    expert instead of two), down separate."""
    gate_up: torch.Tensor  # (experts, 2 * width, hidden)
    down: torch.Tensor  # (experts, hidden, width)

    @classmethod
    def pack(cls, gates: list[torch.Tensor], ups: list[torch.Tensor],
             downs: list[torch.Tensor]) -> "Experts":
        if not (len(gates) == len(ups) == len(downs)) or not gates:
            raise ValueError("every expert needs a gate, an up and a down projection")
        return cls(torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)]),
                   torch.stack(downs))

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def width(self) -> int:
        return self.down.shape[2]


def route(x: torch.Tensor, router: torch.Tensor, spec: RouterSpec
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), each (tokens, k): the router's choice for every row of x."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


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
    """sum over the chosen experts e of weight_e * down_e(silu(gate_e(x)) * up_e(x))."""
    k = ids.shape[1]
    order, counts = group_by_expert(ids, experts.num_experts)
    token = order // k
    rows = x.index_select(0, token)
    out_rows = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        end = start + n
        gate, up = F.linear(rows[start:end], experts.gate_up[e]).chunk(2, dim=-1)
        out_rows[start:end] = F.linear(F.silu(gate) * up, experts.down[e])
        start = end
    out_rows *= weights.reshape(-1).index_select(0, order).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token, out_rows)


@dataclass
class SharedExpert:
    """An expert every token passes (Qwen2-MoE), scaled by sigmoid(gate · x) when gated."""
    gate_up: torch.Tensor  # (2 * width, hidden)
    down: torch.Tensor  # (hidden, width)
    gate: torch.Tensor | None = None  # (1, hidden)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x, self.gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, self.down)
        return y if self.gate is None else torch.sigmoid(F.linear(x, self.gate)) * y


@dataclass
class MoEBlock:
    """One sparse MLP layer: router, routed experts, and an optional shared expert."""
    router: torch.Tensor  # (experts, hidden)
    spec: RouterSpec
    experts: Experts
    shared: SharedExpert | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = route(x, self.router, self.spec)
        out = experts_forward(x, weights, ids, self.experts)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(shape)

    def expert_bytes_read(self, ids: torch.Tensor) -> int:
        """Bytes of routed-expert weights a step with these choices reads: each distinct
        expert once (the decode floor's expert term)."""
        distinct = torch.unique(ids).numel()
        per = self.experts.gate_up[0].numel() + self.experts.down[0].numel()
        return distinct * per * self.experts.gate_up.element_size()
