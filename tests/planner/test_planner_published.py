"""The planner against the published chunked-pipeline prefills on H20 GPUs (SGLang's
pipeline-parallel results): every prediction within 15%. The H20 preset's one calibrated
constant, its efficiency, is the same for all of them (pipefill/planner/hardware.py)."""
from __future__ import annotations

import pytest

from pipefill.planner import PRESETS, Layout, Precision, evaluate, search

from test_planner_costs import DEEPSEEK_V31, QWEN3_235B

H20 = PRESETS["h20"]
FP8 = Precision(weights="fp8", compute="bfloat16", kv="bfloat16")
TOLERANCE = 0.15

# Qwen3-235B-A22B-FP8, PP8 x TP4, dynamic chunking from C0 18K with sigma 0.8: TTFT in seconds.
QWEN_PP8_TP4 = {131072: 10.54, 262144: 32.68, 524288: 114.33, 1048576: 420.91}


def within(predicted: float, published: float) -> bool:
    return abs(predicted / published - 1) <= TOLERANCE


@pytest.mark.parametrize("tokens", sorted(QWEN_PP8_TP4))
def test_qwen3_235b_pp8_tp4_ttft(tokens):
    plan = evaluate(QWEN3_235B, H20, Layout(8, 4), FP8, tokens, c0=18432, smooth=0.8)
    assert plan.fits
    assert within(plan.ttft_s, QWEN_PP8_TP4[tokens]), (plan.ttft_s, QWEN_PP8_TP4[tokens])


def deepseek_plans(cfg):
    """DeepSeek-V3.1 at 128K tokens: TP8 on one node, PP4 x TP8 (dynamic chunks from C0 12K,
    sigma 0.65) and TP32 across four nodes."""
    tokens = 131072
    return (evaluate(cfg, H20, Layout(1, 8), FP8, tokens, c0=16384),
            evaluate(cfg, H20, Layout(4, 8), FP8, tokens, c0=12288, smooth=0.65),
            evaluate(cfg, H20, Layout(1, 32), FP8, tokens, c0=16384))


def test_deepseek_v31_tp8_against_pp4_tp8():
    tp8, pp4_tp8, _ = deepseek_plans(DEEPSEEK_V31)
    assert within(tp8.ttft_s, 48.5), tp8.ttft_s
    assert within(pp4_tp8.ttft_s, 15.5), pp4_tp8.ttft_s


def test_deepseek_v31_pp4_tp8_beats_tp32_by_the_published_margin():
    """+30.5% prefill throughput at batch size 1 (tokens over TTFT) over TP32."""
    _, pp4_tp8, tp32 = deepseek_plans(DEEPSEEK_V31)
    assert within(tp32.ttft_s / pp4_tp8.ttft_s, 1.305), tp32.ttft_s / pp4_tp8.ttft_s
    # Only the border's hidden states cross nodes under PP; TP32's rings cross them 122 times.
    assert pp4_tp8.link_bytes["inter_node"] < tp32.link_bytes["inter_node"] / 20


def test_the_search_prefers_a_pipeline_across_nodes():
    """Over 32 H20s, the planner's best layout for a 128K prompt pipelines across the nodes
    and keeps TP inside them, as the published figures do."""
    best = search(DEEPSEEK_V31, H20, 32, FP8, 131072, c0s=[8192, 12288, 16384],
                  smooths=[0.0, 0.65])[0]
    assert best.fits and best.layout.pp > 1 and best.layout.tp <= H20.devices_per_node
