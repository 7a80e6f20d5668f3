"""PD across tensor-parallel sizes (ARCHITECTURE.md, 'KV heads across TP sizes'), real
processes: a prefill Engine and a decode Engine in this process, each with its own stage
processes (one per TP rank), paired through the prefill's bootstrap service. The model has 6
query and 3 KV heads, split by query heads at TP 2 (3 and 3; the ranks hold KV heads 0-1 and
1-2, head 1 on both), and the decode's ranks take them cut differently; prompts of several
chunks (37 tokens, pages of 16) cross chunk by chunk.
Greedy tokens and every token's logprob (float32) must be one colocated TP 1 engine's: TP 2 ->
TP 1 and TP 1 -> TP 2 over tcp, TP 2 -> TP 4 (a KV head on two decode ranks) and PP 2 x TP 2
-> TP 2 over Mooncake (slow)."""
from __future__ import annotations

import os
import random

import pytest

from pipefill import Engine, PDInfo
from pipefill.base.platform import free_port
from pipefill.disagg.launch import write_secret_file

from conftest import save_tiny_model, track, wait_until
from test_disagg_transfer import have_mooncake
from test_pd_engine import both, pages_free

PAGE = 16
SHAPE = dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
             intermediate_size=160)
COMMON = dict(dtype="float32", page_size=PAGE, threads_per_stage=1, chunked_prefill_size=37,
              max_total_tokens=2048, max_model_len=512)
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(512) for _ in range(n)] for n in (90, 41)]
NEW_TOKENS = 8
_rooms = iter(range(1000, 10**6))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("pd-tp"), **SHAPE)


@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    return write_secret_file(str(tmp_path_factory.mktemp("pd-tp-secret")))


@pytest.fixture(scope="module")
def reference(model):
    """One colocated engine at TP 1: the greedy tokens and their logprobs."""
    with track(Engine(model, **COMMON)) as engine:
        outs = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                               logprobs=True)
    return [(o.output_ids, o.token_logprobs) for o in outs]


def run_pair(model, secret, prefill_flags: dict, decode_flags: dict):
    """Both prompts through a prefill and a decode engine started with these flags; the
    decode's (tokens, logprobs) per prompt, after checking both engines let every page go."""
    port = free_port()
    prefill = track(Engine(model, disaggregation_mode="prefill", cluster_secret_file=secret,
                           disaggregation_bootstrap_port=port, **COMMON, **prefill_flags))
    try:
        with track(Engine(model, disaggregation_mode="decode", cluster_secret_file=secret,
                          **COMMON, **decode_flags)) as decode:
            # The leaders mapped their peers' KV files at start-up: no name is left behind.
            pids = prefill.stage_pids() + decode.stage_pids()
            assert not [n for n in os.listdir("/dev/shm")
                        if n.startswith("pipefill-kv-") and int(n.split("-")[2]) in pids]
            rooms = [PDInfo(next(_rooms), "127.0.0.1", port) for _ in PROMPTS]
            call = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, pd=rooms)
            first, outs, _ = both(lambda: prefill.generate(PROMPTS, **call),
                                  lambda: decode.generate(PROMPTS, **call))
            assert not isinstance(first, Exception), first
            assert not isinstance(outs, Exception), outs
            assert wait_until(lambda: pages_free(prefill, decode))
            return [(o.output_ids, o.token_logprobs) for o in outs]
    finally:
        prefill.shutdown()


def assert_same(got, want) -> None:
    for (ids, lps), (want_ids, want_lps) in zip(got, want):
        assert ids == want_ids
        assert len(lps) == NEW_TOKENS
        assert lps == pytest.approx(want_lps, abs=1e-4)


def test_prefill_tp2_into_decode_tp1(model, secret, reference):
    assert_same(run_pair(model, secret, dict(tp_size=2), {}), reference)


def test_prefill_tp1_into_decode_tp2(model, secret, reference):
    assert_same(run_pair(model, secret, {}, dict(tp_size=2)), reference)


MOONCAKE = dict(disaggregation_transfer_backend="mooncake")
needs_mooncake = pytest.mark.skipif(not have_mooncake(), reason="mooncake-transfer-engine-"
                                    "non-cuda is not installed")


@pytest.mark.slow
@needs_mooncake
def test_prefill_tp2_into_decode_tp4_over_mooncake(model, secret, reference):
    """At TP 4 the decode keeps KV head 0 on two ranks: both get it."""
    assert_same(run_pair(model, secret, dict(tp_size=2, **MOONCAKE),
                         dict(tp_size=4, **MOONCAKE)), reference)


@pytest.mark.slow
@needs_mooncake
def test_prefill_pp2_tp2_into_decode_tp1_over_mooncake(model, secret, reference):
    assert_same(run_pair(model, secret, dict(tp_size=2, pp_size=2, **MOONCAKE), MOONCAKE),
                reference)


@pytest.mark.slow
def test_pipefill_serve_tp2_prefill_behind_the_router(tmp_path):
    """`pipefill serve` at --tp-size 2 (prefill) and 1 (decode) behind the unmodified
    sglang-router: greedy text and every logprob are a colocated server's."""
    from test_pd_router import (client, completion, free_port, spawn_router, spawn_server,
                                stop, wait_healthy, wait_pages_free)
    from pipefill.model.loader import WeightSource, resolve_model_path
    from pipefill.model.tokenizer import load_tokenizer
    path = save_tiny_model("llama", tmp_path / "m", vocab_size=49152,
                           max_position_embeddings=4096, **SHAPE)
    load_tokenizer(WeightSource(resolve_model_path(None))).hf.save_pretrained(path)
    bport, procs, urls = free_port(), {}, {}
    try:
        procs["prefill"], urls["prefill"] = spawn_server(
            path, "--tp-size", "2", "--disaggregation-mode", "prefill",
            "--disaggregation-bootstrap-port", str(bport))
        procs["decode"], urls["decode"] = spawn_server(path, "--disaggregation-mode", "decode")
        procs["ref"], urls["ref"] = spawn_server(path)
        for name in list(procs):
            wait_healthy(procs[name], urls[name])
        procs["router"], urls["router"] = spawn_router(urls["prefill"], bport, urls["decode"])
        wait_healthy(procs["router"], urls["router"], "/readiness", 60)
        for prompt in ["The capital of France is", "word " * 150]:  # 150: three chunks
            got = completion(client(urls["router"]), prompt)
            want = completion(client(urls["ref"]), prompt)
            assert got[0] == want[0] and len(got[1]) == 12
            assert got[1] == pytest.approx(want[1], abs=1e-4)
        wait_pages_free(urls["prefill"], 10)
        wait_pages_free(urls["decode"], 10)
    finally:
        stop(*procs.values())
