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
                               ignore_eos=True)
        for out, prompt, (ref_lp, ref_tokens) in zip(outs, PROMPTS, references):
            assert out.output_ids == ref_tokens
            assert (torch.tensor(out.prompt_logprobs) - ref_lp).abs().max().item() < 1e-4
            assert out.metrics["chunk_sizes"] == [min(32, len(prompt) - s)
                                                  for s in range(0, len(prompt), 32)]
        assert_pages_free(engine)
