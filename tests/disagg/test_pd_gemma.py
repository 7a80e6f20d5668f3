"""Gemma 3 through a PD pair (ARCHITECTURE.md, 'Window pages', 'Prefill/decode
disaggregation'): a tiny random Gemma 3 whose 7-token windows are shorter than the prompt, in
float32, prefilled by a prefill Engine in chunks and continued by a decode Engine, gives the
greedy tokens and token logprobs (within 1e-4) of one plain Engine (a PD pair serves no prompt
logprobs). Both sides keep the window layers' KV in window pages freed outside the window: the
pair moves the global layers' pages for every token and the window layers' only for the pages
the decode reads from (and the window kept for its prefix cache)."""
from __future__ import annotations

import random

import pytest

from pipefill import Engine, PDInfo
from pipefill.base.platform import free_port
from pipefill.disagg.launch import write_secret_file
from pipefill.kv.window import received_window

from conftest import track, wait_until
from test_gemma3_family import save_gemma
from test_disagg_transfer import have_mooncake
from test_pd_engine import both, pages_free

PAGE, WINDOW = 16, 7  # the "irregular" model's window
COMMON = dict(dtype="float32", page_size=PAGE, threads_per_stage=1, chunked_prefill_size=32,
              max_total_tokens=2048)
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(512) for _ in range(n)] for n in (90, 45)]  # 3 and 2 chunks


@pytest.mark.slow
@pytest.mark.parametrize("prefill_pp,decode_pp,backend", [
    (1, 1, "tcp"), (2, 3, "tcp"),
    pytest.param(2, 3, "mooncake", marks=pytest.mark.skipif(
        not have_mooncake(), reason="mooncake-transfer-engine-non-cuda is not installed"))])
def test_gemma_through_pd_equals_one_engine(tmp_path, prefill_pp, decode_pp, backend):
    """(2, 3): the decode's stages take their window layers from prefill stages split
    elsewhere, a later stage's window pages announced down its pipe; over mooncake the
    prefill writes them into the decode's window pages."""
    model = save_gemma("irregular", tmp_path / "gemma")
    with track(Engine(model, **COMMON)) as plain:
        want = plain.generate(PROMPTS, max_new_tokens=16, ignore_eos=True, logprobs=True)
    secret = write_secret_file(str(tmp_path))
    port = free_port()
    pd = dict(cluster_secret_file=secret, disaggregation_transfer_backend=backend, **COMMON)
    with track(Engine(model, disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                      pp_size=prefill_pp, **pd)) as prefill, \
            track(Engine(model, disaggregation_mode="decode", pp_size=decode_pp, **pd)) as decode:
        rooms = [PDInfo(301, "127.0.0.1", port), PDInfo(302, "127.0.0.1", port)]
        first, outs, _ = both(
            lambda: prefill.generate(PROMPTS, max_new_tokens=16, ignore_eos=True, pd=rooms,
                                     logprobs=True),
            lambda: decode.generate(PROMPTS, max_new_tokens=16, ignore_eos=True, pd=rooms,
                                    logprobs=True))
        assert not isinstance(first, Exception), first
        assert not isinstance(outs, Exception), outs
        for w, f, out in zip(want, first, outs):
            assert out.output_ids == w.output_ids
            assert f.output_ids == w.output_ids[:1]  # the prefill computes the first token
            assert out.token_logprobs == pytest.approx(w.token_logprobs, abs=1e-4)
        assert wait_until(lambda: pages_free(prefill, decode))
        sent, got = prefill.stats(), decode.stats()
    # Window pages on both sides, freed as the prompts went by.
    assert sent["window_pages_peak"] < sum(-(-len(p) // PAGE) for p in PROMPTS)
    assert got["window_pages_total"] > 0
    # Every page of the global layers crossed, the window layers' only where the decode keeps
    # them: 4 of the 9 pages, to each decode stage that prefill stage 0 serves.
    pages = [-(-len(p) // PAGE) for p in PROMPTS]
    num_dests = sent["kv_pages_sent"] // sum(pages)
    assert num_dests >= 1 and sent["kv_pages_sent"] == num_dests * sum(pages)
    assert sent["kv_window_pages_sent"] == num_dests * sum(
        sum(received_window(n, len(p), PAGE, WINDOW)) for n, p in zip(pages, PROMPTS))
    assert sent["kv_window_pages_sent"] == num_dests * 4
