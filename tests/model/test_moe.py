"""The sparse MLP against HF transformers' own blocks on the same random weights (float32):
Qwen3-MoE (normalised and not), Qwen2-MoE with its gated shared expert, Mixtral; expert counts
that are not powers of two, top-k 1 to 3, a decode-sized batch and a prefill-sized one, and a
routing tie. Grouping reads each chosen expert once and no other."""
import pytest
import torch

from pipefill.model.moe import (Experts, MoEBlock, RouterSpec, SharedExpert, group_by_expert,
                                route)

H, WIDTH = 48, 24


def hf_block(kind: str, experts: int, top_k: int, normalize: bool = True):
    import transformers
    common = dict(hidden_size=H, num_experts_per_tok=top_k, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, num_hidden_layers=1)
    if kind == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        cfg = transformers.Qwen3MoeConfig(**common, num_experts=experts, norm_topk_prob=normalize,
                                          moe_intermediate_size=WIDTH)
        return Qwen3MoeSparseMoeBlock(cfg)
    if kind == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
        cfg = transformers.Qwen2MoeConfig(**common, num_experts=experts, norm_topk_prob=normalize,
                                          moe_intermediate_size=WIDTH,
                                          shared_expert_intermediate_size=2 * WIDTH)
        return Qwen2MoeSparseMoeBlock(cfg)
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = transformers.MixtralConfig(**common, num_local_experts=experts, intermediate_size=WIDTH)
    return MixtralSparseMoeBlock(cfg)


def randomize(module, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def ours_from(block, kind: str, experts: int, top_k: int, normalize: bool) -> MoEBlock:
    # HF 5 keeps the experts fused as (E, 2W, H) gate-then-up and (E, H, W): our packing.
    packed = Experts(block.experts.gate_up_proj.detach().clone(),
                     block.experts.down_proj.detach().clone())
    shared = None
    if kind == "qwen2_moe":
        s = block.shared_expert
        shared = SharedExpert(torch.cat([s.gate_proj.weight, s.up_proj.weight]).detach(),
                              s.down_proj.weight.detach(),
                              block.shared_expert_gate.weight.detach())
    return MoEBlock(block.gate.weight.detach().clone(),
                    RouterSpec(experts, top_k, normalize or kind == "mixtral"), packed, shared)


CASES = [("qwen3_moe", 5, 2, True), ("qwen3_moe", 7, 3, False), ("qwen3_moe", 6, 1, True),
         ("qwen2_moe", 5, 2, False), ("qwen2_moe", 3, 3, True), ("mixtral", 5, 2, True),
         ("mixtral", 3, 1, True)]


@pytest.mark.parametrize("kind,experts,top_k,normalize", CASES)
@pytest.mark.parametrize("tokens", [1, 4, 67])
def test_equals_transformers(kind, experts, top_k, normalize, tokens):
    check_against_transformers(kind, experts, top_k, normalize, tokens)


def check_against_transformers(kind, experts, top_k, normalize, tokens, prepare=None):
    """ours (after prepare(ours), where given) on `tokens` random rows equals HF's block."""
    block = hf_block(kind, experts, top_k, normalize)
    randomize(block, seed=experts * 10 + top_k)
    ours = ours_from(block, kind, experts, top_k, normalize)
    if prepare is not None:
        ours = prepare(ours)
    x = torch.randn(1, tokens, H, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_routing_tie_picks_what_transformers_picks():
    block = hf_block("qwen3_moe", 4, 2)
    randomize(block, seed=1)
    with torch.no_grad():
        block.gate.weight[2] = block.gate.weight[1]  # experts 1 and 2 always tie
    ours = ours_from(block, "qwen3_moe", 4, 2, True)
    x = torch.randn(1, 9, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), block(x), rtol=1e-5, atol=1e-5)


def test_grouping_reads_each_chosen_expert_once():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 4]])
    order, counts = group_by_expert(ids, num_experts=6)
    assert counts == [2, 1, 0, 4, 1, 0]  # expert 3 serves four slots with one pair of GEMMs
    experts_in_order = ids.reshape(-1)[order].tolist()
    assert experts_in_order == sorted(experts_in_order)
    assert (order // 2)[:2].tolist() == [0, 2]  # stable: an expert's rows in token order
    block = MoEBlock(torch.zeros(6, H), RouterSpec(6, 2, True),
                     Experts(torch.zeros(6, 2 * WIDTH, H), torch.zeros(6, H, WIDTH)))
    assert block.expert_bytes_read(ids) == 4 * 3 * WIDTH * H * 4  # experts 0, 1, 3, 4


def test_route_weights_and_bad_top_k():
    w, ids = route(torch.randn(5, H), torch.randn(7, H), RouterSpec(7, 3, True))
    assert ids.shape == (5, 3) and torch.allclose(w.sum(-1), torch.ones(5))
    with pytest.raises(ValueError, match="top-k must be between 1"):
        RouterSpec(4, 5, True)


def _decode_isas(dtype: torch.dtype) -> list[str]:
    from pipefill.kernels import decode_gemm
    return [isa for isa in decode_gemm.ISAS if decode_gemm.choose_isa(
        dtype, dtype, tuple(i for i in decode_gemm.ISAS if i != isa))[0] == isa]


def _packed(ours: MoEBlock, isa: str, dtype: torch.dtype, max_rows: int) -> MoEBlock:
    """ours with decode copies on one ISA path (rows <= max_rows) and, where oneDNN runs,
    prefill copies in its layout (the plain matrices dropped), as the loader makes them."""
    from pipefill.kernels import decode_gemm
    from pipefill.kernels.prefill_gemm import OneDnnLinear, onednn_status
    disable = tuple(i for i in decode_gemm.ISAS if i != isa)
    ours.pack_decode(lambda w: decode_gemm.pack(w, None, dtype, max_rows=max_rows,
                                                disable=disable))
    assert ours.experts.linears[0].packed[0].isa == isa and ours.router_packed is not None
    if onednn_status()[0]:
        ours.reorder_prefill(lambda w: OneDnnLinear.reorder(w, None, 64))
        assert ours.experts.gate_up is None and ours.experts.linears[0].plain is None
    return ours


@pytest.mark.parametrize("isa", _decode_isas(torch.float32))
@pytest.mark.parametrize("kind,experts,top_k,normalize",
                         [("qwen2_moe", 5, 2, False), ("qwen3_moe", 7, 3, True)])
@pytest.mark.parametrize("tokens", [1, 6, 67])
def test_packed_experts_equal_transformers(isa, kind, experts, top_k, normalize, tokens):
    """Experts with at most 4 rows on the packed decode GEMM, the others on the prefill GEMM
    (oneDNN's layout), the shared expert and its gate (stacked under the router) too."""
    check_against_transformers(kind, experts, top_k, normalize, tokens,
                               lambda ours: _packed(ours, isa, torch.float32, 4))


@pytest.mark.parametrize("isa", _decode_isas(torch.float32))
def test_a_decode_row_alone_equals_it_in_a_batch_sharing_experts(isa):
    """8 rows on the packed GEMM, some sharing experts and some not, each expert read once:
    every row's output has the same bits as that row alone (and a tie goes to the lower id,
    as torch.topk and HF break it, alone and in the batch)."""
    block = hf_block("qwen3_moe", 6, 2)
    randomize(block, seed=3)
    with torch.no_grad():
        block.gate.weight[4] = block.gate.weight[2]  # experts 2 and 4 always tie
    ours = _packed(ours_from(block, "qwen3_moe", 6, 2, True), isa, torch.float32, 8)
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        batch = ours(x)
        ids = ours.last_ids
        assert torch.unique(ids).numel() < ids.numel()  # some experts serve several rows
        assert not ((ids == 4).any(-1) & ~(ids == 2).any(-1)).any()  # 4 only beside 2
        for i in range(8):
            assert torch.equal(ours(x[i:i + 1])[0], batch[i])
            assert torch.equal(ours.last_ids[0], ids[i])
