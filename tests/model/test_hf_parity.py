"""Every family against HF transformers (float32): prompt logprobs within 1e-4 and 16 greedy
tokens identical, for chunks of 1 page, 3 pages, not a multiple of the page, larger than the
prompt."""
import random

import pytest
import torch

from conftest import FAMILIES, hf_reference, track
from pipefill import Engine

PAGE = 16
CHUNKS = {"1-page": PAGE, "3-pages": 3 * PAGE, "odd": 37, "whole": 256}
_rng = random.Random(7)
PROMPT = [_rng.randrange(512) for _ in range(100)]


@pytest.fixture(scope="module")
def references(tiny_models):
    return {f: hf_reference(tiny_models[f], PROMPT, 16) for f in FAMILIES}


@pytest.mark.parametrize("chunk", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_hf(family, chunk, tiny_models, references):
    ref_lp, ref_tokens = references[family]
    with track(Engine(tiny_models[family], dtype="float32", page_size=PAGE,
                      chunked_prefill_size=chunk, threads_per_stage=1)) as engine:
        out = engine.generate([PROMPT], max_new_tokens=16, return_prompt_logprobs=True,
                              ignore_eos=True)[0]
        assert out.output_ids == ref_tokens
        lp = torch.tensor(out.prompt_logprobs)
        assert lp.shape == ref_lp.shape
        assert (lp - ref_lp).abs().max().item() < 1e-4
        expected = [min(chunk, len(PROMPT) - s) for s in range(0, len(PROMPT), chunk)]
        assert out.metrics["chunk_sizes"] == expected
        from conftest import assert_pages_free
        assert_pages_free(engine)
