"""FP8 block-quantized checkpoints (DeepSeek-V3's and the -FP8 Qwen3 releases' layout: e4m3
weights with a weight_scale_inv per 128 x 128 block, config.json's quantization_config): a tiny
DeepSeek-V3 (q LoRA, experts, a dense first layer, every matrix one partial block), a tiny
dense Qwen3 and a tiny Qwen3-MoE (rows and columns over 128: whole and partial blocks) are
quantized by bench make-model's writer, and the same FP8 checkpoint dequantized into plain float32 safetensors is
the reference: HF transformers cannot run FP8 on CPU, so the dequantized copy is what HF and
pipefill both load normally.

Tolerance: pipefill holds the FP8 weights with exactly the dequantized copy's float32 values
(tests/kernels/test_fp8_gemm.py checks the bits), so the two stages differ by float32
summation order only (the FP8 GEMM against the packed float32 one for decode, torch's GEMM on
the per-call copy against oneDNN's for prefill): logits within 1e-5 over a few layers of
width <= 200; against HF on the dequantized copy the family tests' 1e-4 on prompt logprobs and
identical greedy tokens."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_matches_hf, hf_reference, save_tiny_model, single_stage, track
from pipefill import Engine
from pipefill.bench.make_model import write_fp8_copy
from pipefill.kernels import fp8_blocks
from pipefill.kernels.quant_gemm import QuantLinear
from pipefill.model.loader import WeightSource, fp8_kept_matrices, keeps_blocks, tensor_names
from test_decode import PAGE, _step
from test_deepseek import PROMPT, save_deepseek
from test_moe_family import save_moe


def dequantized_copy(fp8, out) -> str:
    """The FP8 folder with every FP8 weight dequantized to float32 (fp8_blocks.dequantize)
    and no quantization_config: the plain checkpoint of the same weights."""
    out.mkdir()
    for f in fp8.iterdir():
        if f.suffix == ".safetensors":
            t = load_file(str(f))
            scale = fp8_blocks.SCALE_SUFFIX
            save_file({k: fp8_blocks.dequantize(v, t[k + scale]) if k + scale in t else v
                       for k, v in t.items() if not k.endswith(scale)}, str(out / f.name),
                      metadata={"format": "pt"})
        elif f.name == "config.json":
            config = json.loads(f.read_text())
            del config["quantization_config"]
            (out / f.name).write_text(json.dumps(config))
        else:
            shutil.copy(f, out / f.name)
    return str(out)


# Qwen3-MoE: a dense layer, then 5 experts of 2 x 136 rows; widths over one block.
QWEN3_MOE = {"qwen3_moe": ("Qwen3MoeConfig", dict(
    vocab_size=512, hidden_size=144, intermediate_size=200, moe_intermediate_size=136,
    num_experts=5, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_hidden_layers=2, mlp_only_layers=[0], norm_topk_prob=True,
    max_position_embeddings=1024, tie_word_embeddings=False))}


class Checkpoints(dict):
    """kind -> (FP8 folder, dequantized folder), written on first use."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp = tmp_path_factory

    def __missing__(self, kind: str):
        base = self.tmp.mktemp(kind)
        if kind == "v3":
            save_deepseek("v3", base / "float")
        elif kind == "qwen3":  # rows and columns over one block: 144 = 128 + 16, 2 x 200 rows
            save_tiny_model("qwen3", base / "float", hidden_size=144, intermediate_size=200)
        else:
            save_moe("qwen3_moe", base / "float", configs=QWEN3_MOE, common={}, seed=5)
        write_fp8_copy(base / "float", base / "fp8")
        self[kind] = str(base / "fp8"), dequantized_copy(base / "fp8", base / "deq")
        return self[kind]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return Checkpoints(tmp_path_factory)


def logits_on_stage(ex, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The prompt as one chunk (more rows than --decode-gemm-max-rows: prefill's path), then
    n greedy decode steps of one row -> (tokens, every step's logits [n + 1, vocab])."""
    table = [list(range(-(-(len(prompt) + n) // PAGE)))]
    with torch.inference_mode():
        logits = [_step(ex, {0: prompt}, table, [0])[0]]
        tokens = []
        for s in range(n):
            tokens.append(int(logits[-1].argmax()))
            logits.append(_step(ex, {0: tokens[-1:]}, table, [len(prompt) + s])[0])
    return tokens, torch.stack(logits)


def quantized(ex) -> list[QuantLinear]:
    w = ex.model.w
    out = [q for layer in w.layers for q in (layer.packed or {}).values()
           if isinstance(q, QuantLinear)]
    return out + [q for layer in w.layers if getattr(layer, "moe", None) is not None
                  for m in layer.moe.experts.linears for q in m.packed]


# kind -> the FP8 linear layers a stage holds. qwen3: qkv, o_proj, gate_up, down in 4 layers;
# v3: qkv_a, q_b, o_proj in 4 layers, the dense layer's MLP, 8 experts x 2 in 3 sparse
# layers; qwen3_moe: qkv and o_proj in 2 layers, the dense MLP, 5 experts x 2.
HELD = {"qwen3": 16, "v3": 12 + 2 + 48, "qwen3_moe": 4 + 2 + 10}


@pytest.mark.parametrize("kind", ["v3", "qwen3", "qwen3_moe"])
def test_fp8_logits_equal_the_dequantized_checkpoint(kind, checkpoints):
    fp8, deq = checkpoints[kind]
    ours = single_stage(fp8, "float32", page_size=PAGE, weight_dtype="fp8")
    held = quantized(ours)
    assert len(held) == HELD[kind]
    assert {q.types for q in held} == {"FP8_E4M3"} and all(q.isa != "torch" for q in held)
    # v3's kv_b_proj (split per head) and shared experts are read dequantized, and listed.
    kept = {k.split(".")[-2] for k in ours.model.w.kept_dequantized}
    assert kept == ({"kv_b_proj", "gate_proj", "up_proj", "down_proj"} if kind == "v3"
                    else set())
    # What the memory figures count (loader.fp8_kept_matrices, its list of the weights read
    # whole) is what the stage holds as codes, scales and grid rows.
    source = WeightSource(fp8)
    names = tensor_names(source.config, range(source.config.num_layers), True, True)
    assert fp8_kept_matrices(source, names) == (sum(q.out_features * q.in_features
                                                    for q in held),
                                                sum(q.nbytes for q in held))
    ref = single_stage(deq, "float32", page_size=PAGE)
    prompt = PROMPT[:40]
    tokens, logits = logits_on_stage(ours, prompt, 8)
    ref_tokens, ref_logits = logits_on_stage(ref, prompt, 8)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-5


@pytest.mark.slow  # ~30 s: HF's reference and an engine
def test_fp8_checkpoint_matches_hf_on_the_dequantized_copy(checkpoints):
    """--weight-dtype auto keeps the FP8 weights (a vector path runs here) and gives HF's
    logprobs and tokens on the dequantized copy; chunks of 37 rows take the per-call
    dequantized prefill, decode rows the FP8 GEMM."""
    fp8, deq = checkpoints["v3"]
    keeps, why = keeps_blocks("auto", WeightSource(fp8))
    if not keeps:
        pytest.skip(why)
    ref = hf_reference(deq, PROMPT, 16, full_forwards=True)
    with track(Engine(fp8, dtype="float32", page_size=PAGE, chunked_prefill_size=37,
                      threads_per_stage=1)) as engine:
        assert_matches_hf(engine, PROMPT, ref, 37)


def test_pipefill_generate_pp2_equals_the_dequantized_checkpoint(checkpoints, tmp_path):
    """`pipefill generate` with two stages (the FP8 weights split between them) gives the
    dequantized checkpoint's greedy tokens."""
    outs = []
    for name, path in zip(("fp8", "deq"), checkpoints["qwen3"]):
        out = tmp_path / f"{name}.json"
        run = subprocess.run(
            [sys.executable, "-m", "pipefill.cli.main", "generate", "--model-path", path,
             "--dtype", "float32", "--pp-size", "2", "--input-len", "50", "--seed", "3",
             "--max-new-tokens", "12", "--chunked-prefill-size", "32", "--page-size", "16",
             "--threads-per-stage", "1", "--output-json", str(out)]
            + (["--weight-dtype", "fp8"] if name == "fp8" else []),
            capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stderr
        outs.append(json.loads(out.read_text()))
        if name == "fp8":
            assert "FP8 weights kept quantized (--weight-dtype fp8, requested)" in run.stderr
    assert outs[0]["prompt_ids"] == outs[1]["prompt_ids"]
    assert outs[0]["output_ids"] == outs[1]["output_ids"] and len(outs[0]["output_ids"]) == 12


BAD_CONFIGS = [
    ({"quant_method": "gptq", "bits": 4}, "gptq checkpoints .* are not read; pipefill reads"),
    ({**fp8_blocks.QUANT_CONFIG, "fmt": "e5m2"}, "fmt 'e5m2' is not read; pipefill reads fmt "
                                                 "'e4m3'"),
    ({**fp8_blocks.QUANT_CONFIG, "weight_block_size": [64, 64]},
     r"weight_block_size \[64, 64\] is not read; pipefill reads weight_block_size \[128, 128\]"),
    ({**fp8_blocks.QUANT_CONFIG, "activation_scheme": "static"},
     "activation_scheme 'static' is not read"),
    ({**fp8_blocks.QUANT_CONFIG, "kv_cache_scheme": "fp8"},
     "has kv_cache_scheme, which pipefill does not read"),
]


@pytest.mark.parametrize("quant,sentence", BAD_CONFIGS)
def test_other_quantization_configs_are_refused_with_a_sentence(quant, sentence, checkpoints,
                                                                tmp_path):
    fp8 = checkpoints["qwen3"][0]
    config = json.loads(open(f"{fp8}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ValueError, match=sentence):
        WeightSource(str(tmp_path))


def test_weight_dtype_choices_and_bad_files(checkpoints, tmp_path):
    fp8, deq = checkpoints["qwen3"]
    source = WeightSource(fp8)
    assert source.fp8 and keeps_blocks("fp8", source) == (True, "requested")
    assert keeps_blocks("bfloat16", source) == (False, "bfloat16 requested")
    assert keeps_blocks("auto", source, disable=("avx512", "avx2"))[0] is False
    with pytest.raises(ValueError, match="fp8 runs on CPU stages only"):
        keeps_blocks("fp8", source, "cuda")
    with pytest.raises(ValueError, match="gguf needs a .gguf model file; this is an FP8"):
        keeps_blocks("gguf", source)
    with pytest.raises(ValueError, match="--weight-dtype fp8 needs an FP8 checkpoint"):
        keeps_blocks("fp8", WeightSource(deq))
    # A grid of the wrong shape is refused when the weight is read.
    bad = tmp_path / "bad"
    shutil.copytree(fp8, bad)
    t = load_file(str(bad / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    t[name + "_scale_inv"] = torch.ones(1, 1)
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj.weight_scale_inv has shape \[1, 1\], but "
                                         r"a \[144, 200\] weight in 128 x 128 blocks has "
                                         r"\[2, 2\] scales"):
        WeightSource(str(bad)).load(name)
