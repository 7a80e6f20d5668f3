"""A quantized KV cache through the prefix-cache tiers (ARCHITECTURE.md, 'The KV room'): a
page's rows carry their scales, so an L1 hit (pages shared in the pool), a host-tier (L2)
load and a storage-tier (L3) fetch after a restart give the tokens of an engine without the
cache; a storage folder written with int8 KV is never read by an engine with another KV
dtype (its keys name the dtype: a miss, then a recompute)."""
import pytest

from conftest import save_tiny_model, track
from pipefill import Engine
from test_hicache import run_engine, storage_run, workload


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama_qkv"), num_hidden_layers=3)


def test_int8_pool_and_host_hits_equal_no_cache(model):
    on, stats = run_engine(model, enable_hierarchical_cache=True, kv_cache_dtype="int8")
    off, _ = run_engine(model, disable_radix_cache=True, kv_cache_dtype="int8")
    assert on == off
    assert stats["cache_hit_tokens"] > 0 and stats["cache_hit_tokens_host"] > 0
    assert stats["host_loaded_pages"] > 0


def outputs_without_cache(path, prompts, kv: str):
    with track(Engine(path, dtype="float32", page_size=16, threads_per_stage=1,
                      disable_radix_cache=True, kv_cache_dtype=kv)) as e:
        return [e.generate([p], max_new_tokens=6, ignore_eos=True)[0].output_ids
                for p in prompts]


def test_int8_storage_survives_a_restart_and_is_not_read_as_another_dtype(model, tmp_path):
    prompts = workload()[:2]
    ref = outputs_without_cache(model, prompts, "int8")
    out, cached, _ = storage_run(model, tmp_path, prompts, kv_cache_dtype="int8")
    assert out == ref and cached == [0, 0]
    out, cached, stats = storage_run(model, tmp_path, prompts, kv_cache_dtype="int8")
    assert out == ref and cached == [96, 96]
    assert stats["cache_hit_tokens_storage"] == 192
    out, cached, _ = storage_run(model, tmp_path, prompts, kv_cache_dtype="fp8_e4m3")
    assert cached == [0, 0]
    assert out == outputs_without_cache(model, prompts, "fp8_e4m3")
