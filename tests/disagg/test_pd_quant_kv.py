"""PD disaggregation with a quantized KV cache (ARCHITECTURE.md, 'The KV room' and
'Prefill/decode disaggregation'): a prefill Engine and a decode Engine both with int8 KV
continue prompts exactly as one int8 Engine does (the pages' rows carry their scales through
the transfer); a decode whose KV dtype differs is refused at start-up with a sentence naming
the flag."""
from __future__ import annotations

import random

import pytest

from pipefill import Engine, PDInfo
from pipefill.base.platform import free_port
from pipefill.disagg.launch import write_secret_file

from conftest import save_tiny_model, track, wait_until
from test_pd_engine import both, pages_free

pytestmark = pytest.mark.slow  # three engines with PD services

COMMON = dict(dtype="float32", page_size=16, threads_per_stage=1, chunked_prefill_size=64,
              max_total_tokens=4096, max_model_len=256, kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    """(model, secret file, bootstrap port, the int8 prefill Engine)."""
    model = save_tiny_model("llama", tmp_path_factory.mktemp("pd-qkv"))
    secret = write_secret_file(str(tmp_path_factory.mktemp("pd-qkv-secret")))
    port = free_port()
    with track(Engine(model, disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                      cluster_secret_file=secret, **COMMON)) as engine:
        yield model, secret, port, engine


def test_int8_pair_continues_as_one_int8_engine(prefill):
    model, secret, port, prefill_engine = prefill
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (40, 150)]  # 150: three chunks
    with track(Engine(model, **COMMON)) as alone:
        want = [o.output_ids for o in alone.generate(prompts, max_new_tokens=8)]
    with track(Engine(model, disaggregation_mode="decode", cluster_secret_file=secret,
                      **COMMON)) as decode:
        rooms = [PDInfo(301, "127.0.0.1", port), PDInfo(302, "127.0.0.1", port)]
        first, outs, _ = both(
            lambda: prefill_engine.generate(prompts, max_new_tokens=8, pd=rooms),
            lambda: decode.generate(prompts, max_new_tokens=8, pd=rooms))
        assert not isinstance(first, Exception), first
        assert not isinstance(outs, Exception), outs
        assert [o.output_ids for o in outs] == want
        assert [f.output_ids for f in first] == [w[:1] for w in want]
        assert wait_until(lambda: pages_free(prefill_engine, decode))


def test_a_decode_with_another_kv_dtype_is_refused_with_a_sentence(prefill):
    model, secret, port, _ = prefill
    with pytest.raises(Exception, match="start both with the same --dtype and "
                                        "--kv-cache-dtype"):
        track(Engine(model, disaggregation_mode="decode", cluster_secret_file=secret,
                     disaggregation_prefill_bootstrap=f"127.0.0.1:{port}",
                     **{**COMMON, "kv_cache_dtype": "auto"}))
