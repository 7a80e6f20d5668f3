"""Mixture-of-experts families on the Llama layer: Qwen3-MoE, Qwen2-MoE and Mixtral.

Attention is the Llama family's (Qwen3-MoE with per-head q/k norms, Qwen2-MoE with q/k/v bias,
Mixtral plain); the MLP of a sparse layer is model/moe.py's MoEBlock: a router, the routed
experts packed at load (gate and up stacked per expert), and for Qwen2-MoE a shared expert
behind a sigmoid gate. Layers a config keeps dense (Qwen's `mlp_only_layers`, or those
`decoder_sparse_step` skips) keep the SwiGLU MLP.

Hugging Face checkpoints store one tensor per expert (the published layout); GGUF files stack
a layer's experts into one tensor per projection (`blk.N.ffn_{gate,up,down}_exps`, read one
expert at a time) next to the router (`ffn_gate_inp`) and the shared expert (`ffn_*_shexp`,
gated by `ffn_gate_inp_shexp`), as llama.cpp's converter writes them; Mixtral is a "llama" GGUF
with `llama.expert_count`. A checkpoint naming a router or expert layout these rules do not
cover is refused with a sentence.
"""
from __future__ import annotations

from dataclasses import replace

from pipefill.model.config import ModelConfig, MoEConfig
from pipefill.model.decode_step import DecodeRunner
from pipefill.model.family import WeightReader
from pipefill.model.families.llama import GGUF_LAYER_NAMES, LlamaFamily
from pipefill.model.gguf_file import gguf_expert_tensor, gguf_layer_name
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

# GGUF general.architecture -> model_type (llama.cpp writes Mixtral as "llama" with experts).
GGUF_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral"}
# Whether llama.cpp renormalises an architecture's top-k weights when the file does not say
# ({arch}.expert_weights_norm): Qwen2-MoE does not, Qwen3-MoE and Mixtral do.
GGUF_NORMALIZE = {"qwen3moe": True, "qwen2moe": False, "llama": True}
# Hugging Face MoE tensor names (after model.layers.{i}.) -> GGUF names (after blk.{i}.).
GGUF_MOE_NAMES = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# An expert's projection (Qwen names, Mixtral's w1/w3/w2) -> the GGUF tensor stacking it.
GGUF_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                     "down_proj": "ffn_down_exps.weight", "w1": "ffn_gate_exps.weight",
                     "w3": "ffn_up_exps.weight", "w2": "ffn_down_exps.weight"}
# Every layer tensor (after blk.{i}.) a mixture-of-experts GGUF may hold.
GGUF_KNOWN = (set(GGUF_LAYER_NAMES.values()) | set(GGUF_MOE_NAMES.values())
              | set(GGUF_EXPERT_NAMES.values()))
GGUF_SOFTMAX = 1  # llama.cpp's expert_gating_func for a softmax router


class MoEFamily(LlamaFamily):
    name = "moe"
    hf_model_types = tuple(ATTENTION_OF)
    hf_architectures = tuple(ARCHITECTURES)
    gguf_architectures = GGUF_ARCHITECTURES
    gguf_experts = True
    layout_hint = (" (pipefill reads one tensor per expert, as in "
                   "model.layers.N.mlp.experts.E.gate_proj.weight; experts fused into one "
                   "tensor are not read)")

    def config_from_hf(self, d: dict) -> ModelConfig:
        model_type = d.get("model_type") or next(
            ARCHITECTURES[a] for a in d.get("architectures") or [] if a in ARCHITECTURES)
        for key, supported, what in UNSUPPORTED:
            if d.get(key, supported) != supported:
                raise ValueError(f"{model_type}: {what} {d[key]!r} is not supported (pipefill "
                                 f"runs {supported!r})")
        base = super().config_from_hf({**d, "model_type": ATTENTION_OF[model_type]})
        return replace(base, model_type=model_type, moe=moe_config(d, model_type))

    def config_from_gguf(self, gguf) -> ModelConfig:
        check_gguf_layout(gguf)
        base = super().config_from_gguf(gguf)
        return replace(base, moe=gguf_moe_config(gguf, base.num_layers))

    def mlp_tensor_names(self, cfg: ModelConfig, layer: int) -> list[str]:
        if not cfg.is_sparse(layer):
            return super().mlp_tensor_names(cfg, layer)
        names = [router_name(cfg, layer)]
        for e in cfg.moe.held_experts:
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
        held = moe.held_experts  # a tensor-parallel rank split by expert: its own
        experts = Experts.read(read, [expert_names(cfg, layer, e) for e in held])
        experts.first = held.start
        shared = None
        if moe.shared_width:
            p = f"model.layers.{layer}.mlp."
            # The gate is (1, hidden); a GGUF file may keep it as a vector.
            shared = SharedExpert(read.mat(p + "shared_expert.gate_proj.weight",
                                           p + "shared_expert.up_proj.weight"),
                                  read.mat(p + "shared_expert.down_proj.weight"),
                                  read.mat(p + "shared_expert_gate.weight").reshape(1, -1))
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
        return gguf_layer_name(hf_name, {**GGUF_LAYER_NAMES, **GGUF_MOE_NAMES})

    def gguf_tensor(self, hf_name: str) -> tuple[str, int | None]:
        return gguf_expert_tensor(hf_name, GGUF_EXPERT_NAMES) or (self.gguf_name(hf_name), None)

    def decode_runner(self, model):
        """The lean decode path, its MLP the sparse block in sparse layers, with the per-head
        q/k norms of Qwen3-MoE (model/decode_step.py)."""
        return DecodeRunner(model) if DecodeRunner.supports(model, qk_norm=True) else None


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


def check_gguf_layout(gguf) -> None:
    """A sentence for a GGUF file whose router or experts these families would misread: a
    router other than softmax, scaled expert weights, or a layer tensor they do not know
    (per-expert tensors of older converters, fused gate-up experts, router biases, ...)."""
    where = f"GGUF file {gguf.path} ({gguf.arch})"
    gating = gguf.arch_field("expert_gating_func", GGUF_SOFTMAX)
    if gating != GGUF_SOFTMAX:
        raise ValueError(f"{where}: expert gating function {gating} is not supported (pipefill "
                         f"runs the softmax router, {GGUF_SOFTMAX})")
    scale = gguf.arch_field("expert_weights_scale", 1.0)
    if scale not in (0.0, 1.0):
        raise ValueError(f"{where}: expert weights scaled by {scale} are not supported")
    for name in gguf.tensors:
        if name.startswith("blk.") and name.split(".", 2)[2] not in GGUF_KNOWN:
            raise ValueError(
                f"{where}: tensor {name} names a router or expert layout pipefill does not "
                "read; it reads ffn_gate_inp, ffn_{gate,up,down}_exps (all experts stacked), "
                "ffn_{gate,up,down}_shexp and ffn_gate_inp_shexp, as llama.cpp's converter "
                "writes them today")


def gguf_moe_config(gguf, num_layers: int) -> MoEConfig:
    """The MoEConfig of a GGUF file: expert counts from its metadata, the sparse layers by
    their router tensor (a layer without one keeps its dense MLP), widths from the tensors."""
    experts, top_k = gguf.arch_field("expert_count"), gguf.arch_field("expert_used_count")
    sparse = tuple(gguf.has(f"blk.{i}.ffn_gate_inp.weight") for i in range(num_layers))
    if not experts or not top_k or not any(sparse):
        raise ValueError(f"GGUF file {gguf.path} ({gguf.arch}): a mixture-of-experts file "
                         f"needs {gguf.arch}.expert_count, {gguf.arch}.expert_used_count and "
                         "a router (blk.N.ffn_gate_inp.weight) in at least one layer")
    first = sparse.index(True)
    width = gguf_width(gguf, f"blk.{first}.ffn_gate_exps.weight", "expert_feed_forward_length",
                       dim=1)
    shared = (gguf_width(gguf, f"blk.{first}.ffn_gate_shexp.weight",
                         "expert_shared_feed_forward_length", dim=0)
              if gguf.has(f"blk.{first}.ffn_gate_shexp.weight") else 0)
    normalize = gguf.arch_field("expert_weights_norm", GGUF_NORMALIZE[gguf.arch])
    return MoEConfig(num_experts=experts, top_k=top_k, expert_width=width,
                     normalize=bool(normalize), sparse_layers=sparse, shared_width=shared)


def gguf_width(gguf, tensor: str, key: str, dim: int) -> int:
    """An expert's width from its tensor's shape, checked against the metadata key when the
    file has it (Mixtral files state only feed_forward_length)."""
    if not gguf.has(tensor):
        raise ValueError(f"GGUF file {gguf.path} ({gguf.arch}): {tensor} is missing")
    width = gguf.shape(tensor)[dim]
    stated = gguf.arch_field(key)
    if stated is not None and stated != width:
        raise ValueError(f"GGUF file {gguf.path}: {gguf.arch}.{key} is {stated} but {tensor} "
                         f"is {width} wide: the file does not fit its metadata")
    return width


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
