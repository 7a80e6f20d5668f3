"""Mixture-of-experts models under tensor parallelism with real processes (one per rank):
float32 against HF transformers (prompt logprobs within 1e-4, 16 greedy tokens identical)
through chunked prefill and decode, with the routed experts split by width and by expert:
Qwen3-MoE with 5 experts at TP 2 (uneven: 3 and 2 experts, or widths 32 and 16, a dense layer
among the sparse ones), Qwen2-MoE's shared expert (widths 32 and 16), Mixtral (3 experts: 2 and
1); the CLI's refusal of an expert split with fewer experts than ranks."""
import pytest

from conftest import assert_matches_hf, hf_reference, track
from test_moe_family import MOE, PROMPT, save_moe
from test_tp_stage import run_cli
from pipefill import Engine

CHUNK = 37
# Experts of width 48: uneven width shares at TP 2 (3 units of MLP_GRAIN; HF's grouped GEMM
# wants widths of whole 16 bytes).
WIDTHS = {"qwen3_moe": dict(moe_intermediate_size=48), "qwen2_moe": dict(moe_intermediate_size=48),
          "mixtral": {}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """HF references from full forwards (see test_moe_family.moe_models)."""
    paths = {k: save_moe(k, tmp_path_factory.mktemp(k), **WIDTHS[k]) for k in MOE}
    return {k: (p, hf_reference(p, PROMPT, 16, full_forwards=True)) for k, p in paths.items()}


def check_tp2(models, kind, split):
    path, ref = models[kind]
    with track(Engine(path, dtype="float32", page_size=16, chunked_prefill_size=CHUNK,
                      threads_per_stage=1, tp_size=2, tp_moe_split=split)) as engine:
        assert_matches_hf(engine, PROMPT, ref, CHUNK)


@pytest.mark.slow
@pytest.mark.parametrize("split", ["width", "expert"])
def test_qwen3_moe_tp2_matches_hf(models, split):
    check_tp2(models, "qwen3_moe", split)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
@pytest.mark.parametrize("split", ["width", "expert"])
def test_shared_expert_and_mixtral_tp2_match_hf(models, kind, split):
    check_tp2(models, kind, split)


def test_cli_refuses_an_expert_split_over_more_ranks_than_experts(models):
    path, _ = models["mixtral"]  # 3 experts
    out = run_cli("generate", "--model-path", path, "--input-len", "8", "--max-new-tokens", "1",
                  "--tp-size", "4", "--tp-moe-split", "expert")
    assert out.returncode == 2, out.stderr
    assert "3 experts are fewer than --tp-size 4 ranks" in out.stderr
    assert "Traceback" not in out.stderr
