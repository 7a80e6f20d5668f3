"""`pipefill bench make-model --gguf`: the random GGUF file loads as a user's download would
(config from its fields, every matrix in the scheme's block type, the default model's
tokenizer), a stage keeps its blocks and runs a prompt, and the same seed writes the same
bytes."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import single_stage
from pipefill.bench import random_gguf
from pipefill.bench.make_model import make_config
from pipefill.bench.random_gguf import Q4_1, Q4_K, Q6_K, Q8_0, block_type, write_gguf
from pipefill.model.loader import WeightSource, resolve_model_path
from pipefill.model.tokenizer import load_tokenizer
from test_decode import PAGE, _step

VOCAB = 49152  # the default model's tokenizer


def tiny_llama(layers: int = 2):
    import transformers
    return transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=VOCAB, num_hidden_layers=layers,
                                    rope_theta=50000.0, rms_norm_eps=1e-5,
                                    max_position_embeddings=4096, tie_word_embeddings=True)


@pytest.mark.parametrize("scheme", ["Q4_1", "Q4_K_M"])
def test_it_loads_with_its_shapes_types_and_the_default_tokenizer(tmp_path, scheme):
    path = str(tmp_path / "m.gguf")
    write_gguf(tiny_llama(), tmp_path / "m.gguf", scheme, resolve_model_path(None))
    source = WeightSource(path)
    c = source.config
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
            c.head_dim, c.vocab_size, c.rope_theta, c.tie_word_embeddings) == \
        (256, 512, 2, 4, 2, 64, VOCAB, 50000.0, True)
    f = source.gguf
    assert f.shape("blk.1.ffn_down.weight") == (256, 512)
    assert f.shape("blk.0.attn_k.weight") == (128, 256)
    assert f.shape("token_embd.weight") == (VOCAB, 256) and not f.has("output.weight")
    for name in f.tensors:
        expected = 0 if name.endswith("norm.weight") else block_type(scheme, name, 2)
        assert f.tensor_type(name) == expected, name
    assert f.load("blk.0.attn_norm.weight").eq(1).all()
    weights = f.load("blk.0.ffn_up.weight")
    assert 0.005 < weights.std().item() < 0.05 and weights.abs().mean().item() > 0

    text = "The quick brown fox jumps over the lazy dog."
    ours, default = load_tokenizer(source), load_tokenizer(WeightSource(resolve_model_path(None)))
    assert ours.encode(text) == default.encode(text) and len(ours.encode(text)) > 5
    assert ours.decode(ours.encode(text)) == text
    assert ours.has_chat_template

    stage = single_stage(path, "bfloat16", page_size=PAGE, weight_dtype="gguf", source=source)
    assert stage.model.w.kept_dequantized == []
    prompt = ours.encode(text)
    with torch.inference_mode():
        logits = _step(stage, {0: prompt}, [list(range(4))], [0])[0]
    assert logits.shape == (VOCAB,) and torch.isfinite(logits).all()


def test_the_schemes_place_the_llama_cpp_types():
    assert block_type("Q4_1", "token_embd.weight", 24) == Q8_0
    assert block_type("Q4_1", "blk.3.ffn_down.weight", 24) == Q4_1
    # Q4_K_M: Q6_K in the first and last eighth (3 of 24 layers each) and every third between.
    six = [i for i in range(24) if block_type("Q4_K_M", f"blk.{i}.attn_v.weight", 24) == Q6_K]
    assert six == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    assert block_type("Q4_K_M", "blk.5.attn_q.weight", 24) == Q4_K
    assert block_type("Q4_K_M", "blk.5.ffn_down.weight", 24) == Q6_K
    assert block_type("Q4_K_M", "token_embd.weight", 24) == Q6_K
    with pytest.raises(ValueError, match="expected one of"):
        block_type("Q2_K", "blk.0.attn_q.weight", 24)


def test_same_seed_same_bytes_and_the_size_it_says(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        write_gguf(tiny_llama(1), tmp_path / name, "Q4_1", resolve_model_path(None), seed=3)
    a, b = (tmp_path / "a.gguf").read_bytes(), (tmp_path / "b.gguf").read_bytes()
    assert a == b
    tensors = random_gguf.file_nbytes(tiny_llama(1), "Q4_1")
    assert tensors < len(a) < tensors + (4 << 20)  # the header: mostly the tokenizer


def test_a_vocabulary_other_than_the_tokenizers_is_refused(tmp_path):
    config = tiny_llama(1)
    config.vocab_size = 512
    with pytest.raises(ValueError, match="49152 tokens"):
        write_gguf(config, tmp_path / "m.gguf", "Q4_1", resolve_model_path(None))


@pytest.mark.parametrize("args, message", [
    (["--like", "mixtral-8x7b", "--out", "m.gguf"], "llama architecture"),
    (["--like", "smollm2-1.7b", "--out", "folder"], "must end in .gguf"),
])
def test_cli_refuses_with_a_sentence(tmp_path, args, message):
    args = [a if a in ("mixtral-8x7b", "smollm2-1.7b") or a.startswith("--")
            else str(tmp_path / a) for a in args]
    out = subprocess.run([sys.executable, "-m", "pipefill.cli.main", "bench", "make-model",
                          "--gguf", "Q4_1", "--layers", "1", *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not list(tmp_path.iterdir())


def test_the_smollm2_shapes_are_the_published_ones():
    config = make_config("smollm2-1.7b")
    shapes = random_gguf.gguf_shapes(config)
    assert shapes["token_embd.weight"] == (VOCAB, 2048)
    assert shapes["blk.23.ffn_gate.weight"] == (8192, 2048)
    assert shapes["blk.0.attn_k.weight"] == (2048, 2048)
    assert "output.weight" not in shapes and len(shapes) == 2 + 24 * 9
    # 1.71B weights at 20 bytes a 32 (the embedding 34): the 1.04 GiB make-model printed.
    assert np.isclose(random_gguf.file_nbytes(config, "Q4_1") / 2**30, 1.04, atol=0.01)
