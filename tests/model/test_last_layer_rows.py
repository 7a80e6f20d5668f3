"""The last stage's final layer computes attention and MLP only for the rows whose logits are
used (StageModel.trims): K/V of every row still reach the cache, bit for bit, and the kept rows
come out as from the whole layer, on every attention backend this CPU runs."""
import pytest
import torch

from conftest import save_tiny_model, single_stage
from pipefill.model.attention import KERNEL_BACKENDS, choose_backend
from pipefill.runtime.executor import build_meta, last_rows
from pipefill.base.plan import SampleSpec, SeqWork, StepPlan

PAGE = 32
GREEDY = SampleSpec(0.0, 1.0, -1, 0, 0, None)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # head_dim 64 (what the kernels take) and 3 query heads per KV head, as the default model.
    return save_tiny_model("llama", tmp_path_factory.mktemp("d64"), hidden_size=384,
                           num_attention_heads=6, num_key_value_heads=2, intermediate_size=256,
                           num_hidden_layers=3, init_std=0.06)


def _backends():
    out = [("sdpa", "float32"), ("sdpa", "bfloat16")]
    for name in KERNEL_BACKENDS:
        for dtype in ("float32", "bfloat16"):
            try:
                choose_backend(name, getattr(torch, dtype), 64, PAGE, torch.device("cpu"))
            except ValueError:
                continue
            out.append((name, dtype))
    return out


def _plan() -> StepPlan:
    """Three sequences in one micro-batch: a first chunk that samples, a later chunk of a long
    prompt that does not (pages not in order), and one decode token."""
    gen = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(0, 200, (n,), generator=gen).tolist()  # noqa: E731
    return StepPlan(-1, [
        SeqWork("a", 0, 45, tok(45), [0, 1], GREEDY),
        SeqWork("b", 70, 131, tok(61), [9, 4, 7, 3, 8], None),
        SeqWork("c", 20, 21, tok(1), [12], GREEDY),
    ])


def _prime(ex, plan):
    """Fills the cached prefixes the plan's sequences read (positions before their start); the
    rest of the cache starts zero, so that two stages' caches compare equal where unwritten."""
    ex.cache.k.zero_()
    ex.cache.v.zero_()
    for work in plan.seqs:
        if work.start:
            pre = SeqWork(work.rid, 0, work.start, [5] * work.start, work.page_table, None)
            ex.forward(StepPlan(-1, [pre]), None)


@pytest.mark.parametrize("backend,dtype", _backends())
def test_kept_rows_and_cache_match_the_whole_layer(path, backend, dtype):
    whole = single_stage(path, dtype, page_size=PAGE, attention_backend=backend)
    trimmed = single_stage(path, dtype, page_size=PAGE, attention_backend=backend)
    plan = _plan()
    for ex in (whole, trimmed):
        _prime(ex, plan)
    keep = last_rows(plan)
    assert keep == [True, False, True]
    meta = build_meta(plan, PAGE, torch.device("cpu"))
    ids = torch.tensor([t for w in plan.seqs for t in w.input_ids])
    h, r = whole.model.forward(whole.model.embed(ids), None, meta, whole.cache.k, whole.cache.v)
    meta.last_rows = keep
    assert trimmed.model.trims(meta)
    ht, rt = trimmed.model.forward(trimmed.model.embed(ids), None, meta, trimmed.cache.k,
                                   trimmed.cache.v)
    rows = torch.tensor([44, 106])  # last rows of a and c
    assert ht.shape[0] == rt.shape[0] == 2
    assert torch.equal(whole.cache.k, trimmed.cache.k) and torch.equal(whole.cache.v,
                                                                     trimmed.cache.v)
    ref = whole.model.logits(h, r, rows)
    got = trimmed.model.logits(ht, rt, torch.arange(2))
    # Measured on Zen 4: the vector kernels give the same bits, float32 SDPA differs by 2e-6.
    # AMX's tiles and the decode kernel it hands one-row calls to round P to bf16 apart.
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert (got - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("backend", ["sdpa", "avx2"])
def test_step_with_no_logit_row_writes_the_cache_only(path, backend):
    if backend == "avx2":
        try:
            choose_backend("avx2", torch.float32, 64, PAGE, torch.device("cpu"))
        except ValueError as e:
            pytest.skip(str(e))
    whole = single_stage(path, "float32", page_size=PAGE, attention_backend=backend)
    trimmed = single_stage(path, "float32", page_size=PAGE, attention_backend=backend)
    plan = StepPlan(-1, [SeqWork("a", 0, 45, list(range(45)), [0, 1], None)])
    for ex in (whole, trimmed):
        _prime(ex, plan)
    meta = build_meta(plan, PAGE, torch.device("cpu"))
    ids = torch.tensor(plan.seqs[0].input_ids)
    whole.model.forward(whole.model.embed(ids), None, meta, whole.cache.k, whole.cache.v)
    meta.last_rows = last_rows(plan)
    assert meta.last_rows == [False]
    h, r = trimmed.model.forward(trimmed.model.embed(ids), None, meta, trimmed.cache.k,
                                 trimmed.cache.v)
    assert h.shape[0] == r.shape[0] == 0
    assert torch.equal(whole.cache.k, trimmed.cache.k) and torch.equal(whole.cache.v,
                                                                     trimmed.cache.v)
    # Through the executor: a step without a sampled row gives empty results, no logits.
    assert [s.token for s in trimmed.results(plan, trimmed.forward(plan, None)[0]).seqs] == [None]


def test_last_rows_rules():
    plan = _plan()
    assert last_rows(plan) == [True, False, True]
    decode = StepPlan(-1, [SeqWork("d", 5, 6, [1], [0], GREEDY), SeqWork("e", 9, 10, [2], [1],
                                                                         GREEDY)])
    assert last_rows(decode) is None  # nothing to skip
    logprobs = StepPlan(-1, [SeqWork("p", 0, 8, list(range(8)), [0], GREEDY,
                                     logprob_targets=list(range(1, 8)))])
    assert last_rows(logprobs) is None  # prompt logprobs need every row


def test_executor_results_equal_with_and_without_trim(path):
    """The engine's path (executor.forward + results) picks the same tokens with logprobs
    within float32 rounding as the whole last layer (prompt logprobs switch trimming off)."""
    ex = single_stage(path, "float32", page_size=PAGE)
    plan = _plan()
    _prime(ex, plan)
    acts, _ = ex.forward(plan, None)
    assert acts.logit_rows_only and acts.hidden.shape[0] == 2
    trimmed = ex.results(plan, acts)
    ref_ex = single_stage(path, "float32", page_size=PAGE)
    _prime(ref_ex, plan)
    meta = build_meta(plan, PAGE, torch.device("cpu"))
    ids = torch.tensor([t for w in plan.seqs for t in w.input_ids])
    h, r = ref_ex.model.forward(ref_ex.model.embed(ids), None, meta, ref_ex.cache.k,
                                ref_ex.cache.v)
    ref = ref_ex.model.logits(h, r, torch.tensor([44, 106])).log_softmax(-1)
    got = [s for s in trimmed.seqs if s.token is not None]
    assert [s.token for s in got] == ref.argmax(-1).tolist()


def test_decode_batch_with_an_unsampled_one_token_chunk(path):
    """A step of one-token rows where one is a prompt chunk that samples nothing (a token
    budget can leave a one-token chunk): the lean decode path would compute every row, so the
    step must either trim on the general path or not trim; the tokens equal the whole layer's."""
    ex = single_stage(path, "float32", page_size=PAGE)
    ref_ex = single_stage(path, "float32", page_size=PAGE)
    plan = StepPlan(-1, [SeqWork("p", 30, 31, [7], [0, 1], None),
                         SeqWork("d", 20, 21, [9], [12], SampleSpec(0.0, 1.0, -1, 0, 0, 0))])
    for e in (ex, ref_ex):
        _prime(e, plan)
    assert last_rows(plan) == [False, True]
    got = ex.results(plan, ex.forward(plan, None)[0])
    meta = build_meta(plan, PAGE, torch.device("cpu"))
    ids = torch.tensor([7, 9])
    h, r = ref_ex.model.forward(ref_ex.model.embed(ids), None, meta, ref_ex.cache.k,
                                ref_ex.cache.v)
    ref = ref_ex.model.logits(h, r, torch.tensor([1]))
    assert [s.token for s in got.seqs] == [None, ref.argmax(-1).item()]
    assert abs(got.seqs[1].token_logprob - ref.log_softmax(-1).max().item()) < 1e-5
