"""Gemma 3's lean decode path (pipefill/model/families/gemma3_decode.py) against the family's
layer_forward and HF transformers.

A tiny Gemma 3 of head_dim 64 on 32-token pages (what the vector attention kernels take), its
global layers at irregular positions (1 and 4 of 5), windows of 24 tokens (shorter than most
prompts and than a page) and rope bases of their own:

* decode steps' logits bit-identical with the lean path on and off (fast_decode) at batch 8
  with mixed lengths, float32 and bfloat16, over a float32 or bfloat16 cache and an int8 one;
  a sequence's row alone equals its row in the batch;
* a second stage (whose layers are windowed by their model index, the residual arriving)
  equals one stage;
* lean decode steps' logprobs within 1e-4 of HF transformers' (float32) and their greedy
  tokens HF's, at batch 8 with different lengths and at batch 1 (and through the Engine,
  slow, where window pages are freed as decode goes);
* a stage whose attention is not a vector kernel (pages of 16: sdpa) keeps layer_forward.
"""
import pytest
import torch

from conftest import track
from pipefill import Engine
from pipefill.config import ServerArgs, resolve
from pipefill.kernels import decode_gemm
from pipefill.kernels.fused_ops import fused_available
from pipefill.model.attention import choose_backend
from pipefill.model.loader import WeightSource
from pipefill.runtime.stage import StageInfo, build_stage
from test_decode import LENGTHS, PROMPTS, assert_agrees, hf_greedy
from test_decode_step import PAGE, _decode, _lean_steps, _stage

TEXT = dict(vocab_size=512, hidden_size=128, intermediate_size=160, num_hidden_layers=5,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=24,
            query_pre_attn_scalar=48,
            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                         "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
            max_position_embeddings=1024)
NEW = 16


def _lean_path_runs() -> bool:
    backend, _ = choose_backend("auto", torch.float32, 64, PAGE, torch.device("cpu"),
                                windowed=True)
    return decode_gemm.available() and fused_available()[0] and backend != "sdpa"


pytestmark = pytest.mark.skipif(not _lean_path_runs(),
                                reason="no decode GEMM, fused ops or vector attention here")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(Gemma3TextConfig(**TEXT), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn_like(p))  # norms scale by 1 + w: w near 0
    path = str(tmp_path_factory.mktemp("gemma3"))
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"),
                                      ("float32", "int8")])
def test_lean_path_bits_equal_layer_forward(gemma, dtype, kv):
    if dtype == "bfloat16" and not decode_gemm.available(torch.bfloat16):
        pytest.skip("no bf16 decode GEMM path here")
    ex = _stage(gemma, dtype, kv_cache_dtype=kv)
    assert type(ex.model._decode).__name__ == "GemmaDecodeRunner"
    batch = list(range(8))
    general = _decode([ex], batch, fast=False)
    assert _lean_steps([ex]) == 0
    lean = _decode([ex], batch, fast=True)
    assert _lean_steps([ex]) == 1  # the 8-row buffers: the steps ran the lean path
    for s, (a, b) in enumerate(zip(general, lean)):
        assert torch.equal(a, b), f"step {s}: lean != layer_forward"
    alone = _decode([ex], [3], fast=True)
    for s, (a, b) in enumerate(zip(alone, lean)):
        assert torch.equal(a[0], b[3]), f"step {s}: batch-1 row != batch-8 row"


def test_lean_path_on_a_later_stage_equals_one_stage(gemma):
    one = _stage(gemma, "float32")
    split = [_stage(gemma, "float32", range(0, 2), 0, 2),
             _stage(gemma, "float32", range(2, 5), 1, 2)]
    batch = [0, 3, 5, 7]
    ref = _decode([one], batch, fast=False)
    got = _decode(split, batch, fast=True)
    assert _lean_steps(split) == 2
    for s, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"step {s}: two stages != one stage"


def test_sdpa_stage_keeps_layer_forward(gemma):
    source = WeightSource(gemma)
    args = resolve(ServerArgs(model_path=gemma, dtype="float32", page_size=16,
                              max_total_tokens=1024, threads_per_stage=1), source.config)
    ex = build_stage(args, source, StageInfo(0, 1, range(5)))
    assert ex.model._decode is None


def _hf_logprobs(path: str, prompts: list[list[int]], tokens: list[list[int]]) -> list:
    """Per prompt, HF float32 log-softmax rows after each of its prompt's last token and
    `tokens` but the last, from one forward over both."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for prompt, toks in zip(prompts, tokens):
            logits = model(torch.tensor([prompt + toks])).logits[0].float()
            rows.append(torch.log_softmax(logits[len(prompt) - 1:-1], -1))
    return rows


@pytest.mark.parametrize("which", [list(range(8)), [3]])
def test_decode_steps_match_hf(gemma, which):
    """Lean decode steps (batch 8 of different lengths, and batch 1) after a prefill: each
    step's logprobs within 1e-4 of HF's and the greedy tokens HF's, as the windows slide."""
    ex = _stage(gemma, "float32")
    steps = _decode([ex], which, fast=True, steps=NEW)
    assert _lean_steps([ex]) == 1
    prompts = [PROMPTS[i] for i in which]
    ours = [[int(row.argmax()) for row in rows] for rows in zip(*steps)]
    ref = hf_greedy(gemma, prompts, NEW + 1)
    assert max(LENGTHS[i] for i in which) + NEW > 2 * TEXT["sliding_window"]
    for mine, (tokens, gaps) in zip(ours, ref):
        assert_agrees(mine, tokens[1:], gaps[1:])
    hf_rows = _hf_logprobs(gemma, prompts, [r[0][:1] + m for r, m in zip(ref, ours)])
    for b, hf in enumerate(hf_rows):
        lean = torch.log_softmax(torch.stack([step[b] for step in steps]), -1)
        gap = (lean - hf[1:]).abs().max().item()
        assert gap < 1e-4, f"sequence {which[b]}: logprobs {gap:.2e} from HF's"


@pytest.mark.slow
def test_greedy_through_the_engine_matches_hf(gemma):
    """Batch 8 through the Engine, whose window pages are freed as decode goes (window tables
    with freed entries)."""
    ref = hf_greedy(gemma, PROMPTS, NEW)
    with track(Engine(gemma, dtype="float32", page_size=PAGE, threads_per_stage=1)) as e:
        batch = e.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)
    for out, (tokens, gaps) in zip(batch, ref):
        assert_agrees(out.output_ids, tokens, gaps)
