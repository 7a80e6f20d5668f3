"""--weight-dtype gguf: the default SmolLM2 GGUF (Q4_1 layers, a Q8_0 tied embedding) with its
linear layers and LM head kept as blocks, against transformers loading the same GGUF
dequantized (float32), and the memory the stage holds.

Tolerance: the kernels use the file's weights with the exact float32 values transformers gets
from the gguf package (tests/kernels/test_quant_gemm.py checks those bits), and float32
activations, so the engines differ by float32 summation order only: the same 1e-3 max |Δ
logprob| the dequantized default-model test uses (a relative 2^-24 per product over K = 1,536
terms through 30 layers and a 49,152-way softmax stays orders below it), and a mean 10x lower,
which a systematic error (a wrong scale or nibble order) would exceed by far."""
import os

import pytest
import torch

from conftest import assert_pages_free, track
from pipefill import Engine
from pipefill.kernels.quant_gemm import QuantLinear
from pipefill.model.loader import WeightSource, load_stage_weights, resolve_model_path
from test_default_model import hf_reference, long_text


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return resolve_model_path(None)
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
        dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("chunk,max_rows", [(64, 64), (128, 32)],
                         ids=["prompt-on-the-decode-kernel", "prompt-dequantized-per-call"])
def test_gguf_blocks_match_transformers(gguf_path, hf_model, chunk, max_rows):
    """Greedy tokens over 64 steps identical (the decode kernel, M = 1) and prompt logprobs
    close: with 64-row chunks and --decode-gemm-max-rows 64 every prompt row runs the
    quantized kernel too (LM head included); with 128-row chunks prefill dequantizes."""
    with track(Engine(None, dtype="float32", weight_dtype="gguf", chunked_prefill_size=chunk,
                      decode_gemm_max_rows=max_rows)) as engine:
        prompt = engine.tokenizer.encode(long_text())[:400]
        out = engine.generate([prompt], max_new_tokens=64, return_prompt_logprobs=True,
                              ignore_eos=True)[0]
        assert set(out.metrics["chunk_sizes"][:-1]) == {chunk}
        assert_pages_free(engine)
    ref_lp, ref = hf_reference(hf_model, prompt, 64)
    diff = (torch.tensor(out.prompt_logprobs) - ref_lp).abs()
    assert diff.max().item() < 1e-3 and diff.mean().item() < 1e-4, (diff.max(), diff.mean())
    assert out.output_ids == ref


def test_gguf_blocks_hold_less_than_bf16(gguf_path):
    """The stage's weights with blocks kept: the linear layers and the head are the file's
    bytes (QuantLinear, no dequantized copy beside them) and the whole stage holds less than
    the bf16 stage's plain matrices alone (which its decode copies would double)."""
    source = WeightSource(gguf_path)
    layers = range(source.config.num_layers)
    quant = load_stage_weights(source, layers, True, True, torch.bfloat16, blocks=True)
    dense = load_stage_weights(source, layers, True, True, torch.bfloat16)
    qbytes = stage_bytes(quant)
    for layer in quant.layers:
        assert layer.qkv is None and layer.o_proj is None and layer.gate_up is None
        assert all(isinstance(q, QuantLinear) for q in layer.packed.values())
        assert layer.prefill.keys() == layer.packed.keys() == {"qkv", "o_proj", "gate_up",
                                                                "down"}
    assert isinstance(quant.lm_head_packed, QuantLinear) and quant.lm_head is quant.embed
    assert quant.kept_dequantized == []
    # Q4_1 is 20 bytes per 32 weights (0.625 bytes a weight) against bf16's 2; the bf16
    # embedding (the tied head) is held by both.
    layer_weights = sum(q.nbytes for layer in quant.layers for q in layer.packed.values())
    dense_layers = sum(getattr(layer, f).nbytes for layer in dense.layers
                       for f in ("qkv", "o_proj", "gate_up", "down"))
    assert layer_weights == pytest.approx(dense_layers * 0.625 / 2, rel=1e-6)
    assert qbytes < stage_bytes(dense)


def stage_bytes(w) -> int:
    """Bytes of every tensor and quantized matrix a stage's weights hold (a tensor held twice,
    the tied head, once)."""
    seen, total = set(), 0
    objs = [w.embed, w.final_norm, w.lm_head, w.lm_head_quant]
    for layer in w.layers:
        objs += list(vars(layer).values()) + list((layer.packed or {}).values())
    for obj in objs:
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.nbytes
        elif isinstance(obj, QuantLinear):
            total += obj.nbytes
    return total


def test_gguf_needs_a_gguf_file(tmp_path):
    from pipefill.model.loader import keeps_blocks

    class Folder:
        gguf, path = None, str(tmp_path)
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        keeps_blocks("gguf", Folder())
    assert keeps_blocks("auto", Folder())[0] is False
