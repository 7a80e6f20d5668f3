"""Tensor parallelism inside a stage with real processes (one per rank, real gloo groups and
the shared-memory all-reduce): float32 against one rank (prompt logprobs within 1e-4,
greedy tokens identical) through chunked prefill and batched decode, on a model with 6 query
and 3 KV heads: TP 2 (split by query heads, 3 and 3, KV head 1 on both ranks: unequal groups on
the sdpa path), TP 4 (uneven query shares, a KV head replicated),
PP 2 x TP 2; the Qwen families' bias and q/k norms at TP 2; the CLI's refusals (those of the
CUDA path among them); a killed
rank failing its stage's requests fast."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from conftest import (assert_matches_hf, assert_pages_free, hf_reference,
                      kill_during_a_long_request, save_tiny_model, track)
from pipefill import Engine
from pipefill.config import ServerArgs
from pipefill.model.loader import WeightSource
from pipefill.model.tensor_parallel import choose_head_split, tp_shard

PAGE = 16
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(512) for _ in range(n)] for n in (90, 41)]
NEW_TOKENS = 8
# Heads of 16 (the lean decode path on shards is checked in tests/model/test_tp_shards.py).
SHAPE = dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
             intermediate_size=160)


@pytest.fixture(scope="module")
def odd_llama(tmp_path_factory):
    """6 query heads over 3 KV heads (TP 2: 3 and 3 query heads over KV heads 0-1 and 1-2;
    TP 4: KV head 0 on two ranks), MLP width 160: at TP 4 ranks of 48, 48, 32 and 32
    columns, widths the fused kernels take."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("tp-llama"), **SHAPE)


def generate(path, **flags):
    """Both prompts in one batch (their decode steps batched), chunks of 37 tokens."""
    with track(Engine(path, dtype="float32", page_size=PAGE, threads_per_stage=1,
                      chunked_prefill_size=37, **flags)) as engine:
        outs = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                               return_prompt_logprobs=True)
        assert_pages_free(engine)
    return [(torch.tensor(o.prompt_logprobs), o.output_ids, o.metrics) for o in outs]


@pytest.fixture(scope="module")
def references(odd_llama):
    """One rank's results; TP is held to TP 1 here. Not to HF's generate: on the 90-token
    prompt its first greedy choice is a near tie (top-2 margin 0.008) where HF's cached
    generate parts from HF's own full forward, which pipefill at TP 1 matches (prompt
    logprobs within 3.4e-6, the same 8 tokens)."""
    return [(lp, ids) for lp, ids, _ in generate(odd_llama)]


def assert_tp_matches_tp1(path, refs, **flags):
    for (lp, ids, metrics), (ref_lp, ref_ids) in zip(generate(path, **flags), refs):
        assert ids == ref_ids
        assert (lp - ref_lp).abs().max().item() < 1e-4
        assert metrics["chunk_sizes"][0] == 37


def test_tp2_matches_tp1(odd_llama, references):
    assert_tp_matches_tp1(odd_llama, references, tp_size=2)


@pytest.mark.slow
def test_tp4_uneven_heads_replicated_kv_matches_tp1(odd_llama, references):
    assert_tp_matches_tp1(odd_llama, references, tp_size=4)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["per_rank", "leader"])
def test_pp2_tp2_matches_tp1(odd_llama, references, transport):
    """Both stage transports; chunks of 37 rows share out unevenly (19 and 18), the decode
    steps' 2 rows one each."""
    assert_tp_matches_tp1(odd_llama, references, tp_size=2, pp_size=2,
                          tp_stage_transport=transport)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_tp2_matches_tp1(family, tmp_path):
    """Qwen2: q/k/v bias cut with its rows, tied embeddings; Qwen3: per-head q/k norms
    (heads of 16: the general path)."""
    path = save_tiny_model(family, tmp_path / family, **SHAPE)
    refs = [(lp, ids) for lp, ids, _ in generate(path)]
    assert_tp_matches_tp1(path, refs, tp_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("heads, kv_heads, tp", [(9, 3, 2), (8, 2, 3)], ids=["9q3kv-tp2",
                                                                              "8q2kv-tp3"])
def test_query_head_split_matches_hf(heads, kv_heads, tp, tmp_path):
    """Heads split by query heads, a KV head whose group straddles two ranks on both (9 over 3
    at TP 2: 5 and 4 heads; 8 over 2 at TP 3: 3, 3 and 2), heads of 64 on the vector kernel
    with its unequal groups: float32 prompt logprobs within 1e-4 of HF's and 16 greedy tokens
    identical (HF's greedy by full forwards: its cached generate parts from its own forward on
    this tiny model, conftest.greedy_by_full_forwards), through chunks of 37."""
    path = save_tiny_model("llama", tmp_path / "m", num_attention_heads=heads,
                           num_key_value_heads=kv_heads, hidden_size=64 * heads,
                           intermediate_size=256)
    cfg = WeightSource(path).config
    assert choose_head_split(cfg, tp)[0] == "queries" and tp_shard(cfg, 1, tp).q_per_kv
    with track(Engine(path, dtype="float32", page_size=32, threads_per_stage=1,
                      chunked_prefill_size=37, tp_size=tp)) as engine:
        assert_matches_hf(engine, PROMPTS[0],
                          hf_reference(path, PROMPTS[0], 16, full_forwards=True), chunk=37)


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "pipefill.cli.main", *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flags, sentence", [
    (["--tp-size", "0"], "--tp-size must be at least 1"),
    (["--tp-size", "7"], "larger than the model's 6 attention heads"),
    (["--device", "cuda", "--tp-size", "2", "--pp-size", "2", "--tp-stage-transport",
      "per_rank"], "--tp-stage-transport per_rank runs on --device cpu only"),
    pytest.param(["--device", "cuda", "--tp-size", "2"],
                 "--device cuda runs 2 process(es) on this node", marks=pytest.mark.skipif(
                     torch.cuda.device_count() >= 2, reason="two GPUs: it would run")),
], ids=["zero", "more-ranks-than-heads", "cuda-per-rank", "cuda-without-gpus"])
def test_cli_refuses(odd_llama, flags, sentence):
    out = run_cli("generate", "--model-path", odd_llama, "--input-len", "8",
                  "--max-new-tokens", "1", *flags)
    assert out.returncode == 2, out.stderr
    assert sentence in out.stderr
    assert "Traceback" not in out.stderr


def test_a_pd_role_under_tp_on_cuda_is_refused():
    from pipefill.frontend import check_cuda_tp
    args = dict(device="cuda", tp_size=2, disaggregation_insecure=True)
    check_cuda_tp(ServerArgs(**args))
    with pytest.raises(ValueError, match="--disaggregation-mode prefill with --tp-size 2 runs "
                       "on --device cpu only"):
        check_cuda_tp(ServerArgs(disaggregation_mode="prefill", **args))


@pytest.mark.slow
def test_killed_tp_rank_fails_its_requests_and_leaves_no_process(odd_llama):
    e = Engine(odd_llama, dtype="float32", page_size=PAGE, chunked_prefill_size=16, tp_size=2,
               threads_per_stage=1, max_model_len=1024)
    # Process 1 is the leader's TP peer.
    error, killed_at, pids = kill_during_a_long_request(e, 1, join_s=30)
    assert "stage 0 TP rank 1" in error["msg"] and "SIGKILL" in error["msg"]
    assert error["at"] - killed_at < 20
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_tp2_across_two_nodes_matches_tp1(odd_llama, tmp_path):
    """One stage, its two TP ranks launched as two nodes on 127.0.0.1: their sums go over
    gloo (the log says so), and the results are TP 1's."""
    from pipefill.base.platform import free_port
    common = ["generate", "--model-path", odd_llama, "--dtype", "float32", "--page-size",
              str(PAGE), "--chunked-prefill-size", "37", "--tp-size", "2", "--nnodes", "2",
              "--dist-init-addr", f"127.0.0.1:{free_port()}", "--input-len", "90",
              "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--threads-per-stage", "1",
              "--log-level", "info"]
    node1 = subprocess.Popen([sys.executable, "-m", "pipefill.cli.main", *common,
                              "--node-rank", "1"], stderr=subprocess.PIPE, text=True)
    node0 = subprocess.Popen([sys.executable, "-m", "pipefill.cli.main", *common,
                              "--node-rank", "0", "--prompt-logprobs", "--output-json",
                              str(tmp_path / "out.json")], stderr=subprocess.PIPE, text=True)
    try:
        err0 = node0.communicate(timeout=180)[1]
        err1 = node1.communicate(timeout=30)[1]
    finally:
        for p in (node0, node1):
            p.kill()
    assert node0.returncode == 0 and node1.returncode == 0, err0 + err1
    assert "TP all-reduce over gloo (the stage's TP ranks are on different nodes)" in err1
    got = json.load(open(tmp_path / "out.json"))
    with track(Engine(odd_llama, dtype="float32", page_size=PAGE, threads_per_stage=1,
                      chunked_prefill_size=37)) as engine:
        ref = engine.generate([got["prompt_ids"]], max_new_tokens=NEW_TOKENS, ignore_eos=True,
                              return_prompt_logprobs=True)[0]
    assert got["output_ids"] == ref.output_ids
    diff = torch.tensor(got["prompt_logprobs"]) - torch.tensor(ref.prompt_logprobs)
    assert diff.abs().max().item() < 1e-4


LONG = [_rng.randrange(512) for _ in range(300)]
SHARED = LONG[:200] + [7, 8, 9]


def long_then_shared(path, **flags):
    """LONG (with its prompt logprobs), then SHARED (its first 200 tokens from the prefix
    cache): prompt logprobs (None for SHARED), greedy tokens and metrics of each."""
    with track(Engine(path, dtype="float32", page_size=PAGE, threads_per_stage=1,
                      **flags)) as engine:
        outs = [engine.generate([p], max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                return_prompt_logprobs=p is LONG)[0] for p in (LONG, SHARED)]
        assert_pages_free(engine)
    return [(torch.tensor(o.prompt_logprobs) if o.prompt_logprobs else None, o.output_ids,
             o.metrics) for o in outs]


@pytest.mark.slow
def test_pp2_tp2_per_rank_dynamic_chunks_and_a_prefix_hit(odd_llama):
    """The per-rank stage transport under dynamic chunking (chunks of changing, odd sizes
    shared out over the ranks) and a prefix-cache hit, against one rank with fixed chunks."""
    refs = long_then_shared(odd_llama, chunked_prefill_size=64)
    outs = long_then_shared(odd_llama, chunked_prefill_size=64, enable_dynamic_chunking=True,
                            pp_size=2, tp_size=2, tp_stage_transport="per_rank")
    assert (outs[0][0] - refs[0][0]).abs().max().item() < 1e-4
    assert [ids for _, ids, _ in outs] == [ids for _, ids, _ in refs]
    assert sum(outs[0][2]["chunk_sizes"]) == len(LONG)
    assert outs[1][2]["cached_tokens"] == 200 // PAGE * PAGE


@pytest.mark.slow
def test_decode_key_split_over_a_long_context_matches_tp1(tmp_path):
    """9 query heads over 3 KV heads at TP 2 (5:4, KV head 1 on both ranks), a 3,200-token
    prompt: its decode steps split KV head 1's keys between the ranks (real processes, the
    shared-memory gathers); the greedy tokens equal one rank's and the key split turned off."""
    path = save_tiny_model("llama", tmp_path / "m", num_attention_heads=9,
                           num_key_value_heads=3, hidden_size=576, intermediate_size=256,
                           num_hidden_layers=2, max_position_embeddings=4096)
    prompt = [_rng.randrange(512) for _ in range(3200)]

    def greedy(**flags):
        with track(Engine(path, dtype="float32", page_size=32, threads_per_stage=1,
                          max_model_len=3400, **flags)) as engine:
            out = engine.generate([prompt], max_new_tokens=12, ignore_eos=True)[0]
            assert_pages_free(engine)
        return out.output_ids

    want = greedy()
    assert greedy(tp_size=2) == want
    assert greedy(tp_size=2, tp_decode_key_split=False) == want


def test_a_peer_replays_its_leaders_window_page_bookkeeping():
    """A PD decode's window pages, allocated and written outside the plans, reach a TP peer's
    window page owners as its other pages reach its page owners ('Window pages'); a peer that
    keeps no window pages refuses them with a sentence. No processes."""
    from pipefill.kv.cache import KVCache, WindowedKVCache
    from pipefill.kv.tiers import StageKV
    from pipefill.runtime.tp import apply_owners
    kv = StageKV(WindowedKVCache([True, False], 8, PAGE, 1, 8, torch.float32))
    for op in (("allocate", "r", [1, 2]), ("window_allocate", "r", [5]), ("written", [1, 2]),
               ("window_written", [5])):
        apply_owners(kv, op)
    assert kv.owners.owner == {1: "r", 2: "r"} and kv.owners.written == {1, 2}
    assert kv.window_owners.owner == {5: "r"} and kv.window_owners.written == {5}
    with pytest.raises(RuntimeError, match="keeps none"):
        apply_owners(StageKV(KVCache(2, 8, PAGE, 1, 8, torch.float32)), ("window_written", [5]))
