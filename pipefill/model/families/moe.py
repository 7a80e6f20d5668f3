"""Mixture-of-experts families on the Llama layer: Qwen3-MoE, Qwen2-MoE and Mixtral.

Attention is the Llama family's (Qwen3-MoE with per-head q/k norms, Qwen2-MoE with q/k/v bias,
Mixtral plain); the MLP of a sparse layer is model/moe.py's MoEBlock: a router, the routed
experts packed at load (gate and up stacked per expert), and for Qwen2-MoE a shared expert
behind a sigmoid gate. Layers a config keeps dense (Qwen's `mlp_only_layers`, or those
`decoder_sparse_step` skips) keep the SwiGLU MLP.

Checkpoints store one tensor per expert (Hugging Face's published layout); a config naming a
router or expert layout these rules do not cover is refused with a sentence.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from pipefill.model.config import ModelConfig, MoEConfig
from pipefill.model.family import WeightReader
from pipefill.model.families.llama import LlamaFamily
from pipefill.model.moe import Experts, MoEBlock, RouterSpec, SharedExpert

# model_type -> the dense model_type whose attention it shares.
ATTENTION_OF = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mistral"}
ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
                 "MixtralForCausalLM": "mixtral"}
# Router or expert options these families do not implement: (config key, the value they
# implement, what the option does).
UNSUPPORTED = (("scoring_func", "softmax", "router scoring"),
               ("topk_method", "greedy", "top-k method"),
               ("hidden_act", "silu", "expert activation"))


class MoEFamily(LlamaFamily):
    name = "moe"
    hf_model_types = tuple(ATTENTION_OF)
    hf_architectures = tuple(ARCHITECTURES)
    gguf_architectures = {}  # GGUF mixture-of-experts files are not read yet

    def config_from_hf(self, d: dict) -> ModelConfig:
        model_type = d.get("model_type") or next(
            ARCHITECTURES[a] for a in d.get("architectures") or [] if a in ARCHITECTURES)
        for key, supported, what in UNSUPPORTED:
            if d.get(key, supported) != supported:
                raise ValueError(f"{model_type}: {what} {d[key]!r} is not supported (pipefill "
                                 f"runs {supported!r})")
        base = super().config_from_hf({**d, "model_type": ATTENTION_OF[model_type]})
        return replace(base, model_type=model_type, moe=moe_config(d, model_type))

    def mlp_tensor_names(self, cfg: ModelConfig, layer: int) -> list[str]:
        if not cfg.is_sparse(layer):
            return super().mlp_tensor_names(cfg, layer)
        names = [router_name(cfg, layer)]
        for e in range(cfg.moe.num_experts):
            names += expert_names(cfg, layer, e)
        if cfg.moe.shared_width:
            p = f"model.layers.{layer}.mlp."
            names += [p + f"shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")]
            names.append(p + "shared_expert_gate.weight")
        return names

    def load_mlp(self, cfg: ModelConfig, layer: int, read: WeightReader) -> dict:
        if not cfg.is_sparse(layer):
            return super().load_mlp(cfg, layer, read)
        moe = cfg.moe
        gate_ups, downs = [], []
        for e in range(moe.num_experts):
            gate, up, down = expert_names(cfg, layer, e)
            gate_ups.append(read.mat(gate, up))
            downs.append(read.mat(down))
        experts = Experts(torch.stack(gate_ups), torch.stack(downs))
        del gate_ups, downs
        shared = None
        if moe.shared_width:
            p = f"model.layers.{layer}.mlp."
            shared = SharedExpert(read.mat(p + "shared_expert.gate_proj.weight",
                                           p + "shared_expert.up_proj.weight"),
                                  read.mat(p + "shared_expert.down_proj.weight"),
                                  read.mat(p + "shared_expert_gate.weight"))
        block = MoEBlock(read.mat(router_name(cfg, layer)),
                         RouterSpec(moe.num_experts, moe.top_k, moe.normalize), experts, shared)
        return dict(gate_up=None, down=None, moe=block)

    def layer_costs(self, cfg: ModelConfig) -> list[float]:
        """Weights a token multiplies by in each layer: attention, then the dense MLP or the
        router, its top-k experts and the shared expert (a dense layer among sparse ones costs
        more or less than they do, so stages are balanced by this, not by layer count)."""
        h, moe = cfg.hidden_size, cfg.moe
        attention = h * (2 * cfg.q_size + 2 * cfg.kv_size)
        sparse = h * (moe.num_experts + 3 * moe.top_k * moe.expert_width + 3 * moe.shared_width)
        dense = 3 * h * cfg.intermediate_size
        return [float(attention + (sparse if cfg.is_sparse(i) else dense))
                for i in range(cfg.num_layers)]

    def gguf_name(self, hf_name: str) -> str:
        raise ValueError("GGUF mixture-of-experts files are not read yet")

    def decode_runner(self, model):
        return None  # the lean decode path is the dense Llama layer's


def moe_config(d: dict, model_type: str) -> MoEConfig:
    layers = d["num_hidden_layers"]
    if model_type == "mixtral":
        return MoEConfig(num_experts=d["num_local_experts"], top_k=d["num_experts_per_tok"],
                         expert_width=d["intermediate_size"], normalize=True,
                         sparse_layers=(True,) * layers)
    step = d.get("decoder_sparse_step", 1) or 1
    dense = set(d.get("mlp_only_layers") or [])
    # Published configs say num_experts; transformers 5 writes num_local_experts.
    experts = d.get("num_experts") or d.get("num_local_experts") or 0
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                   for i in range(layers))
    return MoEConfig(num_experts=experts, top_k=d["num_experts_per_tok"],
                     expert_width=d["moe_intermediate_size"],
                     normalize=bool(d.get("norm_topk_prob", model_type == "qwen3_moe")),
                     sparse_layers=sparse,
                     shared_width=d.get("shared_expert_intermediate_size", 0) or 0
                     if model_type == "qwen2_moe" else 0)


def router_name(cfg: ModelConfig, layer: int) -> str:
    mlp = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
    return f"model.layers.{layer}.{mlp}.gate.weight"


def expert_names(cfg: ModelConfig, layer: int, e: int) -> tuple[str, str, str]:
    """(gate, up, down) of expert e, as the published checkpoints name them."""
    if cfg.model_type == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{e}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


MOE = MoEFamily()
