"""Tensor parallelism's shares, in one process: the heads and MLP columns of each rank (uneven
shares, whole GQA groups, KV heads replicated below the rank count, query heads split with a
straddled group's KV head on both ranks, and the rule that picks the split), the checkpoint slices a
rank reads (their partial products sum to the whole layer's), each rank's KV pool holding only
its own KV heads, and the refusals."""
import threading
from types import SimpleNamespace

import pytest
import torch

from conftest import save_tiny_model
from pipefill.config import ServerArgs, StageInfo, resolve
from pipefill.model.families.llama import LLAMA
from pipefill.model.loader import WeightSource
from pipefill.model.tensor_parallel import (MLP_GRAIN, ShardedSource, TPOps,
                                            check_tensor_parallel, choose_head_split,
                                            has_unequal_groups, head_shares, local_groups,
                                            mlp_shares, rank_costs, shares, tp_shard)
from pipefill.runtime.stage import build_stage


def test_shares_are_ceil_then_floor():
    assert shares(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert shares(4, 4) == [range(i, i + 1) for i in range(4)]
    # MLP widths the fused kernels take (multiples of 16) stay so on every rank.
    assert mlp_shares(1536, 2) == [range(0, 768), range(768, 1536)]
    assert mlp_shares(80, 3) == [range(0, 32), range(32, 64), range(64, 80)]
    assert mlp_shares(130, 4) == [range(0, 33), range(33, 66), range(66, 98), range(98, 130)]


# (query heads, KV heads, ranks) -> each rank's (query heads, KV heads)
HEADS = {
    (6, 2, 4): [(range(0, 2), range(0, 1)), (range(2, 3), range(0, 1)),
                (range(3, 5), range(1, 2)), (range(5, 6), range(1, 2))],  # uneven, replicated
    (6, 2, 2): [(range(0, 3), range(0, 1)), (range(3, 6), range(1, 2))],
    (9, 3, 2): [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))],  # SmolLM2's heads
    (6, 6, 4): [(range(0, 2), range(0, 2)), (range(2, 4), range(2, 4)),
                (range(4, 5), range(4, 5)), (range(5, 6), range(5, 6))],  # MHA, uneven
    (8, 1, 3): [(range(0, 3), range(0, 1)), (range(3, 6), range(0, 1)),
                (range(6, 8), range(0, 1))],  # one KV head on every rank
}


@pytest.mark.parametrize("heads", HEADS, ids=[f"{q}q{kv}kv-tp{n}" for q, kv, n in HEADS])
def test_head_shares(heads):
    q_heads, kv_heads, ranks = heads
    got = head_shares(q_heads, kv_heads, ranks)
    assert got == HEADS[heads]
    assert [h for q, _ in got for h in q] == list(range(q_heads))  # each query head once
    group = q_heads // kv_heads
    for q, kv in got:
        local_group = len(q) // len(kv)
        assert local_group * len(kv) == len(q)  # equal groups on the rank: plain GQA
        for i, h in enumerate(q):  # local head i reads local KV head i // local_group
            assert h // group == kv.start + i // local_group


# SmolLM2-135M's shape (head_dim 64, 30 layers).
SMOLLM2 = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                          intermediate_size=1536, vocab_size=49152, moe=None, mla=None)


# (query heads, KV heads, ranks) -> each rank's (query heads, KV heads) split by query heads
QUERY_HEADS = {
    (9, 3, 2): [(range(0, 5), range(0, 2)), (range(5, 9), range(1, 3))],  # SmolLM2: 5:4
    (8, 2, 3): [(range(0, 3), range(0, 1)), (range(3, 6), range(0, 2)),
                (range(6, 8), range(1, 2))],
    (6, 6, 4): HEADS[(6, 6, 4)],  # MHA: the same as by whole groups
}


@pytest.mark.parametrize("heads", QUERY_HEADS,
                         ids=[f"{q}q{kv}kv-tp{n}" for q, kv, n in QUERY_HEADS])
def test_query_head_shares_keep_the_kv_heads_their_queries_read(heads):
    q_heads, kv_heads, ranks = heads
    got = head_shares(q_heads, kv_heads, ranks, "queries")
    assert got == QUERY_HEADS[heads]
    assert [h for q, _ in got for h in q] == list(range(q_heads))
    group = q_heads // kv_heads
    for q, kv in got:
        per_kv = local_groups(q, kv, group) or (len(q) // len(kv),) * len(kv)
        assert sum(per_kv) == len(q) and min(per_kv) >= 1
        first = 0  # local query heads [first, first + n) read local KV head i
        for i, n in enumerate(per_kv):
            assert all(h // group == kv.start + i for h in q[first:first + n])
            first += n
    assert local_groups(range(0, 5), range(0, 2), 3) == (3, 2)
    assert local_groups(range(5, 9), range(1, 3), 3) == (1, 3)
    assert local_groups(range(0, 6), range(0, 2), 3) == ()  # equal: plain GQA


def test_head_split_rule_takes_query_heads_where_the_busiest_rank_gains():
    """SmolLM2 at TP 2: whole groups give 6 and 3 heads, query heads 5 and 4 (a KV head on
    both ranks), whose busiest rank is cheaper; at TP 3 (3 heads each either way) and where the
    split cannot improve it, whole groups (no KV head copied)."""
    split, why = choose_head_split(SMOLLM2, 2)
    assert split == "queries" and "1.19x" in why and "1.07x" in why
    assert max(rank_costs(SMOLLM2, 2, "queries")) < max(rank_costs(SMOLLM2, 2, "groups"))
    assert choose_head_split(SMOLLM2, 3)[0] == "groups"
    assert choose_head_split(SMOLLM2, 1)[0] == "groups"
    six_two = SimpleNamespace(**{**vars(SMOLLM2), "num_heads": 6, "num_kv_heads": 2})
    assert choose_head_split(six_two, 2)[0] == "groups"  # 3 and 3 either way
    assert choose_head_split(six_two, 4)[0] == "groups"  # 2, 1, 2, 1: ties with 2, 2, 1, 1
    eight_two = SimpleNamespace(**{**vars(SMOLLM2), "num_heads": 8, "num_kv_heads": 2})
    assert choose_head_split(eight_two, 3)[0] == "queries"  # 3, 3, 2 against 2, 2, 4
    assert tp_shard(SMOLLM2, 1, 2).q_per_kv == (1, 3)
    assert has_unequal_groups(SMOLLM2, 2) and not has_unequal_groups(SMOLLM2, 3)
    assert has_unequal_groups(eight_two, 3) and not has_unequal_groups(six_two, 2)


def test_mlp_shares_even_out_the_ranks_weights():
    """SmolLM2-135M's shape at TP 2 split by whole groups: 6 and 3 query heads, so the rank with
    fewer heads takes more MLP columns; by query heads (its split) 5 and 4 heads over 2 KV
    heads each, columns near even. Every rank holds the same weight to a grain, and the
    shares cover the width once, in order."""
    for head_split, want in [("groups", [range(0, 688), range(688, 1536)]),
                             (None, [range(0, 752), range(752, 1536)])]:
        split = [tp_shard(SMOLLM2, r, 2, head_split=head_split) for r in range(2)]
        assert [s.mlp for s in split] == want
        weights = [2 * (len(s.q_heads) + len(s.kv_heads)) * 64 + 3 * len(s.mlp) for s in split]
        assert abs(weights[0] - weights[1]) <= 3 * MLP_GRAIN
    for width, attention in [(1536, [341.3, 170.7, 170.7]), (130, [1, 2, 3, 4]),
                             (32, [500.0, 0.0]), (3, [5.0, 0.0])]:
        got = mlp_shares(width, len(attention), attention)
        assert [c for r in got for c in r] == list(range(width))
        assert all(len(r) >= 1 for r in got)
    # Equal attention: the plain ceil/floor shares.
    assert mlp_shares(80, 3, [4.0] * 3) == mlp_shares(80, 3)


@pytest.fixture(scope="module")
def odd_llama(tmp_path_factory):
    """6 query heads over 2 KV heads, MLP width 130 (ranks of 33 and 32 columns at TP 4)."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("tp-llama"), num_attention_heads=6,
                           num_key_value_heads=2, hidden_size=96, intermediate_size=130,
                           num_hidden_layers=2)


def test_slices_sum_to_the_whole_layer(odd_llama):
    source = WeightSource(odd_llama)
    cfg, name = source.config, "model.layers.1."
    x_attn = torch.randn(5, cfg.q_size)
    x_mlp = torch.randn(5, cfg.intermediate_size)
    o_sum = torch.zeros(5, cfg.hidden_size)
    down_sum = torch.zeros(5, cfg.hidden_size)
    for rank in range(4):
        shard = tp_shard(cfg, rank, 4)
        sharded = ShardedSource(source, shard)
        q_cols = shard.rows("q", cfg.head_dim)
        o = sharded.load(name + "self_attn.o_proj.weight")
        assert o.shape == sharded.shape(name + "self_attn.o_proj.weight") == \
            (cfg.hidden_size, len(shard.q_heads) * cfg.head_dim)
        o_sum += x_attn[:, q_cols.start:q_cols.stop] @ o.T
        down = sharded.load(name + "mlp.down_proj.weight")
        down_sum += x_mlp[:, shard.mlp.start:shard.mlp.stop] @ down.T
        k = sharded.load_rows(name + "self_attn.k_proj.weight", 0, cfg.head_dim)
        full_k = source.load(name + "self_attn.k_proj.weight")
        assert torch.equal(k, full_k[shard.kv_heads.start * cfg.head_dim:][:cfg.head_dim])
        assert sharded.config.num_heads == len(shard.q_heads)
        assert sharded.config.intermediate_size == len(shard.mlp)
    torch.testing.assert_close(o_sum, x_attn @ source.load(name + "self_attn.o_proj.weight").T)
    torch.testing.assert_close(down_sum,
                               x_mlp @ source.load(name + "mlp.down_proj.weight").T)


# A rank's collectives with no other rank: shapes only.
ALONE = SimpleNamespace(all_reduce_=lambda t: t, all_gather=lambda t: t[None])


def test_each_rank_pool_holds_its_own_kv_heads(odd_llama):
    """The model has 2 KV heads: at TP 2 each rank keeps one, at TP 4 each keeps one too (two
    ranks share each head), so a rank's pool is half the TP 1 pool, with the same pages."""
    source = WeightSource(odd_llama)
    args = resolve(ServerArgs(model_path=odd_llama, dtype="float32", page_size=16,
                              max_total_tokens=256, threads_per_stage=1), source.config)
    layers = range(source.config.num_layers)
    whole = build_stage(args, source, StageInfo(0, 1, layers)).cache
    for size in (2, 4):
        for rank in range(size):
            # One rank alone, its sum a stand-in: only the shapes are looked at here.
            ex = build_stage(args.replace(tp_size=size), source,
                             StageInfo(0, 1, layers, rank, size), comm=ALONE)
            assert ex.model.cfg.num_kv_heads == 1
            assert ex.model.w.embed.shape[0] == len(shares(512, size)[rank])
            assert ex.cache.k.numel() * 2 == whole.k.numel()
            assert ex.cache.num_pages == whole.num_pages  # stage 0's page ids, every rank


class Sums:
    """Four ranks' collectives played in one process: each rank's contribution is recorded,
    then the sum or the gather of all four is given back."""

    def __init__(self, parts):
        self.parts = parts

    def all_reduce_(self, t):
        return t.copy_(sum(self.parts))

    def all_gather(self, t):
        return torch.stack(self.parts)


def test_vocabulary_parallel_embedding_and_head(odd_llama):
    """Each rank looks up its own ids (zeros for the others) and computes its share of the
    logits: their sum and their gather are the whole embedding's and the whole head's (at
    TP 3 the 512 rows are uneven: 171, 171, 170)."""
    source = WeightSource(odd_llama)
    cfg = source.config
    ids = torch.tensor([0, 127, 128, 300, 511, 5])
    embed, head = (source.load("model.embed_tokens.weight"), source.load("lm_head.weight"))
    x = torch.randn(3, cfg.hidden_size)
    for size in (4, 3):
        looked_up, logits = [], []
        for rank in range(size):
            shard = tp_shard(cfg, rank, size)
            sharded = ShardedSource(source, shard)
            rows = sharded.load("model.embed_tokens.weight")
            assert torch.equal(rows, embed[shard.vocab.start:shard.vocab.stop])
            looked_up.append(TPOps(ALONE, shard, cfg.vocab_size).embed(ids, rows))
            logits.append(x @ sharded.load("lm_head.weight").T)
        first = tp_shard(cfg, 0, size)
        mine = embed[first.vocab.start:first.vocab.stop]
        whole = TPOps(Sums(looked_up), first, cfg.vocab_size).embed(ids, mine)
        assert torch.equal(whole, embed[ids])
        width = len(first.vocab)  # the widest share: every rank sends this many columns
        padded = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in logits]
        gathered = TPOps(Sums(padded), first, cfg.vocab_size).gather_logits(logits[0])
        torch.testing.assert_close(gathered, x @ head.T)


def test_refusals(tmp_path):
    cfg = WeightSource(save_tiny_model("llama", tmp_path / "m")).config
    check_tensor_parallel(cfg, LLAMA, 4)  # 4 heads: fine
    with pytest.raises(ValueError, match="larger than the model's 4 attention heads"):
        check_tensor_parallel(cfg, LLAMA, 5)
    other = SimpleNamespace(name="another")  # a family tensor parallelism does not split
    with pytest.raises(ValueError, match="DeepSeek-V2/V3 and Gemma 3 families so far, not"):
        check_tensor_parallel(cfg, other, 2)
    for flags, match in [(dict(tp_size=0), "--tp-size must be at least 1"),
                         (dict(tp_size=3, pp_size=1, nnodes=2, dist_init_addr="h:1"),
                          "processes must be a multiple of --nnodes")]:
        with pytest.raises(ValueError, match=match):
            ServerArgs(**flags).layout


class ThreadGroup:
    """The collectives of `size` ranks played by threads of one process: each rank leaves
    its tensor, and every rank takes the sum in rank order (float32) or the stack."""

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def rank(self, r: int):
        return SimpleNamespace(all_reduce_=lambda t: t.copy_(self._meet(r, t).float().sum(0)),
                               all_gather=lambda t: self._meet(r, t))

    def _meet(self, r: int, t: torch.Tensor) -> torch.Tensor:
        self.slots[r] = t.clone()
        self.barrier.wait()
        out = torch.stack(self.slots)
        self.barrier.wait()  # every rank has read the slots before they are written again
        return out


def on_ranks(size: int, work):
    """work(rank) on `size` threads at once -> their results in rank order."""
    out = [None] * size
    errors = []

    def run(r):
        try:
            out[r] = work(r)
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


# (query heads, KV heads, hidden, MLP width): 6 over 2 (3 and 3 heads at TP 2), and
# SmolLM2-135M's 9 over 3 (5 and 4 heads, KV head 1 on both ranks: unequal groups).
LEAN_SHAPES = {"6q2kv": (6, 2, 384, 288), "9q3kv": (9, 3, 576, 576)}


@pytest.fixture(scope="module", params=LEAN_SHAPES)
def lean_llama(request, tmp_path_factory):
    """Heads of 64 and 32-token pages: the vector attention kernels, so decode steps take the
    lean path (model/decode_step.py)."""
    q, kv, hidden, width = LEAN_SHAPES[request.param]
    return save_tiny_model("llama", tmp_path_factory.mktemp("tp-lean"), num_attention_heads=q,
                           num_key_value_heads=kv, hidden_size=hidden, intermediate_size=width)


def test_lean_decode_path_on_shards_matches_one_rank(lean_llama):
    """Two ranks (threads) against one: a prefill of 40 tokens, then greedy decode steps at
    batch 1; the ranks' decode steps run the lean path on their shard weights, with the sums
    in it, and the logits agree with the single rank's."""
    page = 32
    source = WeightSource(lean_llama)
    args = resolve(ServerArgs(model_path=lean_llama, dtype="float32", page_size=page,
                              max_total_tokens=512, threads_per_stage=1), source.config)
    assert_lean_decode_on_two_ranks(args, source)


def test_tp3_query_split_on_kernels_and_sdpa_matches_one_rank(tmp_path):
    """8 query heads over 2 KV heads at TP 3, split by query heads (3, 3, 2; rank 1's heads
    read KV heads 0 and 1, one and two of them): prefill and greedy decode steps on the
    vector kernel (heads of 64, the lean decode path) and on sdpa, within 1e-4 of one rank."""
    path = save_tiny_model("llama", tmp_path / "m", num_attention_heads=8,
                           num_key_value_heads=2, hidden_size=512, intermediate_size=256,
                           num_hidden_layers=2)
    source = WeightSource(path)
    assert tp_shard(source.config, 1, 3).q_per_kv == (1, 2)
    args = resolve(ServerArgs(model_path=path, dtype="float32", page_size=32,
                              max_total_tokens=512, threads_per_stage=1), source.config)
    assert_lean_decode_on_two_ranks(args, source, size=3)
    assert_lean_decode_on_two_ranks(args.replace(attention_backend="sdpa"), source, size=3,
                                    lean=False)


def assert_lean_decode_on_two_ranks(args, source, size: int = 2, lean: bool = True,
                                    **tp_flags):
    """`size` ranks (threads, with tp_flags) against one stage holding every layer: a 40-token
    prefill, then greedy decode steps at batch 1 (on the lean path where `lean`), logits
    within 1e-4."""
    from pipefill.base.plan import SampleSpec, SeqWork, StepPlan
    layers = range(source.config.num_layers)
    group = ThreadGroup(size)
    ranks = on_ranks(size, lambda r: build_stage(args.replace(tp_size=size, **tp_flags), source,
                                                 StageInfo(0, 1, layers, r, size),
                                                 comm=group.rank(r)))
    whole = build_stage(args, source, StageInfo(0, 1, layers))
    if lean and whole.model._decode is None:
        pytest.skip("no fused ops or vector attention kernel here: no lean decode path")
    spec = SampleSpec(0.0, 1.0, -1, 0, 0, None)

    def logits(ex, ids, start):
        plan = StepPlan(-1, [SeqWork("s", start, start + len(ids), ids, [0, 1], spec)])
        return torch.cat(list(ex.logit_blocks(plan, ex.forward(plan, None)[0])))

    ids, start = [(7 * i) % 500 for i in range(40)], 0
    for _ in range(4):
        ref = logits(whole, ids, start)
        got = on_ranks(size, lambda r: logits(ranks[r], ids, start))
        assert all(torch.equal(got[0], g) for g in got)  # every rank gathers the same logits
        torch.testing.assert_close(got[0], ref, rtol=0, atol=1e-4)
        start += len(ids)
        ids = [int(ref[-1].argmax())]
    if lean:
        assert all(len(ex.model._decode.buffers) == 1 for ex in ranks)  # the lean path ran


@pytest.mark.slow  # a 4,101-token prefill three times over
def test_straddled_head_is_split_by_keys_over_a_long_context(tmp_path):
    """SmolLM2's heads (9 over 3 KV heads, 5:4 at TP 2): past MIN_PARTS split parts a decode
    step's straddled KV head is read half by each rank (model/shared_head.py) and the logits
    stay within 1e-4 of one rank's; below it, the plain path."""
    from pipefill.base.plan import SampleSpec, SeqWork, StepPlan
    from pipefill.kernels.cpu_attention import decode_parts
    from pipefill.model.shared_head import MIN_PARTS
    path = save_tiny_model("llama", tmp_path / "m", num_attention_heads=9, num_key_value_heads=3,
                           hidden_size=576, intermediate_size=64, num_hidden_layers=1,
                           max_position_embeddings=8192)
    source = WeightSource(path)
    page, prompt = 32, 1024 * MIN_PARTS + 5
    args = resolve(ServerArgs(model_path=path, dtype="float32", page_size=page,
                              max_total_tokens=prompt + 2 * page, threads_per_stage=1),
                   source.config)
    layers, group = range(source.config.num_layers), ThreadGroup(2)
    ranks = on_ranks(2, lambda r: build_stage(args.replace(tp_size=2), source,
                                              StageInfo(0, 1, layers, r, 2), comm=group.rank(r)))
    whole = build_stage(args, source, StageInfo(0, 1, layers))
    if whole.model._decode is None:
        pytest.skip("no fused ops or vector attention kernel here: no lean decode path")
    shared = [ex.model._decode.shared for ex in ranks]
    assert all(s is not None for s in shared)
    assert [s.s.peer_heads for s in shared] == [1, 2]  # head 5 on rank 1; 3-4 on rank 0
    spec, table = SampleSpec(0.0, 1.0, -1, 0, 0, None), list(range(prompt // page + 2))

    def logits(ex, ids, start):
        plan = StepPlan(-1, [SeqWork("s", start, start + len(ids), ids, table, spec)])
        return torch.cat(list(ex.logit_blocks(plan, ex.forward(plan, None)[0])))

    ids, start = [(7 * i) % 500 for i in range(prompt - 3)], 0
    for _ in range(4):  # the prefill, then three decode steps over 4 split parts
        ref = logits(whole, ids, start)
        got = on_ranks(2, lambda r: logits(ranks[r], ids, start))
        assert torch.equal(got[0], got[1])
        torch.testing.assert_close(got[0], ref, rtol=0, atol=1e-4)
        start += len(ids)
        ids = [int(ref[-1].argmax())]
    lens = torch.tensor([start - 1])
    assert int(decode_parts(lens, 2)[0]) > MIN_PARTS and shared[0].plan(lens) is not None
    assert shared[0].plan(torch.tensor([1024 * (MIN_PARTS - 1) - 1])) is None
