"""Shared fixtures: tiny random models of each family saved to temp folders, HF references,
and a page-integrity check after every test on every engine a test module started.

The tests live in folders that mirror the package's rooms (tests/kv for pipefill/kv, ...), with
the suites that cross every room (faults, fuzz, soak, hostile bytes, multi-node, floors) in
tests/cross. Suites reuse each other's helpers and fixtures by module name (`from test_server
import start_server`), so every folder is on the import path."""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import pytest
import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)

for _folder in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir()):
    if not _folder.name.startswith((".", "_")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(family: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    kw = {**TINY, **overrides}
    if family == "llama":  # Llama 3 style rope scaling, untied head
        return LlamaConfig(**kw, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "mistral":
        return MistralConfig(**kw, head_dim=16, sliding_window=None)
    if family == "qwen2":  # qkv bias, tied embeddings
        return Qwen2Config(**kw, tie_word_embeddings=True)
    if family == "qwen3":  # per-head q/k norm, explicit head_dim
        return Qwen3Config(**kw, head_dim=16)
    raise ValueError(family)


def save_tiny_model(family: str, path, seed: int = 0, init_std: float = 0.1,
                    **overrides) -> str:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides),
                                             dtype=torch.float32)
    # Random everything (biases and norms included) so that every weight path is exercised,
    # with logits far enough apart that greedy choices are not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, init_std)
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    return {f: save_tiny_model(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


def hf_reference(path: str, prompt: list[int], max_new_tokens: int, margins: bool = False,
                 full_forwards: bool = False):
    """(prompt logprobs, greedy continuation[, top-1 minus top-2 logprob at each step]) from
    HF transformers in float32. full_forwards: each token from a forward over the whole
    sequence so far rather than from generate's KV cache (for prompts of hundreds of tokens
    on the tiny llama, where the two part: see greedy_by_full_forwards)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)
        prompt_lp = logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0]
        if full_forwards:
            assert not margins
            return prompt_lp, greedy_by_full_forwards(model, prompt, max_new_tokens)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    if not margins:
        return prompt_lp, tokens
    gaps = [float(v[0] - v[1]) for v in (torch.log_softmax(s[0], -1).topk(2).values
                                         for s in out.scores)]
    return prompt_lp, tokens, gaps


def greedy_by_full_forwards(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens, each from a forward over the whole sequence. On the tiny llama (Llama 3
    rope scaling) with prompts of 300 and 2,400 tokens, HF's generate (KV cache, eager or
    SDPA) parts from its own full forward over the same sequence within 8 tokens (at 2,400:
    296 against 229 at step 2, by 0.026 nats); pipefill agrees with the full forward."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def single_stage(path: str, dtype: str, page_size: int = 16, source=None, **kw):
    """The engine's stage code holding every layer, built in this process (4,096 KV tokens,
    one thread); `source`: the path's WeightSource where the caller has one already."""
    from pipefill.config import ServerArgs, resolve
    from pipefill.model.loader import WeightSource
    from pipefill.runtime.stage import StageInfo, build_stage
    source = source or WeightSource(path)
    args = resolve(ServerArgs(model_path=path, dtype=dtype, page_size=page_size,
                              max_total_tokens=4096, threads_per_stage=1, **kw), source.config)
    return build_stage(args, source, StageInfo(0, 1, range(source.config.num_layers)))


def shared_layout_bytes(linears) -> int:
    """What the QuantLinears' 16-row layouts take of the shared 2 MiB-page mappings
    (kernels/huge_pages.py, each piece to its alignment): against huge_pages.shared_bytes()
    around a load, whether anything laid out there was dropped (its bytes stay resident)."""
    from pipefill.kernels import huge_pages
    return sum(huge_pages.shared_piece_bytes(p.raw) for lin in linears for p in lin.parts
               if p.rows16 and p.raw.nbytes < huge_pages.MIN_BYTES)


def assert_greedy_agrees(ours: list[int], ref: list[int], ref_margins: list[float],
                         min_margin: float = 0.1) -> None:
    """bf16 greedy decoding must follow the float32 reference until the reference itself is
    a near tie (its top two within min_margin nats); after a tie the texts may part."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert ref_margins[i] < min_margin, (
                f"token {i}: {a} != {b} although the reference margin is {ref_margins[i]:.3f}")
            return


def assert_matches_hf(engine, prompt: list[int], ref, chunk: int | None = None):
    """The engine's prompt logprobs within 1e-4 of ref's and its 16 greedy tokens identical
    (ref: hf_reference's pair); with `chunk`, the prompt ran in chunks of that size."""
    ref_lp, ref_tokens = ref
    out = engine.generate([prompt], max_new_tokens=16, return_prompt_logprobs=True,
                          ignore_eos=True)[0]
    assert out.output_ids == ref_tokens
    lp = torch.tensor(out.prompt_logprobs)
    assert (lp - ref_lp).abs().max().item() < 1e-4
    if chunk:
        assert out.metrics["chunk_sizes"] == [min(chunk, len(prompt) - s)
                                              for s in range(0, len(prompt), chunk)]
    return out


def assert_prefix_hit_matches(engine, prompt: list[int], ref_tokens: list[int], page: int):
    """The same prompt again, without prompt logprobs (those come from computed logits
    only): its pages come from the prefix cache, the tokens are the same, no page is held."""
    out = engine.generate([prompt], max_new_tokens=16, ignore_eos=True)[0]
    assert out.metrics["cached_tokens"] >= len(prompt) // page * page - page
    assert out.output_ids == ref_tokens
    assert_pages_free(engine)


_live_engines: list = []


def track(engine):
    _live_engines.append(engine)
    return engine


def kill_during_a_long_request(engine, victim: int, join_s: float):
    """SIGKILL the engine's process `victim` (an index into its stage processes) 0.5 s into a
    long greedy request; (the error, with the time it came, as {"at", "msg"}; the kill's time;
    every process's pid). Asserts the request ended within join_s rather than hung."""
    import os
    import signal
    import threading
    pids = [p.pid for p in engine._stages.procs]
    error = {}

    def request():
        try:
            engine.generate([[1] * 500], max_new_tokens=500, ignore_eos=True)
        except RuntimeError as err:
            error["at"], error["msg"] = time.monotonic(), str(err)

    t = threading.Thread(target=request)
    t.start()
    time.sleep(0.5)
    os.kill(pids[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    t.join(join_s)
    assert not t.is_alive(), "the request hung"
    return error, killed_at, pids


def assert_pages_free(engine) -> None:
    """No request holds a page: stage 0's pool is free except the pages the prefix cache keeps
    (all of them evictable), and every stage's own page map — replayed from the plans and
    checked on every micro-batch — has exactly as many pages in use as stage 0's pool."""
    stats = engine.stats()
    assert stats["pages_used"] == stats.get("cache_pages", 0), stats
    assert stats.get("cache_evictable_pages", 0) == stats.get("cache_pages", 0), stats
    assert stats.get("window_pages_used", 0) == stats.get("cache_window_pages", 0), stats
    for stage in stats["stages"]:
        assert stage["integrity"] == "ok", stats
        assert stage["pages_total"] == stats["pages_total"], stats
        assert stage["owned_pages"] == stats["pages_used"], stats
        # Window layers with pages of their own: every stage's replay agrees with stage 0's.
        assert stage.get("window_owned_pages") == stats.get("window_pages_used"), stats


def wait_until(cond, timeout_s=10.0) -> bool:
    """True once cond() holds (polled every 20 ms); False if it still fails after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture(autouse=True)
def _page_integrity():
    yield
    for engine in list(_live_engines):
        if engine._stages is None:
            _live_engines.remove(engine)
            continue
        assert_pages_free(engine)
    gc.collect()
