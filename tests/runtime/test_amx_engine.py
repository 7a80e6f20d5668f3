"""The AMX attention backend end to end: bf16 parity with HF transformers (float32 reference,
bf16 tolerance), the same logprobs as split SDPA, and the dispatch rules."""
import random

import pytest
import torch

from conftest import assert_greedy_agrees, assert_pages_free, hf_reference, save_tiny_model, track
from pipefill import Engine
from pipefill.kernels.amx_attention import amx_available
from pipefill.model import attention

needs_amx = pytest.mark.skipif(not amx_available()[0], reason=f"no AMX: {amx_available()[1]}")
_rng = random.Random(1)
PROMPT = [_rng.randrange(512) for _ in range(300)]


@pytest.fixture(scope="module")
def model_bf16(tmp_path_factory):
    # head_dim 64, as the kernel wants; weights scaled so that logits stay informative.
    return save_tiny_model("llama", tmp_path_factory.mktemp("bf16"), hidden_size=256,
                           num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=512, init_std=0.06)


@pytest.fixture(scope="module")
def reference(model_bf16):
    return hf_reference(model_bf16, PROMPT, 16, margins=True)


@pytest.fixture(scope="module")
def outputs(model_bf16):
    outs = {}
    for backend in ("amx", "sdpa"):
        with track(Engine(model_bf16, dtype="bfloat16", attention_backend=backend,
                          chunked_prefill_size=96)) as e:
            outs[backend] = e.generate([PROMPT, PROMPT[:77]], max_new_tokens=16,
                                       ignore_eos=True, return_prompt_logprobs=True)
            assert_pages_free(e)
    return outs


@needs_amx
def test_amx_bf16_matches_hf(reference, outputs):
    ref_lp, ref_tokens, margins = reference
    out = outputs["amx"][0]
    diff = (torch.tensor(out.prompt_logprobs) - ref_lp).abs()
    assert diff.mean().item() < 0.03 and diff.max().item() < 0.15
    assert_greedy_agrees(out.output_ids, ref_tokens, margins)


@needs_amx
def test_amx_equals_sdpa_within_bf16(reference, outputs):
    for a, b in zip(outputs["amx"], outputs["sdpa"]):
        diff = (torch.tensor(a.prompt_logprobs) - torch.tensor(b.prompt_logprobs)).abs()
        assert diff.max().item() < 0.1
    a, b = outputs["amx"][0], outputs["sdpa"][0]
    assert_greedy_agrees(a.output_ids, b.output_ids, reference[2])


@needs_amx
def test_amx_through_a_pipeline(model_bf16, outputs):
    with track(Engine(model_bf16, dtype="bfloat16", attention_backend="amx", pp_size=2,
                      chunked_prefill_size=96, threads_per_stage=1)) as e:
        outs = e.generate([PROMPT, PROMPT[:77]], max_new_tokens=16, ignore_eos=True,
                          return_prompt_logprobs=True)
    for a, b in zip(outs, outputs["amx"]):
        assert a.output_ids == b.output_ids
        diff = (torch.tensor(a.prompt_logprobs) - torch.tensor(b.prompt_logprobs)).abs()
        assert diff.max().item() < 0.05


def test_dispatch_falls_back_without_amx(monkeypatch):
    from pipefill.kernels import amx_attention
    monkeypatch.setattr(amx_attention, "amx_available", lambda: (False, "capability off"))
    cpu = torch.device("cpu")
    # Without AMX, auto moves on to the vector kernels (or split SDPA) and says why not AMX.
    backend, why = attention.choose_backend("auto", torch.bfloat16, 64, 64, cpu)
    assert backend != "amx"
    if backend == "sdpa":
        assert "amx: capability off" in why
    assert attention.choose_backend("auto", torch.bfloat16, 64, 64, cpu,
                                    flags=frozenset())[0] == "sdpa"
    with pytest.raises(ValueError, match="amx is not available: capability off"):
        attention.choose_backend("amx", torch.bfloat16, 64, 64, cpu)


def test_dispatch_rules():
    cpu = torch.device("cpu")
    assert attention.choose_backend("sdpa", torch.bfloat16, 64, 64, cpu)[0] == "sdpa"
    backend, why = attention.choose_backend("auto", torch.float32, 64, 64, cpu,
                                            flags=frozenset())
    assert backend == "sdpa"
    assert "amx: dtype is torch.float32, the kernel is bfloat16-only" in why
    assert attention.choose_backend("auto", torch.bfloat16, 16, 64, cpu)[0] == "sdpa"
    assert attention.choose_backend("auto", torch.bfloat16, 64, 48, cpu)[0] == "sdpa"


def test_forcing_amx_on_a_float32_model_is_a_sentence(tiny_models):
    with pytest.raises(ValueError, match="amx is not available: dtype"):
        Engine(tiny_models["llama"], dtype="float32", attention_backend="amx")
