"""--weight-dtype auto on a GGUF file: keep the linear layers' blocks (as gguf does) or
dequantize them at load (ARCHITECTURE.md, 'Quantized weights').

A decode step reads every weight once, so its time follows the weights' bytes: Q4_1 is 0.625
bytes a weight against bf16's 2. Where the quantized decode GEMM has a vector path (the
integer path, or the float path on AVX-512 / AVX2) for every block type the stage's matrices
use, the blocks decode faster than the dequantized copy; prefill dequantizes tiles per call
(as fast as the plain GEMM). The scalar path is slower than the dequantized GEMM, so without a
vector path auto dequantizes. An explicit --dtype float32 asks for float32 arithmetic, which
the integer path's int8 activations would not give: auto dequantizes there too.

``auto_keeps_gguf(facts) -> (keeps, why)`` is the rule, a pure function of ``AutoFacts``;
``gather_facts(source, names, ...)`` reads them from the file and the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pipefill.kernels.gguf_blocks import BLOCK_TYPES, row_bytes, supports, type_name
from pipefill.kernels.quant_gemm import choose_int8, choose_isa

FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}  # ggml types that hold plain floats
VECTOR_ISAS = ("avx512", "avx2")  # the quantized GEMM's float paths faster than dequantized


@dataclass(frozen=True)
class AutoFacts:
    """What the rule looks at. types: the block types of the stage's matrices (sorted);
    unreadable: quantized types among them the kernels do not read; float_isa, int8: the
    quantized GEMM's float path (quant_gemm.choose_isa) and integer path (choose_int8, or None);
    dtype_flag: --dtype as given; block_bytes / dense_bytes: the bytes a decode step streams
    from the matrices with the blocks kept / dequantized into the compute dtype."""
    types: tuple[str, ...]
    unreadable: tuple[str, ...]
    float_isa: str
    int8: str | None
    device: str
    dtype_flag: str
    dtype: torch.dtype
    tp_size: int
    block_bytes: int
    dense_bytes: int


def auto_keeps_gguf(f: AutoFacts) -> tuple[bool, str]:
    """Whether auto keeps a GGUF file's blocks -> (keeps, why), the reason logged at start."""
    keeps, why = _decide(f)
    dense = str(f.dtype).removeprefix("torch.")
    return keeps, (f"auto: {why}; {', '.join(f.types) or 'no block types'}, "
                   f"{f.block_bytes / 2**20:.0f} MiB a decode step in blocks against "
                   f"{f.dense_bytes / 2**20:.0f} MiB {dense}")


def _decide(f: AutoFacts) -> tuple[bool, str]:
    refused = refusal(f)
    if refused is not None:
        return False, refused
    if f.int8 is not None:
        return True, f"decode reads fewer bytes, on the integer path ({f.int8})"
    if f.float_isa in VECTOR_ISAS:
        return True, f"decode reads fewer bytes, on the float path ({f.float_isa})"
    return False, f"no vector path of the quantized decode GEMM here ({f.float_isa})"


def refusal(f: AutoFacts) -> str | None:
    """Why auto dequantizes whatever the kernels could do, or None (they decide)."""
    if f.device != "cpu":
        return f"the quantized kernels run on CPU stages, not --device {f.device}"
    if f.tp_size > 1:  # not measured against the dequantized shards yet
        return (f"--tp-size {f.tp_size} dequantizes under auto (--weight-dtype gguf keeps "
                "each rank's blocks)")
    if not f.types:
        return "the file's matrices are plain floats, no blocks to keep"
    if f.unreadable:
        return f"no quantized kernel reads {', '.join(f.unreadable)}"
    if f.dtype_flag == "float32":
        return ("--dtype float32 asks for float32 arithmetic (the integer decode path rounds "
                "activations to int8; --weight-dtype gguf keeps blocks anyway)")
    if f.dtype not in (torch.float32, torch.bfloat16):
        return f"the quantized kernels take float32 or bfloat16, not {f.dtype_flag}"
    return None


def gather_facts(source, names: list[str], device: str, dtype_flag: str, dtype: torch.dtype,
                 tp_size: int = 1, disable: tuple[str, ...] = ()) -> AutoFacts:
    """The facts for a stage reading tensors `names` (its tensor_names) of a GGUF `source`:
    its matrices' types and bytes (the embedding only where it is the tied head, as a decode
    step reads it then) and the paths the quantized GEMM takes here."""
    types, unreadable, block, dense = set(), set(), 0, 0
    cfg, family = source.config, source.family
    tied_head = cfg.tie_word_embeddings and family.final_norm_name in names  # the last stage
    for name in dict.fromkeys(names):
        if name == family.embed_name and not tied_head:
            continue
        gname, index = family.gguf_tensor(name)
        if not source.gguf.has(gname):
            continue
        shape = source.gguf.shape(gname, index)
        if len(shape) != 2:
            continue
        qtype, (rows, cols) = source.gguf.tensor_type(gname), shape
        dense += rows * cols * dtype.itemsize
        if qtype in FLOAT_TYPES:
            block += rows * cols * dtype.itemsize
            continue
        types.add(type_name(qtype))
        if qtype in BLOCK_TYPES and supports(qtype, cols):
            block += rows * row_bytes(qtype, cols)
        else:
            unreadable.add(type_name(qtype))
            block += rows * cols * dtype.itemsize
    facts = AutoFacts(tuple(sorted(types)), tuple(sorted(unreadable)), "not asked", None,
                      device, dtype_flag, dtype, tp_size, block, dense)
    if refusal(facts) is not None:  # decided without the kernels: no build at start
        return facts
    return replace(facts, float_isa=choose_isa(disable)[0], int8=choose_int8(disable)[0])
