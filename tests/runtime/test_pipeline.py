"""Pipelines of 2-4 stage processes give the PP1 result (float32: greedy identical, prompt
logprobs within 1e-5), for even and uneven partitions and several chunk sizes; concurrent
requests equal serial ones; two nodes on 127.0.0.1; a killed stage fails fast and cleanly."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import assert_pages_free, kill_during_a_long_request, save_tiny_model, track
from pipefill import Engine

PAGE = 16
PROMPTS = [[(5 * i + 3 * n) % 512 for i in range(n)] for n in (120, 33, 77)]


@pytest.fixture(scope="module")
def model7(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama7"), num_hidden_layers=7)


def run(path, **kw):
    with track(Engine(path, dtype="float32", page_size=PAGE, threads_per_stage=1, **kw)) as e:
        outs = e.generate(PROMPTS, max_new_tokens=10, ignore_eos=True,
                          return_prompt_logprobs=True)
        assert_pages_free(e)
        return outs


def assert_same(outs, ref):
    for a, b in zip(outs, ref):
        assert a.output_ids == b.output_ids
        diff = torch.tensor(a.prompt_logprobs) - torch.tensor(b.prompt_logprobs)
        assert diff.abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def reference(model7):
    return {chunk: run(model7, chunked_prefill_size=chunk) for chunk in (PAGE, 3 * PAGE, 256)}


PIPELINES = [(2, None), (2, "3,4"), (3, None), (3, "1,3,3"), (4, None), (4, "2,2,2,1")]


@pytest.mark.parametrize("pp, partition", PIPELINES,
                         ids=[f"pp{p}-{part or 'default'}" for p, part in PIPELINES])
def test_pipeline_equals_pp1(model7, reference, pp, partition):
    outs = run(model7, pp_size=pp, pp_layer_partition=partition, chunked_prefill_size=3 * PAGE)
    assert_same(outs, reference[3 * PAGE])


@pytest.mark.parametrize("chunk", [PAGE, 256], ids=["1-page", "whole-prompt"])
@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_chunk_sizes(model7, reference, pp, chunk):
    assert_same(run(model7, pp_size=pp, chunked_prefill_size=chunk), reference[chunk])


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [PAGE, 3 * PAGE, 256])
@pytest.mark.parametrize("pp, partition", PIPELINES)
def test_pipeline_full_matrix(model7, reference, pp, partition, chunk):
    outs = run(model7, pp_size=pp, pp_layer_partition=partition, chunked_prefill_size=chunk,
               pp_async_batch_depth=1)
    assert_same(outs, reference[chunk])


def test_concurrent_requests_equal_serial(model7):
    with track(Engine(model7, dtype="float32", page_size=PAGE, threads_per_stage=1, pp_size=2,
                      chunked_prefill_size=32, pp_async_batch_depth=2)) as e:
        together = e.generate(PROMPTS, max_new_tokens=12, ignore_eos=True,
                              return_prompt_logprobs=True)
        serial = [e.generate([p], max_new_tokens=12, ignore_eos=True,
                             return_prompt_logprobs=True)[0] for p in PROMPTS]
        assert_same(together, serial)


def test_qwen3_even_partition(tiny_models):
    ref = run(tiny_models["qwen3"], chunked_prefill_size=48)
    assert_same(run(tiny_models["qwen3"], pp_size=2, chunked_prefill_size=48), ref)


def test_bad_partition_is_a_sentence(model7):
    with pytest.raises(ValueError, match="sums to 6 but the model has 7 layers"):
        Engine(model7, pp_size=2, pp_layer_partition="3,3")


def cli(*argv, **kw):
    return subprocess.Popen([sys.executable, "-m", "pipefill.cli.main", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_two_nodes_on_localhost(model7, tmp_path):
    from pipefill.base.platform import free_port
    port = free_port()
    common = ["generate", "--model-path", model7, "--dtype", "float32", "--page-size", "16",
              "--chunked-prefill-size", "32", "--pp-size", "2", "--nnodes", "2",
              "--dist-init-addr", f"127.0.0.1:{port}", "--input-len", "90",
              "--max-new-tokens", "8", "--threads-per-stage", "1"]
    node1 = cli(*common, "--node-rank", "1")
    node0 = cli(*common, "--node-rank", "0", "--output-json", str(tmp_path / "out.json"))
    try:
        _, err0 = node0.communicate(timeout=120)
        _, err1 = node1.communicate(timeout=30)
    finally:
        for p in (node0, node1):
            p.kill()
    assert node0.returncode == 0, err0
    assert node1.returncode == 0, err1
    got = json.load(open(tmp_path / "out.json"))
    with track(Engine(model7, dtype="float32", page_size=PAGE, chunked_prefill_size=32)) as e:
        ref = e.generate([got["prompt_ids"]], max_new_tokens=8)[0]
    assert got["output_ids"] == ref.output_ids


def test_killed_stage_fails_fast_and_leaves_no_process(model7):
    e = Engine(model7, dtype="float32", page_size=PAGE, chunked_prefill_size=16, pp_size=3,
               threads_per_stage=1, max_model_len=1024)
    error, killed_at, pids = kill_during_a_long_request(e, 1, join_s=15)
    assert "stage 1" in error["msg"] and "SIGKILL" in error["msg"]
    assert error["at"] - killed_at < 10
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate([[1, 2]])
