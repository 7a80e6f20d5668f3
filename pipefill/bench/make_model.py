"""`pipefill bench make-model`: a random-weight checkpoint with a real model's shapes.

Benchmarks of large models (mixture-of-experts, latent attention) need their real shapes, not
their trained weights, and no model hub is reachable here. This writes a Hugging Face folder
(config.json, sharded safetensors with an index) in the layout the published checkpoints use
(one tensor per expert, the families' own names), so pipefill and HF transformers load it alike,
with as many layers as the memory allows. Weights are N(0, 0.02) (norms 1, biases and router
score corrections 0), drawn from --seed, so two runs write the same bytes. With --fp8 the
decoder layers' linear weights are written as DeepSeek-V3 and the -FP8 Qwen3 releases ship
them: float8 e4m3 codes with a float32 weight_scale_inv per 128 x 128 block (kernels.fp8_blocks:
the draws quantized), and config.json's quantization_config; `write_fp8_copy` turns any float
checkpoint folder into that layout.

The tensor names and shapes come from the family's own rules below; tests check them against
what transformers' save_pretrained writes for the same config.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from pipefill.bench import random_gguf
from pipefill.kernels import fp8_blocks

INIT_STD = 0.02
SHARD_BYTES = 2 << 30

def _deepseek_yarn(mscale: float) -> dict:
    """The published DeepSeek-V2(-Lite)/V3 rope: yarn x40 over a 4K context, softmax scaled by
    mscale_all_dim (model/families/deepseek.py)."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
            "mscale": mscale, "mscale_all_dim": mscale}


# Published shapes (config.json of each model). `layers` is the full depth; --layers cuts it.
LIKE = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, rope_theta=1e6,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        num_hidden_layers=48)),
    "qwen3-235b-a22b": ("Qwen3MoeConfig", dict(
        hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, rope_theta=1e6,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        num_hidden_layers=94)),
    "qwen1.5-moe-a2.7b": ("Qwen2MoeConfig", dict(
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408, num_experts=60,
        num_experts_per_tok=4, norm_topk_prob=False, shared_expert_intermediate_size=5632,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
        max_position_embeddings=8192, rope_theta=1e6, tie_word_embeddings=False,
        num_hidden_layers=24)),
    "mixtral-8x7b": ("MixtralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rope_theta=1e6,
        max_position_embeddings=32768, tie_word_embeddings=False, num_hidden_layers=32)),
    "deepseek-v2-lite": ("DeepseekV2Config", dict(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400,
        topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
        rope_parameters=_deepseek_yarn(mscale=0.707),
        max_position_embeddings=163840, tie_word_embeddings=False, num_hidden_layers=27)),
    "deepseek-v3": ("DeepseekV3Config", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3,
        n_group=8, topk_group=4, routed_scaling_factor=2.5, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, norm_topk_prob=True,
        rope_parameters=_deepseek_yarn(mscale=1.0),
        max_position_embeddings=163840, tie_word_embeddings=False, num_hidden_layers=61)),
    "smollm2-1.7b": ("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=49152, rope_theta=130000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=True, num_hidden_layers=24)),
    "llama-3.1-8b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=False, num_hidden_layers=32,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
}


def make_config(like: str, layers: int | None = None):
    import transformers
    cls_name, kw = LIKE[like]
    kw = dict(kw)
    if layers is not None:
        kw["num_hidden_layers"] = layers
    return getattr(transformers, cls_name)(**kw)


# ---- tensor names and shapes, per family (the published checkpoints' layout) -------------

def _mlp(prefix: str, hidden: int, width: int, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    return {f"{prefix}.{gate}.weight": (width, hidden), f"{prefix}.{up}.weight": (width, hidden),
            f"{prefix}.{down}.weight": (hidden, width)}


def _experts(prefix: str, hidden: int, width: int, count: int, names=None):
    out = {}
    for e in range(count):
        out.update(_mlp(f"{prefix}.{e}", hidden, width, names or ("gate_proj", "up_proj",
                                                                   "down_proj")))
    return out


def _gqa_attention(prefix: str, c, bias: bool, qk_norm: bool) -> dict:
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    out = {f"{prefix}.q_proj.weight": (q, c.hidden_size), f"{prefix}.k_proj.weight": (kv, c.hidden_size),
           f"{prefix}.v_proj.weight": (kv, c.hidden_size), f"{prefix}.o_proj.weight": (c.hidden_size, q)}
    if bias:
        out.update({f"{prefix}.q_proj.bias": (q,), f"{prefix}.k_proj.bias": (kv,),
                    f"{prefix}.v_proj.bias": (kv,)})
    if qk_norm:
        out.update({f"{prefix}.q_norm.weight": (d,), f"{prefix}.k_norm.weight": (d,)})
    return out


def _latent_attention(prefix: str, c) -> dict:
    """DeepSeek's multi-head latent attention (MLA)."""
    h, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    out = {}
    if c.q_lora_rank:
        out.update({f"{prefix}.q_a_proj.weight": (c.q_lora_rank, c.hidden_size),
                    f"{prefix}.q_a_layernorm.weight": (c.q_lora_rank,),
                    f"{prefix}.q_b_proj.weight": (h * qk, c.q_lora_rank)})
    else:
        out[f"{prefix}.q_proj.weight"] = (h * qk, c.hidden_size)
    out.update({
        f"{prefix}.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),
        f"{prefix}.kv_a_layernorm.weight": (c.kv_lora_rank,),
        f"{prefix}.kv_b_proj.weight": (h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        f"{prefix}.o_proj.weight": (c.hidden_size, h * c.v_head_dim)})
    return out


def _qwen_sparse(c, i: int) -> bool:
    step = getattr(c, "decoder_sparse_step", 1) or 1
    return i not in (getattr(c, "mlp_only_layers", None) or []) and c.num_experts > 0 and \
        (i + 1) % step == 0


def _deepseek_sparse(c, i: int) -> bool:
    freq = getattr(c, "moe_layer_freq", 1) or 1
    return c.n_routed_experts is not None and i >= c.first_k_dense_replace and i % freq == 0


def layer_shapes(c, i: int) -> dict[str, tuple[int, ...]]:
    p, h = f"model.layers.{i}", c.hidden_size
    out = {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
    kind = c.model_type
    if kind in ("deepseek_v2", "deepseek_v3"):
        out.update(_latent_attention(f"{p}.self_attn", c))
    else:
        out.update(_gqa_attention(f"{p}.self_attn", c, bias=kind in ("qwen2_moe", "qwen2"),
                                  qk_norm=kind in ("qwen3_moe", "qwen3")))
    if kind == "qwen3_moe" or kind == "qwen2_moe":
        if not _qwen_sparse(c, i):
            return out | _mlp(f"{p}.mlp", h, c.intermediate_size)
        out[f"{p}.mlp.gate.weight"] = (c.num_experts, h)
        out.update(_experts(f"{p}.mlp.experts", h, c.moe_intermediate_size, c.num_experts))
        if kind == "qwen2_moe" and c.shared_expert_intermediate_size:
            out.update(_mlp(f"{p}.mlp.shared_expert", h, c.shared_expert_intermediate_size))
            out[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
        return out
    if kind == "mixtral":
        out[f"{p}.block_sparse_moe.gate.weight"] = (c.num_local_experts, h)
        return out | _experts(f"{p}.block_sparse_moe.experts", h, c.intermediate_size,
                              c.num_local_experts, ("w1", "w3", "w2"))
    if kind in ("deepseek_v2", "deepseek_v3"):
        if not _deepseek_sparse(c, i):
            return out | _mlp(f"{p}.mlp", h, c.intermediate_size)
        out[f"{p}.mlp.gate.weight"] = (c.n_routed_experts, h)
        if kind == "deepseek_v3":
            out[f"{p}.mlp.gate.e_score_correction_bias"] = (c.n_routed_experts,)
        out.update(_experts(f"{p}.mlp.experts", h, c.moe_intermediate_size, c.n_routed_experts))
        if c.n_shared_experts:
            out.update(_mlp(f"{p}.mlp.shared_experts", h,
                            c.moe_intermediate_size * c.n_shared_experts))
        return out
    if kind in ("llama", "mistral", "qwen2", "qwen3"):
        return out | _mlp(f"{p}.mlp", h, c.intermediate_size)
    raise ValueError(f"make-model knows no tensor layout for model_type {kind!r}")


def checkpoint_shapes(c) -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        out.update(layer_shapes(c, i))
    out["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return out


# The linear weights FP8 releases quantize: every projection of a decoder layer (attention,
# MLP, experts, shared experts; Mixtral's w1/w2/w3), not routers, norms, embedding or head.
FP8_SUFFIXES = ("_proj.weight", "_proj_with_mqa.weight", ".w1.weight", ".w2.weight",
                ".w3.weight")


def is_fp8_weight(name: str, shape) -> bool:
    return name.startswith("model.layers.") and len(shape) == 2 and name.endswith(FP8_SUFFIXES)


def nbytes(shapes, dtype: torch.dtype, fp8: bool = False) -> int:
    """Bytes of the tensors in `dtype`; with fp8, FP8 weights 1 byte each plus their scales."""
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, s in shapes.items():
        if fp8 and is_fp8_weight(name, s):
            total += _numel(s) + 4 * _numel(fp8_blocks.grid_shape(*s))
        else:
            total += size * _numel(s)
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def layers_that_fit(like: str, dtype: torch.dtype, budget_bytes: int, fp8: bool = False) -> int:
    """The most layers (at least 1) whose checkpoint fits in budget_bytes."""
    c = make_config(like, layers=0)
    fixed = nbytes(checkpoint_shapes(c), dtype, fp8)
    full = LIKE[like][1]["num_hidden_layers"]
    per_layer = [nbytes(layer_shapes(make_config(like, layers=full), i), dtype, fp8)
                 for i in range(full)]
    total, n = fixed, 0
    for size in per_layer:
        if total + size > budget_bytes:
            break
        total, n = total + size, n + 1
    return max(n, 1)


# ---- writing -------------------------------------------------------------------------------

def random_tensor(name: str, shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith((".bias", "e_score_correction_bias")):
        return torch.zeros(shape, dtype=dtype)
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    step = 1 << 24  # float32 draws in 64 MiB pieces: the whole tensor never exists in float32
    for start in range(0, flat.numel(), step):
        piece = torch.randn(min(step, flat.numel() - start), generator=gen) * INIT_STD
        flat[start:start + piece.numel()] = piece.to(dtype)
    return out


def fp8_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors with every FP8 weight (is_fp8_weight) quantized: its codes under its name
    and its scales under name + "_scale_inv"."""
    out = {}
    for name, t in tensors.items():
        if is_fp8_weight(name, t.shape):
            out[name], out[name + fp8_blocks.SCALE_SUFFIX] = fp8_blocks.quantize(t)
        else:
            out[name] = t
    return out


def _write_fp8_config(folder: Path) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = dict(fp8_blocks.QUANT_CONFIG)
    path.write_text(json.dumps(config, indent=2))


def write_fp8_copy(src: Path, dst: Path) -> None:
    """A float checkpoint folder (safetensors) written again with its FP8 weights quantized
    (fp8_tensors) and config.json's quantization_config; other files copied as they are."""
    from safetensors.torch import load_file, save_file
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            save_file(fp8_tensors(load_file(str(f))), str(dst / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    index = dst / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({name + fp8_blocks.SCALE_SUFFIX: file for name, file in
                                   data["weight_map"].items() if name.endswith(FP8_SUFFIXES)
                                   and name.startswith("model.layers.")})
        index.write_text(json.dumps(data, indent=1))
    _write_fp8_config(dst)


def write_checkpoint(config, out: Path, dtype: torch.dtype, seed: int = 0,
                     progress=None, fp8: bool = False) -> int:
    """Writes config.json, model-XXXXX-of-YYYYY.safetensors and the index; returns bytes.
    fp8: the FP8 weights as codes and block scales (drawn in float32, then quantized)."""
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    shapes = checkpoint_shapes(config)
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        n = nbytes({name: shape}, dtype, fp8)
        if current and size + n > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name], size = shape, size + n
    shards.append(current)
    gen = torch.Generator().manual_seed(seed)
    weight_map, done, total = {}, 0, nbytes(shapes, dtype, fp8)
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard.items():
            quantized = fp8 and is_fp8_weight(name, shape)
            t = random_tensor(name, shape, torch.float32 if quantized else dtype, gen)
            tensors.update(fp8_tensors({name: t}) if quantized else {name: t})
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        done += nbytes(shard, dtype, fp8)
        if progress:
            progress(done, total)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.dtype = dtype
    # Other engines (vLLM) pick their model class by config.json's `architectures`; without it
    # vLLM took the folder for an embedding model.
    config.architectures = config.architectures or [causal_lm_class(config)]
    config.save_pretrained(str(out))
    if fp8:
        _write_fp8_config(out)
    return total


def causal_lm_class(config) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


def add_parser(sub) -> None:
    p = sub.add_parser(
        "make-model", help="write a random-weight checkpoint with a real model's shapes",
        description="Write a Hugging Face folder (config.json, sharded safetensors, index) "
                    "with a published model's shapes and random weights, loadable by "
                    "pipefill and HF transformers, for benchmarks without a model download.")
    p.add_argument("--like", required=True, choices=sorted(LIKE),
                   help="the model whose shapes to copy")
    p.add_argument("--out", required=True, help="folder to write (created)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers to keep (default: as many as fit in --memory-fraction "
                        "of the available memory, at most the model's own)")
    p.add_argument("--memory-fraction", type=float, default=0.4,
                   help="share of MemAvailable the default layer count may fill (a benchmark "
                        "loads the model twice: pipefill and HF)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the stored weights")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--fp8", action="store_true",
                   help="write the FP8 variant, as DeepSeek-V3 and the -FP8 Qwen3 releases ship: "
                        "the decoder layers' linear weights in float8 e4m3 with a float32 "
                        "weight_scale_inv per 128x128 block and config.json's "
                        "quantization_config (other tensors in --dtype); pipefill keeps them "
                        "FP8 under --weight-dtype fp8 or auto")
    p.add_argument("--gguf", choices=random_gguf.SCHEMES, default=None,
                   help="write one .gguf file (--out names it) instead of a folder: a llama "
                        "model's matrices as random blocks of this llama.cpp scheme (Q4_1 as "
                        "SmolLM2-135M's file, Q4_K_M's Q4_K/Q6_K mix), the tokenizer copied "
                        "from the default model's file; all layers unless --layers")
    p.set_defaults(run=run)


def run(a: argparse.Namespace) -> int:
    dtype = getattr(torch, a.dtype)
    full = LIKE[a.like][1]["num_hidden_layers"]
    if a.layers is not None and not 1 <= a.layers <= full:
        print(f"make-model: --layers must be between 1 and {full} for {a.like}", file=sys.stderr)
        return 2
    if not 0 < a.memory_fraction <= 1:
        print("make-model: --memory-fraction must be in (0, 1]", file=sys.stderr)
        return 2
    if a.gguf:
        return run_gguf(a, a.layers or full)
    layers = a.layers or min(full, layers_that_fit(a.like, dtype,
                                                   int(available_bytes() * a.memory_fraction),
                                                   a.fp8))
    config = make_config(a.like, layers)
    size = nbytes(checkpoint_shapes(config), dtype, a.fp8)
    kind = f"{a.dtype} and FP8" if a.fp8 else a.dtype
    print(f"{a.like}: {layers} of {full} layers, {size / 2**30:.2f} GiB of {kind} weights "
          f"-> {a.out}", flush=True)

    def progress(done, total):
        print(f"  {done / 2**30:6.2f} / {total / 2**30:.2f} GiB written", flush=True)

    write_checkpoint(config, Path(a.out), dtype, a.seed, progress, a.fp8)
    print(f"wrote {a.out} ({os.path.getsize(Path(a.out) / 'config.json')} byte config, "
          f"{size / 2**30:.2f} GiB of weights)")
    return 0


def run_gguf(a: argparse.Namespace, layers: int) -> int:
    from pipefill.model.loader import resolve_model_path
    if not a.out.endswith(".gguf") or a.fp8:
        print("make-model: --gguf writes one file: --out must end in .gguf (and no --fp8)",
              file=sys.stderr)
        return 2
    config = make_config(a.like, layers)
    try:
        size = random_gguf.file_nbytes(config, a.gguf)
        print(f"{a.like}: {layers} layers, {size / 2**30:.2f} GiB of {a.gguf} tensors -> {a.out}",
              flush=True)
        printed = [0]

        def progress(done, total):  # a line a GiB, and the last
            if done >> 30 > printed[0] or done == total:
                printed[0] = done >> 30
                print(f"  {done / 2**30:6.2f} / {total / 2**30:.2f} GiB written", flush=True)

        random_gguf.write_gguf(config, Path(a.out), a.gguf, resolve_model_path(None), a.seed,
                               progress)
    except ValueError as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out} ({os.path.getsize(a.out) / 2**30:.2f} GiB)")
    return 0
