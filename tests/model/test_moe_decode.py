"""Mixture-of-experts decode on the lean path (model/decode_step.py) and the experts' packed
copies (model/moe.py), on tiny models of the sizes the vector attention kernels take (head_dim
64, 32-token pages):

* decode logits are bit-identical on the lean path and the general layer code, Qwen3-MoE (its
  per-head q/k norms, a dense layer among sparse ones) and Mixtral (3 experts, top-1: rows of a
  batch that share no expert), float32 and bfloat16;
* a sequence's logits are bit-identical alone and inside a batch of 8 whose rows share experts
  (each chosen expert read once for all its rows);
* greedy continuations of a batch of 8 through the Engine equal HF transformers (float32).
"""
import pytest
import torch

from conftest import track
from pipefill import Engine
from pipefill.kernels import decode_gemm
from test_decode import NEW, PROMPTS, assert_agrees, hf_greedy
from test_decode_step import _decode, _lean_path_runs, _lean_steps, _stage, PAGE
from test_moe_family import save_moe

pytestmark = pytest.mark.skipif(not _lean_path_runs(),
                                reason="no decode GEMM, fused ops or vector attention here")

SHAPE = dict(vocab_size=512, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
             head_dim=64, max_position_embeddings=1024, num_hidden_layers=3)
MOE = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=5, num_experts_per_tok=2,
                                         norm_topk_prob=True, moe_intermediate_size=32,
                                         intermediate_size=96, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=3, num_experts_per_tok=1,
                                      intermediate_size=48, sliding_window=None)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return {k: save_moe(k, tmp_path_factory.mktemp(k), MOE, SHAPE, seed=2) for k in MOE}


@pytest.mark.parametrize("kind,dtype", [("qwen3_moe", "float32"), ("mixtral", "float32"),
                                        ("qwen3_moe", "bfloat16")])
def test_lean_path_bits_equal_general_path(models, kind, dtype):
    if dtype == "bfloat16" and not decode_gemm.available(torch.bfloat16):
        pytest.skip("no bf16 decode GEMM path here")
    ex = _stage(models[kind], dtype)
    assert ex.model._decode is not None, "the MoE family's lean path should serve this stage"
    sparse = [w.moe for w in ex.model.w.layers if w.moe is not None]
    assert sparse and all(m.experts.linears[0].packed is not None for m in sparse)
    batch = list(range(8))
    general = _decode([ex], batch, fast=False)
    lean = _decode([ex], batch, fast=True)
    assert _lean_steps([ex]) == 1
    ids = sparse[0].last_ids  # the last step's routing: experts shared by several rows
    assert torch.unique(ids).numel() < ids.numel()
    for s, (a, b) in enumerate(zip(general, lean)):
        assert torch.equal(a, b), f"step {s}: lean != general"
    alone = _decode([ex], [3], fast=True)
    for s, (a, b) in enumerate(zip(alone, lean)):
        assert torch.equal(a[0], b[3]), f"step {s}: batch-1 row != batch-8 row"


@pytest.mark.parametrize("kind", list(MOE))
def test_greedy_batch_through_the_engine_matches_hf(models, kind):
    ref = hf_greedy(models[kind], PROMPTS, NEW // 4)
    with track(Engine(models[kind], dtype="float32", page_size=PAGE,
                      threads_per_stage=1)) as e:
        batch = [o.output_ids for o in e.generate(PROMPTS, max_new_tokens=NEW // 4,
                                                  ignore_eos=True)]
    for ours, (tokens, gaps) in zip(batch, ref):
        assert_agrees(ours, tokens, gaps)
