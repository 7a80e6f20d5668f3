"""Gemma 3 through a PD pair (ARCHITECTURE.md, 'Window pages', 'Prefill/decode
disaggregation'): a tiny random Gemma 3 whose 7-token windows are shorter than the prompt, in
float32, prefilled by a prefill Engine in chunks and continued by a decode Engine, gives the
greedy tokens and token logprobs (within 1e-4) of one plain Engine (a PD pair serves no prompt
logprobs). Both sides keep the window layers' KV in window pages freed outside the window: the
pair moves the global layers' pages for every token and the window layers' only for the pages
the decode reads from (and the window kept for its prefix cache). A TP 2 prefill into a TP 1
decode and the reverse (each rank's window pages re-sliced to the other side's heads)."""
from __future__ import annotations

import random

import pytest

from pipefill import Engine, PDInfo
from pipefill.base.platform import free_port
from pipefill.disagg.launch import write_secret_file
from pipefill.kv.window import received_window

from conftest import track, wait_until
from test_gemma3_family import TEXT, save_gemma
from test_disagg_transfer import have_mooncake
from test_pd_engine import both, pages_free

PAGE = 16
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
    sent = run_pair(tmp_path, "irregular", dict(pp_size=prefill_pp),
                    dict(pp_size=decode_pp), disaggregation_transfer_backend=backend)
    # 4 of the 9 pages' window layers, to each decode stage that prefill stage 0 serves.
    assert sent["kv_window_pages_sent"] == sent["kv_pages_sent"] // 9 * 4


@pytest.mark.slow
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)],
                         ids=["tp2-into-tp1", "tp1-into-tp2"])
def test_gemma_across_tp_sizes_equals_one_engine(tmp_path, prefill_tp, decode_tp):
    """4 query heads over 2 KV heads, a 20-token window: each TP 2 rank holds one KV head
    and its window pages, which the pair re-slices to the other side's ranks ('KV heads
    across TP sizes')."""
    run_pair(tmp_path, "pattern", dict(tp_size=prefill_tp), dict(tp_size=decode_tp))


def run_pair(tmp_path, kind: str, prefill_flags: dict, decode_flags: dict, **common) -> dict:
    """PROMPTS through a PD pair of the `kind` model against one plain engine: the decode's
    greedy tokens and logprobs, the prefill's first token, window pages on both sides and
    what crossed; the prefill's stats."""
    model = save_gemma(kind, tmp_path / "gemma")
    window = TEXT[kind]["sliding_window"]
    with track(Engine(model, **COMMON)) as plain:
        want = plain.generate(PROMPTS, max_new_tokens=16, ignore_eos=True, logprobs=True)
    secret = write_secret_file(str(tmp_path))
    port = free_port()
    pd = dict(cluster_secret_file=secret, **COMMON, **common)
    with track(Engine(model, disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                      **prefill_flags, **pd)) as prefill, \
            track(Engine(model, disaggregation_mode="decode", **decode_flags, **pd)) as decode:
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
    # them, to each decode stage that prefill stage 0 serves.
    pages = [-(-len(p) // PAGE) for p in PROMPTS]
    num_dests = sent["kv_pages_sent"] // sum(pages)
    assert num_dests >= 1 and sent["kv_pages_sent"] == num_dests * sum(pages)
    assert sent["kv_window_pages_sent"] == num_dests * sum(
        sum(received_window(n, len(p), PAGE, window)) for n, p in zip(pages, PROMPTS))
    return sent
