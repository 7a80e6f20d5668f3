"""Gemma 3 under tensor parallelism with real processes (one per rank, real gloo groups and
the shared-memory all-reduce), float32 against HF transformers: prompt logprobs within 1e-4,
16 greedy tokens identical (ARCHITECTURE.md, 'Tensor parallelism inside a stage').

Tiny random Gemma 3 models from tests/model/test_gemma3_family.py: "kernels" has Gemma 3
270M's attention (4 query heads over 1 KV head of 256, a 20-token window shorter than the
prompt: the vector kernels and their packed window pages), "irregular" 3 query heads over 1 KV
head of 48 (sdpa), a 7-token window, global layers 0 and 3 of 5, two rope bases and a logit
softcap. Neither head count divides by every TP size: TP 2 takes query heads 2 and 1 (or 2
and 2), TP 3 2, 1 and 1, the KV head on every rank. Each rank holds its heads' window pages
and frees them as stage 0's page ops say."""
import random

import pytest

from conftest import assert_matches_hf, assert_pages_free, assert_prefix_hit_matches, \
    hf_reference, track
from test_gemma3_family import TEXT, save_gemma
from pipefill import Engine
from pipefill.kv.window import ring_pages, window_before
from pipefill.model.loader import WeightSource
from pipefill.model.tensor_parallel import tp_shard

_rng = random.Random(5)
PROMPT = [_rng.randrange(512) for _ in range(90)]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """{kind: (path, HF's prompt logprobs and greedy tokens)}."""
    paths = {k: save_gemma(k, tmp_path_factory.mktemp(k)) for k in ("kernels", "irregular")}
    return {k: (p, hf_reference(p, PROMPT, 16)) for k, p in paths.items()}


def engine(path, page, **flags):
    return track(Engine(path, dtype="float32", page_size=page, threads_per_stage=1, **flags))


def test_tp2_on_the_kernels_matches_hf_and_a_prefix_hit(gemma):
    """Heads of 256 on the vector kernel at TP 2 (2 query heads a rank, the KV head on both),
    chunks of 37 that start mid-window, then the same prompt from the prefix cache."""
    path, ref = gemma["kernels"]
    cfg = WeightSource(path).config
    assert [len(tp_shard(cfg, r, 2).q_heads) for r in range(2)] == [2, 2]
    with engine(path, 32, chunked_prefill_size=37, tp_size=2) as e:
        assert_matches_hf(e, PROMPT, ref, 37)
        assert_prefix_hit_matches(e, PROMPT, ref[1], 32)


@pytest.mark.slow
@pytest.mark.parametrize("kind,page,tp", [("kernels", 32, 3), ("irregular", 16, 2),
                                          ("irregular", 16, 3)])
def test_uneven_heads_match_hf(gemma, kind, page, tp):
    """Query heads 2:1:1 (4 over TP 3) and 2:1 (3 over TP 2), one a rank at TP 3 of 3;
    dynamic chunking, then a prefix-cache hit."""
    path, ref = gemma[kind]
    cfg = WeightSource(path).config
    heads = [len(tp_shard(cfg, r, tp).q_heads) for r in range(tp)]
    assert sum(heads) == cfg.num_heads and all(len(tp_shard(cfg, r, tp).kv_heads) == 1
                                               for r in range(tp))
    with engine(path, page, chunked_prefill_size=32, enable_dynamic_chunking=True,
                tp_size=tp) as e:
        assert_matches_hf(e, PROMPT, ref)
        assert_prefix_hit_matches(e, PROMPT, ref[1], page)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["leader", "per_rank"])
def test_pp2_tp2_matches_hf(gemma, transport):
    """Global layers 0 and 3 of 5 split 2,3 over two stages of two ranks."""
    path, ref = gemma["irregular"]
    with engine(path, 16, chunked_prefill_size=32, pp_size=2, tp_size=2,
                pp_layer_partition="2,3", tp_stage_transport=transport) as e:
        assert_matches_hf(e, PROMPT, ref, 32)
        assert_prefix_hit_matches(e, PROMPT, ref[1], 16)


LONG_PAGE, LONG_CHUNK = 4, 16
WINDOW = TEXT["irregular"]["sliding_window"]
LONG = [_rng.randrange(512) for _ in range(40 * WINDOW)]


def window_bound(prompt_len: int) -> int:
    """Window pages one sequence may hold (as test_gemma3_family's): its ring (a window and a
    piece) and the window before its prompt's last cacheable page boundary."""
    kept = window_before((prompt_len - 1) // LONG_PAGE, LONG_PAGE, WINDOW)
    return ring_pages(LONG_PAGE, WINDOW) + len(kept)


@pytest.mark.slow
def test_window_pages_are_freed_on_every_rank(gemma):
    """A prompt 40 windows long at TP 2: HF parity, and the window pool (every rank replays
    the same page ops over its own heads' window pages) holds its ring, not the prompt, in
    prefill and through a long decode. HF's greedy tokens by full forwards: its cached
    generate parts from its own full forward at token 14 (a 0.04-nat margin), where one rank
    agrees with the full forward as TP 2 does."""
    path = gemma["irregular"][0]
    ref = hf_reference(path, LONG, 16, full_forwards=True)
    with engine(path, LONG_PAGE, chunked_prefill_size=LONG_CHUNK, tp_size=2) as e:
        assert_matches_hf(e, LONG, ref, LONG_CHUNK)
        stats = e.stats()
        assert stats["pages_peak"] >= len(LONG) // LONG_PAGE
        assert stats["window_pages_peak"] <= window_bound(len(LONG)) < len(LONG) // LONG_PAGE / 4
        e.generate([LONG[:30]], max_new_tokens=120, ignore_eos=True)
        assert e.stats()["window_pages_peak"] <= max(
            stats["window_pages_peak"], stats["window_pages_used"] + window_bound(30))
        assert_pages_free(e)
