"""Dynamic chunking in the engine: through PP2 it gives fixed chunking's results, a failed fit
falls back to fixed chunks, and the start-up profile is cached on disk. (The background
profile has its own file, test_background_profile.py.)"""
import json

import pytest
import torch

from conftest import assert_pages_free, save_tiny_model, track
from pipefill import Engine
from pipefill.chunking.cost import ChunkSizePredictor, profile_lengths
from pipefill.chunking.profile import ProfileBench, cache_path, profile_key
from pipefill.chunking.startup import build_chunk_policy
from pipefill.config import ServerArgs

A, B, C = 1e-5, 1e-4, 1e-3  # a made-up convex chunk cost, so chunks visibly shrink
PROMPT = [(11 * i + 5) % 512 for i in range(600)]


@pytest.fixture(scope="module")
def model7(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama7dc"), num_hidden_layers=7,
                           max_position_embeddings=4096)


def write_profile(cache_dir, model, c0, page, layers, seconds_of):
    """Puts a profile where stage 0 looks for it (the key is what the stage computes)."""
    lengths = profile_lengths(c0)
    key = profile_key(model, "float32", layers, 1, c0, page, "KVCache", lengths)
    path = cache_path(str(cache_dir), key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "lengths": lengths,
                                "seconds": [seconds_of(x) for x in lengths]}))


def engine(model, cache_dir, **kw):
    kw = {"chunked_prefill_size": 256, **kw}
    return track(Engine(model, dtype="float32", page_size=16, threads_per_stage=1, pp_size=2,
                        dynamic_chunking_profile_cache=str(cache_dir), **kw))


def run(e):
    out = e.generate([PROMPT], max_new_tokens=12, ignore_eos=True,
                     return_prompt_logprobs=True)[0]
    assert_pages_free(e)
    return out


def test_dynamic_equals_fixed_through_pp2(model7, tmp_path):
    write_profile(tmp_path, model7, 256, 16, range(0, 3), lambda x: A * x * x + B * x + C)
    with engine(model7, tmp_path) as e:
        fixed = run(e)
    with engine(model7, tmp_path, enable_dynamic_chunking=True,
                dynamic_chunking_smooth_factor=0.75) as e:
        assert e.chunking["mode"] == "dynamic" and e.chunking["profile_cache_hit"]
        dyn = run(e)
    expected = ChunkSizePredictor(256, 16, 0.75)
    expected.fit(profile_lengths(256), [A * x * x + B * x + C for x in profile_lengths(256)])
    assert dyn.metrics["chunk_sizes"] == expected.chunk_sequence(len(PROMPT))
    assert dyn.metrics["chunk_sizes"][:2] == [256, 128]  # smaller after the first
    assert fixed.metrics["chunk_sizes"] == [256, 256, 88]
    assert dyn.output_ids == fixed.output_ids
    diff = torch.tensor(dyn.prompt_logprobs) - torch.tensor(fixed.prompt_logprobs)
    assert diff.abs().max().item() < 1e-5


def test_concave_profile_falls_back_to_fixed(model7, tmp_path):
    write_profile(tmp_path, model7, 256, 16, range(0, 3), lambda x: -A * x * x + 1e-2 * x)
    with engine(model7, tmp_path, enable_dynamic_chunking=True) as e:
        assert e.chunking["mode"] == "fixed" and "not convex" in e.chunking["fallback"]
        assert run(e).metrics["chunk_sizes"] == [256, 256, 88]


def test_blocking_profile_cache_is_hit_on_the_second_start(model7, tmp_path):
    # C0 1024: the tiny model's profile up to 1,280 tokens is clearly convex, where at 256 the
    # constant per-step cost hides the quadratic term and timing noise may fit a concave one.
    with engine(model7, tmp_path, enable_dynamic_chunking=True, chunked_prefill_size=1024,
                dynamic_chunking_profile="blocking") as e:
        first = e.chunking
    with engine(model7, tmp_path, enable_dynamic_chunking=True, chunked_prefill_size=1024) as e:
        second = e.chunking
    # What the cache must give: the same profile, so the same decision. Not whether that
    # decision is dynamic: the tiny model's 0.2 s profile is mostly timing noise (a clean CI
    # run fitted it concave, 60% RMS error, and fell back to fixed chunks on both starts).
    assert not first["profile_cache_hit"] and second["profile_cache_hit"]
    assert first["profile"] == second["profile"]
    assert first["mode"] == second["mode"] in ("dynamic", "fixed")


def test_failed_profile_never_stops_start_up(tmp_path):
    def broken(num_tokens, pages):
        raise RuntimeError("out of memory")
    args = ServerArgs(pp_size=2, enable_dynamic_chunking=True, max_model_len=4096,
                      dynamic_chunking_profile_cache=str(tmp_path), chunked_prefill_size=512,
                      dynamic_chunking_smooth_factor=0.75, dtype="float32",
                      dynamic_chunking_profile="blocking")
    model_file = tmp_path / "model.bin"
    model_file.write_bytes(b"x")
    bench = ProfileBench(broken, page_size=16, cache_kind="KVCache", hidden_size=64)
    policy = build_chunk_policy(args, bench, str(model_file), range(0, 2), [2, 2])
    assert policy.c0 == 512 and policy.sizer is None
    assert "out of memory" in policy.info["fallback"]
