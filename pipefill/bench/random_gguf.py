"""`pipefill bench make-model --gguf TYPE`: a random-weight GGUF file with a real model's shapes.

The memory bar of a quantized file (peak RSS against file + KV, ARCHITECTURE.md 'What a stage's
memory is made of') only means something at a size where the process's fixed ~290 MiB is
small beside the model, larger than the GGUF files at hand. This writes a llama-architecture
.gguf of a llama-family config (make_model.LIKE) as llama.cpp's quantizer lays one out: the
matrices as random blocks of the scheme's types (kernels.gguf_blocks.random_blocks: every code
and scale random, weights about N(0, 0.02)'s size), norms float32 ones, and the tokenizer fields
(vocabulary, merges, special ids, chat template) copied from the default model's file, so
pipefill reads it as a user's download, tokenizer included. Tensors are written one at a time
(the header first, then each tensor's blocks as they are drawn), so writing holds one matrix.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipefill.kernels.gguf_blocks import random_blocks, row_bytes
from pipefill.model.families.llama import GGUF_LAYER_NAMES
from pipefill.model.gguf_file import gguf_layer_name

# GGML type ids (gguf.GGMLQuantizationType), as kernels.gguf_blocks names them.
F32, Q4_1, Q8_0, Q4_K, Q6_K = 0, 3, 8, 12, 14
SCHEMES = ("Q4_1", "Q4_K_M")
# The default model's general.file_type for each scheme (llama.cpp's LLAMA_FTYPE_MOSTLY_*).
FILE_TYPES = {"Q4_1": 3, "Q4_K_M": 15}
INIT_STD = 0.02


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for attn_v and ffn_down: Q6_K in the first and last eighth of
    the layers and every third layer between, Q4_K elsewhere."""
    eighth = layers // 8
    return layer < eighth or layer >= layers - eighth or (layer - eighth) % 3 == 2


def block_type(scheme: str, gguf_name: str, layers: int) -> int:
    """The GGML type of a matrix under the scheme: Q4_1 as SmolLM2-135M's Q4_1 file (matrices
    Q4_1, the embedding Q8_0), Q4_K_M as llama.cpp's mix (Q4_K, Q6_K for the embedding / head
    and for _more_bits layers' attn_v and ffn_down)."""
    if scheme == "Q4_1":
        return Q8_0 if gguf_name == "token_embd.weight" else Q4_1
    if scheme != "Q4_K_M":
        raise ValueError(f"--gguf {scheme!r}: expected one of {', '.join(SCHEMES)}")
    if gguf_name in ("token_embd.weight", "output.weight"):
        return Q6_K
    if gguf_name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(gguf_name.split(".")[1])
        return Q6_K if _more_bits(layer, layers) else Q4_K
    return Q4_K


def gguf_shapes(config) -> dict[str, tuple[int, ...]]:
    """GGUF name -> (rows, columns) or (n,) of a llama config's tensors, in the file's order."""
    from pipefill.bench.make_model import checkpoint_shapes
    if config.model_type != "llama":
        raise ValueError(f"--gguf writes the llama architecture; {config.model_type!r} has no "
                         "GGUF layout here")
    return {gguf_layer_name(name, GGUF_LAYER_NAMES): shape
            for name, shape in checkpoint_shapes(config).items()}


def tensor_nbytes(name: str, shape, scheme: str, layers: int) -> int:
    if len(shape) == 1:
        return 4 * shape[0]
    return shape[0] * row_bytes(block_type(scheme, name, layers), shape[1])


def file_nbytes(config, scheme: str) -> int:
    """The tensors' bytes in the file (the header and tokenizer come on top)."""
    return sum(tensor_nbytes(n, s, scheme, config.num_hidden_layers)
               for n, s in gguf_shapes(config).items())


def _copy_tokenizer(writer, source) -> None:
    """Every tokenizer.* field of `source` (a GGUFFile) into the writer, types kept."""
    import gguf
    for key, field in source.reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub)


def _add_config(writer, config, scheme: str) -> None:
    writer.add_name(f"random {config.num_hidden_layers}-layer llama, {scheme}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(FILE_TYPES[scheme])


def _rope_theta(config) -> float:
    """rope_theta of a transformers config: an attribute in older releases, in
    rope_parameters in newer ones."""
    theta = getattr(config, "rope_theta", None) if "rope_theta" in config.to_dict() else None
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if theta is None:
        raise ValueError("the config has no rope_theta")
    return float(theta)


def _draw(name: str, shape, scheme: str, layers: int, rng: np.random.Generator) -> np.ndarray:
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)  # norms (make_model.random_tensor's rule)
    return random_blocks(block_type(scheme, name, layers), shape[0], shape[1], rng, INIT_STD)


def write_gguf(config, out: Path, scheme: str, tokenizer_file: str, seed: int = 0,
               progress=None) -> int:
    """Writes the random GGUF file; returns its tensors' bytes. tokenizer_file: a GGUF file
    whose tokenizer fields are copied (its vocabulary must be config.vocab_size)."""
    import gguf

    from pipefill.model.gguf_file import GGUFFile
    source = GGUFFile(tokenizer_file)
    vocab = len(source.field("tokenizer.ggml.tokens") or [])
    if vocab != config.vocab_size:
        raise ValueError(f"the tokenizer of {tokenizer_file} has {vocab} tokens; the model's "
                         f"vocabulary is {config.vocab_size}")
    shapes, layers = gguf_shapes(config), config.num_hidden_layers
    w = gguf.GGUFWriter(str(out), "llama")
    _add_config(w, config, scheme)
    _copy_tokenizer(w, source)
    for name, shape in shapes.items():
        n = tensor_nbytes(name, shape, scheme, layers)
        if len(shape) == 1:
            w.add_tensor_info(name, shape, np.dtype(np.float32), n)
        else:  # blocks: the shape in bytes, as GGUFWriter.add_tensor takes raw blocks
            w.add_tensor_info(name, (shape[0], n // shape[0]), np.dtype(np.uint8), n,
                              raw_dtype=gguf.GGMLQuantizationType(
                                  block_type(scheme, name, layers)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng, done, total = np.random.default_rng(seed), 0, file_nbytes(config, scheme)
    for name, shape in shapes.items():
        data = _draw(name, shape, scheme, layers, rng)
        w.write_tensor_data(data)
        done += data.nbytes
        if progress:
            progress(done, total)
    w.close()
    return total
