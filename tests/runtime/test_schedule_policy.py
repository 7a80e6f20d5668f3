"""Every --schedule-policy gives HF's tokens: two long prompts and a short one submitted
together (their chunks interleave under fair, run by priority under priority) each get the
logprobs and greedy continuation HF transformers computes for them alone, with the chunk sizes
they get alone."""
import random

import pytest
import torch

from conftest import assert_pages_free, hf_reference, track
from pipefill import Engine

_rng = random.Random(3)
PROMPTS = [[_rng.randrange(512) for _ in range(n)] for n in (120, 70, 9)]


@pytest.fixture(scope="module")
def references(tiny_models):
    return [hf_reference(tiny_models["qwen2"], p, 8) for p in PROMPTS]


@pytest.mark.parametrize("policy", ["fcfs", "fair", "priority"])
def test_policy_keeps_hf_tokens(policy, tiny_models, references):
    with track(Engine(tiny_models["qwen2"], dtype="float32", page_size=16,
                      chunked_prefill_size=32, max_prefill_tokens=48, threads_per_stage=1,
                      schedule_policy=policy)) as engine:
        outs = engine.generate(PROMPTS, max_new_tokens=8, return_prompt_logprobs=True,
                               ignore_eos=True, priority=[0, 5, 0])
        if policy == "priority":  # the second prompt's prefill ran first, whole
            assert outs[1].metrics["ttft_s"] < outs[0].metrics["ttft_s"]
        for out, prompt, (ref_lp, ref_tokens) in zip(outs, PROMPTS, references):
            assert out.output_ids == ref_tokens
            assert (torch.tensor(out.prompt_logprobs) - ref_lp).abs().max().item() < 1e-4
            assert out.metrics["chunk_sizes"] == [min(32, len(prompt) - s)
                                                  for s in range(0, len(prompt), 32)]
        assert_pages_free(engine)


def test_priority_in_the_api_is_an_integer():
    from pydantic import ValidationError
    from pipefill.server.protocol import ChatCompletionRequest
    msg = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest.model_validate({"messages": msg, "priority": 3}).priority == 3
    for bad in ("high", 1.5, None):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"messages": msg, "priority": bad})
    from pipefill.server.app import ApiError, check_limits
    with pytest.raises(ApiError, match="priority must fit in 64 bits"):
        check_limits(ChatCompletionRequest.model_validate({"messages": msg, "priority": 2**70}))
