"""The default SmolLM2 GGUF against transformers loading the same GGUF (float32): a 1,500-token
prompt in 256-token chunks, prompt logprobs within 1e-3, 32 greedy tokens identical."""
import os

import pytest
import torch

from conftest import assert_pages_free, track
from pipefill import Engine
from pipefill.model.loader import resolve_model_path


def long_text() -> str:
    facts = ["The river Seine flows through Paris.", "Mount Fuji is the tallest peak in Japan.",
             "Octopuses have three hearts.", "Copper turns green as it oxidises.",
             "The Sahara is larger than the United States."]
    lines = [f"Note {i}: {facts[i % len(facts)]} It was recorded on day {i * 7 % 31 + 1}."
             for i in range(200)]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def gguf_path():
    return resolve_model_path(None)


def test_default_gguf_matches_transformers(gguf_path):
    from transformers import AutoModelForCausalLM
    with track(Engine(None, dtype="float32", chunked_prefill_size=256)) as engine:
        prompt = engine.tokenizer.encode(long_text())[:1500]
        assert len(prompt) == 1500
        out = engine.generate([prompt], max_new_tokens=32, return_prompt_logprobs=True,
                              ignore_eos=True)[0]
        assert out.metrics["chunk_sizes"] == [256] * 5 + [220]
        assert_pages_free(engine)
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
        dtype=torch.float32).eval()
    ref_lp, ref = hf_reference(hf, prompt, 32)
    assert (torch.tensor(out.prompt_logprobs) - ref_lp).abs().max().item() < 1e-3
    assert out.output_ids == ref


def hf_reference(hf, prompt: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' prompt logprobs (log p(x_t | x_<t), t >= 1) and greedy continuation."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        logprobs = torch.log_softmax(hf(ids).logits[0].float(), -1)
        ref_lp = logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0]
        ref = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    return ref_lp, ref


def test_gguf_tokenizer_and_chat_template():
    with track(Engine(None, dtype="float32")) as engine:
        tok = engine.tokenizer
        ids = tok.encode("Hello world 2024!")
        assert tok.decode(ids) == "Hello world 2024!"
        # SmolLM's vocabulary splits digits one by one.
        assert [tok.decode([i]) for i in ids[-5:-1]] == ["2", "0", "2", "4"]
        chat = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        assert tok.decode(chat[:1], skip_special_tokens=False) == "<|im_start|>"
        out = engine.generate([chat], max_new_tokens=12)[0]
        assert "Paris" in out.text
