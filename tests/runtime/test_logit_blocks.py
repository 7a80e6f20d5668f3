"""The last stage scores a micro-batch's rows a block at a time (StageModel.logit_blocks,
StageExecutor.results): prompt logprobs of a long chunk never hold [rows, vocab] at once
(2 GiB for 2,048 rows of Gemma 3's 262K words, and log_softmax as much again). Blocks that
cut through sequences give every sequence its own rows: the same prompt logprobs and tokens
as one block, and the float64 log-softmax of the whole logits."""
import pytest
import torch

from conftest import save_tiny_model, single_stage
from pipefill.base.plan import SampleSpec, SeqWork, StepPlan
from pipefill.model import stage_model
from pipefill.runtime.executor import needed_rows

PAGE = 16
GREEDY = SampleSpec(0.0, 1.0, -1, 0, 0, None)


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    path = save_tiny_model("llama", tmp_path_factory.mktemp("m"), num_hidden_layers=2)
    return single_stage(path, "float32", page_size=PAGE)


def _plan() -> StepPlan:
    """A whole prompt scored and sampled, a later chunk of a longer prompt scored only (its
    last target is the next chunk's first token), a decode token, and a chunk with neither."""
    gen = torch.Generator().manual_seed(1)
    tok = lambda n: torch.randint(0, 200, (n,), generator=gen).tolist()  # noqa: E731
    a, c = tok(45), tok(61)
    return StepPlan(-1, [  # a scratch plan: no page owners
        SeqWork("a", 0, 45, a, [0, 1, 2], GREEDY, logprob_targets=a[1:]),
        SeqWork("b", 3, 4, tok(1), [3], GREEDY),
        SeqWork("c", 20, 40, c[20:40], [4, 5, 6], None, logprob_targets=c[21:41]),
        SeqWork("d", 0, 9, tok(9), [7], None),
    ])


def _prime(ex, plan):
    for work in plan.seqs:
        if work.start:
            pre = SeqWork(work.rid, 0, work.start, [5] * work.start, work.page_table, None)
            ex.forward(StepPlan(-1, [pre]), None)


def test_blocks_that_cut_through_sequences_score_each_its_own_rows(stage, monkeypatch):
    plan = _plan()
    _prime(stage, plan)
    acts = stage.forward(plan, None)[0]
    one = stage.results(plan, acts)
    vocab = stage.model.cfg.vocab_size
    monkeypatch.setattr(stage_model, "LOGIT_BLOCK_BYTES", 7 * 4 * vocab)
    blocks = list(stage.logit_blocks(plan, acts))
    rows = [r for seq in needed_rows(plan) for r in seq]
    assert len(rows) == 45 + 1 + 20  # a's 44 targets and its sample row, b's, c's targets
    assert [len(b) for b in blocks] == [7] * 9 + [3]
    cut = stage.results(plan, acts)

    # The float64 log-softmax of one call's logits on every needed row.
    ref = torch.log_softmax(stage.model.logits(acts.hidden, acts.residual,
                                               torch.tensor(rows)).double(), -1)
    assert [s.rid for s in cut.seqs] == ["a", "b", "c", "d"]
    at = 0
    for res, whole, work in zip(cut.seqs, one.seqs, plan.seqs):
        assert res.error is None and res.token == whole.token
        if work.logprob_targets:
            k = len(work.logprob_targets)
            expect = ref[at:at + k].gather(1, torch.tensor(work.logprob_targets)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(res.prompt_logprobs, dtype=torch.float64),
                                       expect, rtol=0, atol=1e-5)
            torch.testing.assert_close(res.prompt_logprobs, whole.prompt_logprobs, rtol=0,
                                       atol=1e-6)
        else:
            assert res.prompt_logprobs is None
        if work.sample is not None:
            last = at + len(needed_rows(plan)[plan.seqs.index(work)]) - 1
            assert res.token == int(ref[last].argmax())
        else:
            assert res.token is None
        at += len(needed_rows(plan)[plan.seqs.index(work)])



def test_each_sequence_samples_its_own_last_row_as_its_block_arrives(stage, monkeypatch):
    """Decode rows sampled with logprobs, blocks of 3 rows: every sequence's token, its
    logprob and top-3 are its own last row's under the float64 log-softmax (sampled from the
    block itself, no copy of the row kept); a sequence whose sampling fails (top-k logprobs
    past the vocabulary) fails alone."""
    vocab = stage.model.cfg.vocab_size
    asks = SampleSpec(0.0, 1.0, -1, 0, 0, 3)
    gen = torch.Generator().manual_seed(2)
    seqs = [SeqWork(f"s{i}", 0, 1, [int(torch.randint(0, 200, (1,), generator=gen))], [i],
                    SampleSpec(0.0, 1.0, -1, 0, 0, vocab + 1) if i == 4 else asks)
            for i in range(8)]
    plan = StepPlan(-1, seqs)
    acts = stage.forward(plan, None)[0]
    monkeypatch.setattr(stage_model, "LOGIT_BLOCK_BYTES", 3 * 4 * vocab)
    assert [len(b) for b in stage.logit_blocks(plan, acts)] == [3, 3, 2]
    out = stage.results(plan, acts)
    ref = torch.log_softmax(stage.model.logits(acts.hidden, acts.residual,
                                               torch.arange(8)).double(), -1)
    for i, res in enumerate(out.seqs):
        if i == 4:
            assert res.token is None and res.error.startswith("sampling failed")
            continue
        assert res.error is None and res.token == int(ref[i].argmax())
        assert res.token_logprob == pytest.approx(float(ref[i, res.token]), abs=1e-5)
        top = torch.topk(ref[i], 3)
        assert [t for t, _ in res.top_logprobs] == top.indices.tolist()
        assert [v for _, v in res.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
