"""The decode step's lean path (pipefill/model/decode_step.py) against the general layer code.

The lean path runs when the stage has fused ops, a vector attention kernel (head_dim 64/128,
pages a multiple of 32) and packed decode GEMMs; the other decode tests' tiny models (head_dim
16, 16-token pages) never reach it, so these use head_dim 64 and 32-token pages.

* Logits of decode steps are bit-identical with the lean path on and off (fast_decode), at batch
  1 and 8 with mixed context lengths, float32 and bfloat16, with a qkv bias (qwen2), and on the
  second stage of a two-stage split (the residual arrives from the previous stage).
* A sequence's logits are bit-identical alone and inside a batch of 8 on the lean path.
* Greedy continuations of 64 tokens through the Engine equal HF transformers (float32), batch 8
  and batch 1.
* Steps the lean path does not fit (a prefill, more rows than --decode-gemm-max-rows, packed
  copies switched off) take the general path.
"""
import pytest
import torch

from conftest import save_tiny_model, track
from pipefill import Engine
from pipefill.config import ServerArgs, resolve
from pipefill.kernels import decode_gemm
from pipefill.kernels.fused_ops import fused_available
from pipefill.model.loader import WeightSource
from pipefill.runtime.executor import Activations
from pipefill.runtime.stage import StageInfo, build_stage
from pipefill.base.plan import SampleSpec, SeqWork, StepPlan
from test_decode import LENGTHS, NEW, PROMPTS, assert_agrees, hf_greedy

PAGE = 32
SHAPE = dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
             intermediate_size=256)  # head_dim 64: the vector attention kernels' size


def _lean_path_runs() -> bool:
    from pipefill.model.attention import choose_backend
    backend, _ = choose_backend("auto", torch.float32, 64, PAGE, torch.device("cpu"))
    return decode_gemm.available() and fused_available()[0] and backend != "sdpa"


pytestmark = pytest.mark.skipif(not _lean_path_runs(),
                                reason="no decode GEMM, fused ops or vector attention here")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return {f: save_tiny_model(f, tmp_path_factory.mktemp(f"{f}64"), **SHAPE)
            for f in ("llama", "qwen2")}


def _stage(path, dtype, layers=None, rank=0, size=1, **kw):
    source = WeightSource(path)
    args = resolve(ServerArgs(model_path=path, dtype=dtype, page_size=PAGE, pp_size=size,
                              max_total_tokens=2048, threads_per_stage=1, **kw), source.config)
    layers = layers or range(source.config.num_layers)
    return build_stage(args, source, StageInfo(rank, size, layers))


def _plan(seqs: dict, tables, start) -> StepPlan:
    spec = SampleSpec(0.0, 1.0, -1, 0, 0, None)
    works = []
    for i, toks in seqs.items():
        end = start[i] + len(toks)
        works.append(SeqWork(f"s{i}", start[i], end, toks, tables[i][:-(-end // PAGE)], spec))
    return StepPlan(-1, works)  # -1: a scratch plan, the test owns the pages


def _run(stages, plan) -> torch.Tensor:
    """Forward through the stages in order -> the logits of each sequence's last token."""
    acts = None
    for ex in stages:
        out, _ = ex.forward(plan, acts)
        acts = Activations(out.hidden.clone(), out.residual.clone(), out.logit_rows_only)
    rows = torch.cumsum(torch.tensor([w.num_tokens for w in plan.seqs]), 0) - 1
    if acts.logit_rows_only:  # the last layer kept each sequence's last row only
        rows = torch.arange(len(plan.seqs))
    return stages[-1].model.logits(acts.hidden, acts.residual, rows)


def _decode(stages, which: list[int], fast: bool, steps: int = 5) -> list[torch.Tensor]:
    """Prefills every prompt (general path), then `steps` greedy decode steps of the sequences
    `which` in one batch -> each step's logits [len(which), vocab]."""
    for ex in stages:
        ex.model.fast_decode = fast
    tables = [list(range(i * 8, (i + 1) * 8)) for i in range(len(PROMPTS))]
    with torch.inference_mode():
        toks = {i: int(_run(stages, _plan({i: p}, tables, [0] * 8))[0].argmax())
                for i, p in enumerate(PROMPTS)}
        out = []
        for s in range(steps):
            pos = {i: LENGTHS[i] + s for i in which}
            logits = _run(stages, _plan({i: [toks[i]] for i in which}, tables, pos))
            out.append(logits.clone())
            toks = {i: int(row.argmax()) for i, row in zip(which, logits)}
    return out


def _lean_steps(stages) -> int:
    return sum(len(ex.model._decode.buffers) for ex in stages)


@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("llama", "bfloat16"),
                                          ("qwen2", "float32")])
def test_lean_path_bits_equal_general_path(models, family, dtype):
    if dtype == "bfloat16" and not decode_gemm.available(torch.bfloat16):
        pytest.skip("no bf16 decode GEMM path here")
    ex = _stage(models[family], dtype)
    assert ex.model._decode is not None, "the lean path should serve this stage"
    batch = list(range(8))
    general = _decode([ex], batch, fast=False)
    assert _lean_steps([ex]) == 0
    lean = _decode([ex], batch, fast=True)
    assert _lean_steps([ex]) == 1  # the 8-row buffers: the steps ran the lean path
    for s, (a, b) in enumerate(zip(general, lean)):
        assert torch.equal(a, b), f"step {s}: lean != general"
    alone = _decode([ex], [3], fast=True)
    for s, (a, b) in enumerate(zip(alone, lean)):
        assert torch.equal(a[0], b[3]), f"step {s}: batch-1 row != batch-8 row"


def test_lean_path_on_a_later_stage_equals_one_stage(models):
    path = models["llama"]
    one = _stage(path, "float32")
    split = [_stage(path, "float32", range(0, 2), 0, 2), _stage(path, "float32", range(2, 4), 1, 2)]
    batch = [0, 3, 5]
    ref = _decode([one], batch, fast=False)
    got = _decode(split, batch, fast=True)
    assert _lean_steps(split) == 2
    for s, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"step {s}: two stages != one stage"


def test_steps_the_lean_path_does_not_fit_take_the_general_path(models):
    ex = _stage(models["llama"], "float32", decode_gemm_max_rows=4)
    assert ex.model._decode is not None
    _decode([ex], list(range(8)), fast=True, steps=2)  # 8 rows > 4: torch, general path
    assert _lean_steps([ex]) == 0
    _decode([ex], [1, 2], fast=True, steps=2)
    assert list(ex.model._decode.buffers) == [2]
    from pipefill.model.decode_step import DecodeRunner
    ex.model.w.layers[1].q_norm = torch.ones(64)  # Qwen3's per-head q/k norms: general path
    assert not DecodeRunner.supports(ex.model)


@pytest.fixture(scope="module")
def hf_tokens(models):
    return hf_greedy(models["qwen2"], PROMPTS, NEW)


def test_greedy_through_the_engine_matches_hf(models, hf_tokens):
    kw = dict(dtype="float32", page_size=PAGE, threads_per_stage=1)
    with track(Engine(models["qwen2"], **kw)) as e:
        batch = [o.output_ids for o in e.generate(PROMPTS, max_new_tokens=NEW,
                                                  ignore_eos=True)]
        alone = e.generate(PROMPTS[3:4], max_new_tokens=NEW, ignore_eos=True)[0].output_ids
    for ours, (ref, gaps) in zip(batch, hf_tokens):
        assert_agrees(ours, ref, gaps)
    assert alone == batch[3]


def test_lean_path_gemms_are_bound_to_the_per_batch_buffers(models):
    """The lean path binds each layer's GEMMs to the buffers of its batch size once (the last
    layer's down projection writes a fresh tensor per step, so it stays unbound), and binds
    again after the packed copies are swapped (as the bench does)."""
    from pipefill.kernels.decode_gemm import BoundLinear, PackedLinear
    ex = _stage(models["llama"], "float32")
    _decode([ex], [0, 2], fast=True, steps=2)
    buf = ex.model._decode.buffers[2]
    calls = buf.calls
    for c in calls:
        assert c.qkv.x is buf.x and c.qkv.out is buf.qkv
        assert c.o_proj.x is buf.attn2d and c.o_proj.out is buf.o
        assert c.gate_up.x is buf.x and c.gate_up.out is buf.gate_up
    assert all(isinstance(c.down, BoundLinear) and c.down.out is buf.down for c in calls[:-1])
    assert isinstance(calls[-1].down, PackedLinear)
    layer = ex.model.w.layers[1]
    layer.packed = dict(layer.packed)  # a swapped-in copy of the packed dict
    _decode([ex], [0, 2], fast=True, steps=1)
    assert buf.calls is not calls and buf.calls[1].qkv.linear is layer.packed["qkv"]


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
def test_one_attention_call_per_layer_equals_per_sequence_past_the_split(models, kv):
    """The lean path's batched attention (one kernel call per layer: every sequence's KV write
    and attention) against the general path's per-sequence calls, with contexts past the 2048-key
    split-KV threshold (one crosses it during the steps), page-unaligned ones and a float32,
    bfloat16 or int8 KV cache (int8: the sdpa path, decode rows on the native int8 kernel):
    logits bit for bit."""
    lens, steps, width = [2100, 5, 2046, 64, 517], 4, 70  # width: pages per sequence
    path = models["llama"]
    source = WeightSource(path)
    args = resolve(ServerArgs(model_path=path, dtype="float32", page_size=PAGE, kv_cache_dtype=kv,
                              max_total_tokens=len(lens) * width * PAGE, threads_per_stage=1),
                   source.config)
    ex = build_stage(args, source, StageInfo(0, 1, range(source.config.num_layers)))
    assert ex.model._decode is not None, "the lean path should serve this stage"
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lens]
    tables = [list(range(i * width, (i + 1) * width)) for i in range(len(lens))]
    runs = {}
    with torch.inference_mode():
        for fast in (False, True):
            ex.model.fast_decode = fast
            toks = {i: int(_run([ex], _plan({i: p}, tables, [0] * len(lens)))[0].argmax())
                    for i, p in enumerate(prompts)}
            runs[fast] = []
            for s in range(steps):
                pos = {i: n + s for i, n in enumerate(lens)}
                logits = _run([ex], _plan({i: [t] for i, t in toks.items()}, tables, pos))
                runs[fast].append(logits.clone())
                toks = {i: int(row.argmax()) for i, row in enumerate(logits)}
    assert _lean_steps([ex]) == 1
    for s, (a, b) in enumerate(zip(runs[False], runs[True])):
        assert torch.equal(a, b), f"step {s}: batched attention != per-sequence attention"
