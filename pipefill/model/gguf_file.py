"""GGUF files: metadata fields, tensors by GGUF name (dequantized by the `gguf` package), and
the llama.cpp conventions every family shares. A family maps its Hugging Face tensor names to
GGUF names (ModelFamily.gguf_tensor: a tensor, or one expert of a stacked one) and reads its
config from the fields."""
from __future__ import annotations

import numpy as np
import torch

# The stage tensors' GGUF names: the same in every llama.cpp architecture.
GGUF_STAGE_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_layer_name(hf_name: str, layer_names: dict[str, str]) -> str:
    """model.layers.{i}.{rest} -> blk.{i}.{layer_names[rest]}; stage tensors by
    GGUF_STAGE_NAMES."""
    if hf_name in GGUF_STAGE_NAMES:
        return GGUF_STAGE_NAMES[hf_name]
    model, layers, index, rest = hf_name.split(".", 3)
    assert (model, layers) == ("model", "layers"), hf_name
    return f"blk.{index}.{layer_names[rest]}"


def gguf_expert_tensor(hf_name: str, expert_names: dict[str, str]) -> tuple[str, int] | None:
    """model.layers.{i}.{mlp|block_sparse_moe}.experts.{e}.{projection}.weight -> (blk.{i}.
    {expert_names[projection]}, e): expert e of the layer's stacked tensor, as llama.cpp's
    converter stacks a layer's experts per projection; None for any other name."""
    parts = hf_name.split(".")
    if len(parts) == 8 and parts[4] == "experts" and parts[6] in expert_names:
        return f"blk.{parts[2]}.{expert_names[parts[6]]}", int(parts[5])
    return None


# The largest piece of a file one fault can map (a PMD-sized folio): drop_mapped_pages
# unmaps whole pieces of this size.
NEIGHBOURS_MAPPED = 2 << 20

# Arrays at least this long are what `vocabulary=False` skips: a tokenizer's tokens, merges,
# scores and token types (Gemma 3's 262,144 tokens), not a file's short lists.
LONG_ARRAY = 1024


def _reader(path: str, vocabulary: bool):
    """gguf.GGUFReader of the file; without `vocabulary`, one that steps over long arrays of
    strings or numbers instead of making a numpy view of each item (two a string: Gemma 3's
    tokenizer fields were ~700 MiB of a stage's RSS and ~10 s, and a stage never reads them):
    such a field keeps its type and length (GGUFFile.array_length) and no items."""
    import struct
    import sys

    import gguf
    if vocabulary:
        return gguf.GGUFReader(path)
    array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

    class VocabularyFreeReader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != array or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            item, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            kind, n = gguf.GGUFValueType(int(item[0])), int(count[0])
            scalar = self.gguf_scalar_to_np.get(kind)
            if n < LONG_ARRAY or (kind != string and scalar is None):
                return super()._get_field_parts(orig_offs, raw_type)
            offs = orig_offs + 12
            if scalar is not None:  # scores, token types: fixed-size items
                offs += n * np.dtype(scalar).itemsize
            else:
                data = memoryview(self.data)
                for _ in range(n):  # each string: its uint64 length, then its bytes
                    offs += 8 + struct.unpack_from("<Q", data, offs)[0]
            return offs - orig_offs, [item, count], [], [array, kind]

    return VocabularyFreeReader(path)


class GGUFFile:
    """vocabulary=False: the long arrays (a tokenizer's tokens, merges, scores) are skipped
    (_reader); reading one is an error, its length is still known."""

    def __init__(self, path: str, vocabulary: bool = True):
        self.path = path
        self.reader = _reader(path, vocabulary)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.field("general.architecture")

    def _skipped(self, f) -> bool:
        return len(f.types) == 2 and not f.data and int(f.parts[-1][0]) > 0

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is not None and self._skipped(f):
            raise ValueError(f"GGUF field {key} was not read (the file was opened without "
                             "its vocabulary)")
        return default if f is None else f.contents()

    def array_length(self, key: str) -> int | None:
        """The number of items of an array field, also one skipped; None where it is absent."""
        f = self.reader.fields.get(key)
        if f is None:
            return None
        return int(f.parts[-1][0]) if self._skipped(f) else len(f.data)

    def arch_field(self, key: str, default=None):
        """A field under the architecture's prefix ({arch}.{key})."""
        return self.field(f"{self.arch}.{key}", default)

    def rope_scaling(self) -> dict:
        """The rope scaling in ModelConfig's form; a ValueError for what pipefill lacks."""
        kind = self.arch_field("rope.scaling.type", "none")
        if kind not in ("none", "linear"):
            raise ValueError(f"GGUF rope scaling {kind!r} is not supported")
        if "rope_freqs.weight" in self.tensors:
            raise ValueError("GGUF files with per-dimension rope frequency factors "
                             "(rope_freqs.weight, Llama 3.1 style) are not supported yet; use "
                             "the Hugging Face folder of the model instead")
        if kind == "none":
            return {}
        return {"rope_type": "linear", "factor": self.arch_field("rope.scaling.factor")}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str, index: int | None = None) -> tuple[int, ...]:
        """The tensor's shape in Hugging Face layout (GGUF lists dimensions innermost first);
        with an index, the shape of one slice along the first dimension (one expert of the
        experts llama.cpp stacks into one tensor)."""
        shape = tuple(int(x) for x in reversed(self.tensors[name].shape.tolist()))
        return shape if index is None else shape[1:]

    def tensor_type(self, name: str) -> int:
        """The GGML type id of a tensor (kernels.gguf_blocks names the block types)."""
        return int(self.tensors[name].tensor_type)

    def blocks(self, name: str) -> np.ndarray:
        """A block-quantized matrix as in the file: uint8 [rows, bytes per row], an owned copy
        (the stage keeps it after the file is closed)."""
        data = self.tensors[name].data
        out = np.array(data, dtype=np.uint8).reshape(self.shape(name)[0], -1)
        self.drop_mapped_pages(data)
        return out

    def drop_mapped_pages(self, view: np.ndarray) -> None:
        """Unmaps the file's pages under `view` (a piece of the reader's memory map) from this
        process once they are copied: each page read stays resident in the mapping, so a
        stage's load held the whole file on top of the copies (ARCHITECTURE.md 'What a
        stage's memory is made of'). The page cache keeps them; a later read faults them in
        again. The range is widened to whole 2 MiB pieces: a fault maps the faulting page's
        neighbours too (fault-around, and whole large folios of a file just read from disk),
        which lie in the tensors before and after, so page-exact unmapping left 12.7 MB of the
        default model's file mapped after a cold read. The map is shared and read-only: a
        neighbour still to be read costs a minor fault again. A no-op where the map or madvise
        is missing."""
        mapping = getattr(self.reader.data, "_mmap", None)
        if mapping is None or not hasattr(mapping, "madvise") or view.size == 0:
            return
        import mmap
        start = view.ctypes.data - self.reader.data.ctypes.data
        end = start + view.nbytes
        if not 0 <= start < end <= len(mapping):
            return
        first = start - start % NEIGHBOURS_MAPPED
        last = min(-(-end // NEIGHBOURS_MAPPED) * NEIGHBOURS_MAPPED, len(mapping))
        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)

    def load(self, name: str, start: int = 0, end: int | None = None,
             index: int | None = None) -> torch.Tensor:
        """Rows start:end of a tensor (of its slice `index` along the first dimension, when
        given), dequantized to float32, in Hugging Face layout (dequantization works block by
        block within a row, so a row range reads the same values as the whole tensor)."""
        import gguf
        t = self.tensors[name]
        shape = self.shape(name, index)
        end = shape[0] if end is None else end
        data = t.data if index is None else t.data[index]
        data = data if (start, end) == (0, shape[0]) else data[start:end]
        view = data
        data = gguf.quants.dequantize(data, t.tensor_type)
        data = np.ascontiguousarray(data, dtype=np.float32).reshape(end - start, *shape[1:])
        # F32 tensors come back as read-only views of the memory-mapped file.
        out = torch.from_numpy(data if data.flags.writeable else data.copy())
        self.drop_mapped_pages(view)
        return out


def unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp interleaves the two rotary halves of each head's rows (llama q and k); undo it."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape).contiguous())
