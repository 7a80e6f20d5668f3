"""The per-operation cost model: FLOPs, bytes, all-reduces, placement, memory. The models'
configs are in tests/planner/data (the other planner tests import them from here)."""
from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest

import pipefill
from pipefill.model.families import family_for_hf_config
from pipefill.planner import PRESETS, Layout, LayoutCosts, Precision, evaluate, layouts
from pipefill.planner.costs import (border_link, keys_seen, layer_kinds, ring_allreduce_seconds,
                                   tp_link)
from pipefill.planner.hardware import Link

H20 = PRESETS["h20"]
BF16 = Precision("bfloat16", "bfloat16", "bfloat16")
DATA = Path(__file__).parent / "data"


def planner_model(name: str):
    """The ModelConfig of a config.json in tests/planner/data."""
    hf = json.loads((DATA / name).read_text())
    return family_for_hf_config(hf).config_from_hf(hf)


QWEN3_235B = planner_model("qwen3-235b-a22b-fp8.json")
DEEPSEEK_V31 = planner_model("deepseek-v3.1.json")
SMOLLM2 = planner_model("smollm2-135m.json")


def test_keys_seen_counts_causal_pairs_with_and_without_a_window():
    assert keys_seen(4, 0, None) == 1 + 2 + 3 + 4
    assert keys_seen(2, 3, None) == 4 + 5
    assert keys_seen(4, 0, 2) == 1 + 2 + 2 + 2
    assert keys_seen(3, 5, 4) == 4 * 3
    # Chunks add up to the whole prompt, in any cut.
    assert keys_seen(1000, 0, 300) == keys_seen(400, 0, 300) + keys_seen(600, 400, 300)


def test_ring_allreduce_cost():
    link = Link(bandwidth=100.0, latency=1.0)
    assert ring_allreduce_seconds(800, 1, link) == 0
    # 2(n-1) steps of latency, 2(n-1)/n of the bytes through each rank's link.
    assert ring_allreduce_seconds(800, 4, link) == pytest.approx(6 + 1.5 * 800 / 100)


def test_moe_gemms_count_only_the_active_experts():
    kinds = layer_kinds(QWEN3_235B)
    kind = kinds[0]
    assert kind.num_experts == 128 and kind.top_k == 8
    active = kind.fixed_weights + kind.top_k * kind.expert_weights
    # 94 layers of ~0.2B active weights: Qwen3-235B-A22B's 22B less its embedding and head.
    assert 20e9 < 94 * active < 22e9
    slow = replace(H20, memory_bandwidth=1e30)  # compute only
    costs = LayoutCosts(QWEN3_235B, slow, Layout(1, 1), BF16)
    gemm_seconds = 2 * 4096 * active / slow.rate("bfloat16", "bfloat16")
    attention = 2 * kind.attention_width * keys_seen(4096, 0, None) \
        / slow.rate("bfloat16", "bfloat16")
    assert costs.layer_seconds(kind, 4096, 0, slow.intra_node) == pytest.approx(
        gemm_seconds + attention)


def test_a_small_chunk_reads_only_the_experts_it_routes_to():
    """Decode-sized chunks are bound by the weights they read: top-k experts per token."""
    costs = LayoutCosts(QWEN3_235B, H20, Layout(1, 1), BF16)
    kind = layer_kinds(QWEN3_235B)[0]
    one = costs.layer_seconds(kind, 1, 0, H20.intra_node)
    touched = kind.fixed_weights + 8 * kind.expert_weights
    assert one == pytest.approx(touched * 2 / H20.memory_bandwidth, rel=0.01)


def test_attention_is_quadratic_and_tp_splits_it():
    one = LayoutCosts(QWEN3_235B, H20, Layout(1, 1), BF16)
    four = LayoutCosts(QWEN3_235B, H20, Layout(1, 4), BF16)
    long, short = (c.chunk_seconds(0, 4096, 1 << 20) for c in (one, four))
    assert short < long / 3.5
    assert one.chunk_seconds(0, 4096, 1 << 20) > 10 * one.chunk_seconds(0, 4096, 0)


def test_tp_adds_two_allreduces_a_layer():
    hw = replace(H20, flops={"bfloat16": 1e30}, memory_bandwidth=1e30, chunk_overhead=0.0)
    costs = LayoutCosts(SMOLLM2, hw, Layout(1, 2), BF16)
    ring = ring_allreduce_seconds(1024 * 576 * 2, 2, hw.intra_node)
    assert costs.chunk_seconds(0, 1024, 0) == pytest.approx(30 * 2 * ring)


def test_tp_costs_follow_the_ranks_head_split():
    """SmolLM2-135M at TP 2 splits its 9 heads 5:4 (model/tensor_parallel.choose_head_split):
    the busiest rank attends with 5 of 9 heads and keeps 2 of the 3 KV heads (one of them a
    copy); at TP 3, 3 heads and one KV head each."""
    two, three = (LayoutCosts(SMOLLM2, H20, Layout(1, tp), BF16) for tp in (2, 3))
    kind = layer_kinds(SMOLLM2)[0]
    assert two.head_split == "queries" and three.head_split == "groups"
    assert two.shard(kind) == pytest.approx(5 / 9)
    assert two.kv_share(kind) == pytest.approx(2 / 3)
    assert three.shard(kind) == pytest.approx(3 / 9)
    assert three.kv_share(kind) == pytest.approx(1 / 3)


def test_link_bytes_follow_the_formulas():
    """TP: two rings a layer, 2(n-1)/n of S*H activations each; PP: hidden state and
    residual, S*H each, across a stage border."""
    tokens, hidden = 1000, 7168
    tp = LayoutCosts(DEEPSEEK_V31, H20, Layout(1, 8), BF16).stage_link_bytes(0, tokens)
    assert tp["intra_node"] == pytest.approx(2 * 61 * 2 * 7 / 8 * tokens * hidden * 2)
    assert tp["inter_node"] == 0
    pp = LayoutCosts(DEEPSEEK_V31, H20, Layout(4, 8), BF16)
    assert pp.stage_link_bytes(0, tokens)["inter_node"] == 2 * tokens * hidden * 2
    assert pp.stage_link_bytes(3, tokens)["inter_node"] == 0  # the last stage sends nothing


def test_placement_fills_nodes_stage_by_stage():
    hw = replace(H20, devices_per_node=4)
    pp4_tp2 = Layout(4, 2)  # stages 0-1 on node 0, 2-3 on node 1
    assert [border_link(hw, pp4_tp2, s) is hw.intra_node for s in range(3)] == \
        [True, False, True]
    assert all(tp_link(hw, pp4_tp2, s) is hw.intra_node for s in range(4))
    assert tp_link(hw, Layout(1, 8), 0) is hw.inter_node  # TP across two nodes
    assert border_link(hw, Layout(2, 1, threads=4), 0) is hw.inter_node


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    tokens = 1 << 17
    kv = [LayoutCosts(QWEN3_235B, H20, Layout(1, tp), BF16).stage_kv_bytes(0, tokens)
          for tp in (1, 4, 8)]
    assert kv[1] == pytest.approx(kv[0] / 4)  # 4 KV heads, one a rank
    assert kv[2] == kv[1]  # 8 ranks: each still keeps one head
    # A latent is kept whole on every rank: 576 values a token a layer.
    latent = LayoutCosts(DEEPSEEK_V31, H20, Layout(1, 8), BF16).stage_kv_bytes(0, tokens)
    assert latent == pytest.approx(tokens * 61 * 576 * 2)


def test_weights_across_devices_add_up_to_the_model():
    fp8 = Precision("fp8", "bfloat16", "bfloat16")
    costs = LayoutCosts(QWEN3_235B, H20, Layout(8, 4), fp8)
    total = 4 * sum(costs.stage_weight_bytes(s) for s in range(8))
    tables = 2 * 151936 * 4096 * 2  # embedding and head, bfloat16
    assert total - tables == pytest.approx(235e9, rel=0.02)  # 235B weights, 1 byte each


def test_a_layout_that_does_not_fit_says_so():
    fp8 = Precision("fp8", "bfloat16", "bfloat16")
    one_gpu = evaluate(DEEPSEEK_V31, H20, Layout(1, 1), fp8, 4096, 4096)
    assert not one_gpu.fits and one_gpu.weight_bytes > 600e9


def test_layouts_use_every_device():
    cpu = replace(H20, devices_are_cores=True)
    found = {(lay.pp, lay.tp, lay.threads) for lay in layouts(SMOLLM2, cpu, 4)}
    assert found == {(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)}
    gpus = {(lay.pp, lay.tp) for lay in layouts(SMOLLM2, H20, 16)}
    assert (16, 1) in gpus and (1, 16) not in gpus  # 9 heads: at most TP 9
    assert all(lay.threads == 1 for lay in layouts(SMOLLM2, H20, 16))


def test_the_planner_imports_no_torch():
    """Its core is pure Python: the numbers come from config fields and the hardware file."""
    room = Path(pipefill.__file__).parent / "planner"
    for path in room.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("torch", "numpy") for n in names), path


def test_decode_reads_the_straddled_heads_keys_split_past_min_keys():
    """SmolLM2 at TP 2 (5:4 query heads): a rank reads 2 of the 3 KV heads at decode until the
    ranks split the straddled head's keys (model/shared_head.py, past MIN_KEYS keys), then
    half; one process's threads read them once. A decode step is bound by bytes: each rank
    its half of the weights, so TP2 costs what two threads of one process cost but for the
    all-reduces (latency-bound at one row) and the KV it reads beyond its half."""
    from pipefill.model.shared_head import MIN_KEYS
    cpu = replace(H20, memory_bandwidth=15e9, devices_are_cores=True)
    tp2, tp1 = (LayoutCosts(SMOLLM2, cpu, lay, BF16) for lay in (Layout(1, 2), Layout(1, 1, 2)))
    kind = layer_kinds(SMOLLM2)[0]
    assert tp2.decode_kv_share(kind, MIN_KEYS - 1) == pytest.approx(2 / 3)
    assert tp2.decode_kv_share(kind, MIN_KEYS) == 0.5
    assert tp1.decode_kv_share(kind, MIN_KEYS) == 1.0
    link = tp_link(cpu, tp2.layout, 0)
    reduce = 30 * 2 * ring_allreduce_seconds(SMOLLM2.hidden_size * 2, 2, link)
    assert tp2.decode_step_seconds(8192) == pytest.approx(tp1.decode_step_seconds(8192) + reduce)
    kv_beyond = 30 * 512 * kind.kv_values * 2 * (2 / 3 - 1 / 2) / 15e9
    assert tp2.decode_step_seconds(511) == pytest.approx(
        tp1.decode_step_seconds(511) + reduce + kv_beyond)
