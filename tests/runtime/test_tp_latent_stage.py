"""DeepSeek (multi-head latent attention, DeepSeekMoE) under tensor parallelism with real
processes (one per rank, real gloo groups and the shared-memory all-reduce): float32 against
HF transformers on the same random weights (prompt logprobs within 1e-4, 16 greedy tokens
identical) through chunked prefill and decode, then a prefix-cache hit. V3's 3 heads at TP 2
(2 and 1: they do not divide; q LoRA, a dense first layer, experts split by expert) and V2's
4 heads at TP 2 (2 and 2; experts split by width), PP 2 x TP 2 and dynamic chunking; a PD
pair whose TP 2 prefill sends its rank 0's latents into a TP 1 decode; the CLI's refusals."""
import pytest

from conftest import assert_matches_hf, assert_prefix_hit_matches, hf_reference, track
from test_deepseek import PROMPT, save_deepseek
from test_tp_stage import run_cli
from pipefill import Engine

PAGE = 16
CHUNK = 37


class References(dict):
    """kind -> (folder, HF's reference), saved and run by HF on first use."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp = tmp_path_factory

        self.folders: dict[str, str] = {}

    def folder(self, kind: str) -> str:
        if kind not in self.folders:
            self.folders[kind] = save_deepseek(kind, self.tmp.mktemp(kind))
        return self.folders[kind]

    def __missing__(self, kind: str):
        path = self.folder(kind)
        self[kind] = (path, hf_reference(path, PROMPT, 16, full_forwards=True))
        return self[kind]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return References(tmp_path_factory)


def check(models, kind, chunk=CHUNK, **flags):
    path, ref = models[kind]
    with track(Engine(path, dtype="float32", page_size=PAGE, chunked_prefill_size=chunk,
                      threads_per_stage=1, **flags)) as engine:
        assert_matches_hf(engine, PROMPT, ref, None if flags.get("enable_dynamic_chunking")
                          else chunk)
        assert_prefix_hit_matches(engine, PROMPT, ref[1], PAGE)


@pytest.mark.slow
@pytest.mark.parametrize("kind,split", [("v3", "expert"), ("v2", "width")])
def test_tp2_matches_hf(models, kind, split):
    check(models, kind, tp_size=2, tp_moe_split=split)


@pytest.mark.slow
def test_pp2_tp2_matches_hf(models):
    check(models, "v3", chunk=32, tp_size=2, pp_size=2, pp_layer_partition="1,3")


@pytest.mark.slow
def test_tp2_dynamic_chunking_matches_hf(models):
    check(models, "v2", chunk=32, tp_size=2, enable_dynamic_chunking=True)


@pytest.mark.slow
def test_pd_tp2_prefill_into_tp1_decode(models, tmp_path):
    """The latent is one KV head every prefill rank holds whole (disagg/heads.latent_head_map):
    the decode takes rank 0's pages; its tokens and logprobs are one colocated engine's
    (test_pd_tp's prompts: several chunks, pages of 16)."""
    from pipefill.disagg.launch import write_secret_file
    from test_pd_tp import COMMON, NEW_TOKENS, PROMPTS, assert_same, run_pair
    path = models.folder("v3")
    with track(Engine(path, **COMMON)) as engine:
        want = [(o.output_ids, o.token_logprobs) for o in engine.generate(
            PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)]
    assert_same(run_pair(path, write_secret_file(str(tmp_path)), dict(tp_size=2), {}), want)


def test_cli_refuses_more_ranks_than_heads(models):
    out = run_cli("generate", "--model-path", models.folder("v3"), "--input-len", "8",
                  "--max-new-tokens", "1", "--tp-size", "4")
    assert out.returncode == 2, out.stderr
    assert "--tp-size 4 is larger than the model's 3 attention heads" in out.stderr
    assert "Traceback" not in out.stderr
