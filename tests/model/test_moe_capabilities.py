"""The mixture-of-experts families through the capabilities dense models have, against HF
transformers in float32 on the tiny random configs of test_moe_family.py: dynamic chunking
through an uneven pipeline (chunks of the fitted sizes, logprobs within 1e-4, greedy tokens
identical), a prompt sharing a cached prefix, a routing tie at the top-k boundary in every
layer (the chosen experts are torch.topk's, as in HF), and (slow) PD disaggregation through
the router with a prefix-cache hit whose token logprobs stay HF's."""
import random

import pytest
import torch

from conftest import assert_pages_free, hf_reference, track
from pipefill import Engine
from pipefill.chunking.cost import ChunkSizePredictor, profile_lengths
from test_dynamic_chunking import A, B, C, write_profile
from test_moe_family import PAGE, PROMPT, check, save_moe

_rng = random.Random(5)
LONG = [_rng.randrange(512) for _ in range(600)]
C0 = 256


def cost(x):
    return A * x * x + B * x + C


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return save_moe("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe_caps"))


def test_dynamic_chunking_and_a_cached_prefix_through_an_uneven_pipeline(qwen3, tmp_path):
    """PP 2 split 1,3 (the dense layer 1 on stage 1), dynamic chunking from a profile on disk:
    the chunks shrink as the fit says and the output is HF's; then a prompt sharing 300 tokens
    of it reads them from the prefix cache and still decodes HF's tokens."""
    write_profile(tmp_path, qwen3, C0, PAGE, range(0, 1), cost)
    shared = LONG[:300] + [7, 8, 9, 10, 11]
    ref_long = hf_reference(qwen3, LONG, 16, full_forwards=True)
    ref_shared = hf_reference(qwen3, shared, 16, full_forwards=True)[1]
    with track(Engine(qwen3, dtype="float32", page_size=PAGE, threads_per_stage=1, pp_size=2,
                      pp_layer_partition="1,3", chunked_prefill_size=C0,
                      enable_dynamic_chunking=True,
                      dynamic_chunking_profile_cache=str(tmp_path))) as engine:
        assert engine.chunking["mode"] == "dynamic" and engine.chunking["profile_cache_hit"]
        out = check(engine, ref_long, prompt=LONG)
        expected = ChunkSizePredictor(C0, PAGE, 0.75)
        expected.fit(profile_lengths(C0), [cost(x) for x in profile_lengths(C0)])
        assert out.metrics["chunk_sizes"] == expected.chunk_sequence(len(LONG))
        assert out.metrics["chunk_sizes"][:2] == [256, 128]
        hit = engine.generate([shared], max_new_tokens=16, ignore_eos=True)[0]
        assert hit.metrics["cached_tokens"] == 300 // PAGE * PAGE
        assert hit.output_ids == ref_shared
        assert_pages_free(engine)


def tie_routers(path: str) -> None:
    """Router rows of experts 1 and 2 made equal in every layer, with one nonzero weight (0.5
    on the first feature) so that their logits tie exactly in any GEMM, whatever order it
    sums in."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[1:3] = 0.0
            layer.mlp.gate.weight[1:3, 0] = 0.5
    model.save_pretrained(path)


def hf_choices_at_ties(path: str, prompt: list[int]) -> int:
    """How many (layer, token) routings of HF's forward chose between the tied experts at the
    top-1 boundary (both above expert 0)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ties = []

    def count(module, args, out):
        logits = out[0]
        assert torch.equal(logits[:, 1], logits[:, 2])
        ties.append(int((logits[:, 1] > logits[:, 0]).sum()))
    hooks = [layer.mlp.gate.register_forward_hook(count) for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    return sum(ties)


def test_a_routing_tie_picks_the_experts_hf_picks(tmp_path):
    """Mixtral top-1 of 3 with experts 1 and 2 tied: wherever they lead, torch.topk's choice
    decides which expert runs, and pipefill's logprobs stay HF's."""
    path = save_moe("mixtral", tmp_path)
    tie_routers(path)
    assert hf_choices_at_ties(path, PROMPT) > 20
    ref = hf_reference(path, PROMPT, 16, full_forwards=True)
    with track(Engine(path, dtype="float32", page_size=PAGE, chunked_prefill_size=32,
                      threads_per_stage=1)) as engine:
        check(engine, ref, 32)


def hf_token_logprobs(path: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy continuation (full forwards) and each token's logprob."""
    from transformers import AutoModelForCausalLM
    tokens = hf_reference(path, prompt, n, full_forwards=True)[1]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return tokens, lp.tolist()


@pytest.mark.slow
def test_pd_and_a_prefix_hit_match_hf(tmp_path):
    """Qwen2-MoE (shared expert, every second layer sparse) behind the router: a prefill
    server (PP 2) and a decode server give HF's greedy tokens and logprobs; a colocated server
    serves a prompt sharing a cached prefix with HF's logprobs too."""
    from test_pd_router import client, start_pd, stop
    from pipefill.model.loader import WeightSource, resolve_model_path
    from pipefill.model.tokenizer import load_tokenizer
    path = save_moe("qwen2_moe", tmp_path, vocab_size=49152)
    tokenizer = load_tokenizer(WeightSource(resolve_model_path(None)))
    tokenizer.hf.save_pretrained(path)
    # Text prompts (the router takes no token ids); the second shares the first's start.
    prompt = " ".join(str(_rng.randrange(1000)) for _ in range(60))
    shared = prompt[:len(prompt) // 2] + " and then something else"
    ids = {p: tokenizer.encode(p) for p in (prompt, shared)}
    common = next(i for i, (a, b) in enumerate(zip(*ids.values())) if a != b)
    assert common >= PAGE
    procs, urls = start_pd(path, 2)
    try:
        for url, p, cached in ((urls["router"], prompt, None), (urls["ref"], prompt, 0),
                               (urls["ref"], shared, common // PAGE * PAGE),
                               (urls["router"], shared, None)):
            out = client(url).completions.create(model="m", prompt=p, max_tokens=12,
                                                 temperature=0, logprobs=1)
            got = out.choices[0].logprobs.token_logprobs
            tokens, want = hf_token_logprobs(path, ids[p], len(got))
            assert out.choices[0].text == tokenizer.decode(tokens)
            assert got == pytest.approx(want, abs=1e-4)
            if cached is not None:
                assert out.usage.prompt_tokens_details.cached_tokens == cached
    finally:
        stop(*procs.values())
