"""`pipefill bench decode --compare-tp-size`: its refusal, and (slow) a tiny run that times the
batch-1 step at TP 1 and TP 2 (no timing is checked: only that both ran and were recorded);
the routed expert bytes a mixture-of-experts step reads, whole and per rank of the expert
split; the weight bytes a step reads with the LM head kept as GGUF blocks, tied or not."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import save_tiny_model, single_stage
from pipefill.bench.decode import _steps_ms, expert_shares, weight_bytes
from pipefill.cli.main import main
from test_gguf_blocks import k_quant_gguf
from test_moe_family import save_moe


@pytest.mark.parametrize("value", ["1", "2,x"])
def test_compare_tp_size_refuses_a_bad_list(capsys, value):
    assert main(["bench", "decode", "--compare-tp-size", value]) == 2
    assert "--compare-tp-size" in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_tp_comparison_prints_and_records_a_row_per_context(tmp_path):
    model = save_tiny_model("llama", tmp_path / "m", num_attention_heads=6,
                            num_key_value_heads=3, hidden_size=96, intermediate_size=160)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "pipefill.cli.main", "bench", "decode",
                        "--model-path", model, "--dtype", "float32", "--batch", "1",
                        "--context", "16,40", "--steps", "2", "--reps", "1", "--no-hf",
                        "--threads-per-stage", "1", "--compare-tp-size", "2",
                        "--json", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0, r.stderr
    assert sum("--tp-size 2 (1 per rank)" in line for line in r.stdout.splitlines()) == 2
    rows = json.loads((tmp_path / "r.json").read_text())["tp_rows"]
    assert [(row["tp_size"], row["context"]) for row in rows] == [(2, 16), (2, 40)]
    assert all(row["tp_ms"] > 0 and row["tp1_ms"] > 0 for row in rows)


def test_routed_expert_bytes_count_each_ranks_own_experts(tmp_path):
    """Under --tp-moe-split expert a rank reads only the distinct experts it holds: from one
    step's routing, each rank's figure counts the chosen experts in its share, and the
    ranks' figures add up to the whole stage's (the shares do not overlap)."""
    path = save_moe("qwen2_moe", tmp_path / "m")  # 7 experts, top-3, two sparse layers
    ex = single_stage(path, "float32")
    cfg = ex.model.cfg
    assert expert_shares("expert", cfg, [1, 2, 3]) == {
        2: [range(0, 4), range(4, 7)], 3: [range(0, 3), range(3, 5), range(5, 7)]}
    assert expert_shares("width", cfg, [2]) == {}
    shares = expert_shares("auto", cfg, [2])  # auto takes the expert split here
    routed: list = []
    _steps_ms(ex, 8, 16, 2, 1, routed, shares)  # 8 rows: experts on both ranks' sides
    sparse = [layer.moe for layer in ex.model.w.layers if layer.moe is not None]
    per_expert = sparse[0].experts.expert_bytes(decode=True)
    chosen = [set(torch.unique(m.last_ids).tolist()) for m in sparse]
    got = routed[0]
    assert got["stage"] == per_expert * sum(len(c) for c in chosen)
    for rank, experts in enumerate(shares[2]):
        own = sum(len(c & set(experts)) for c in chosen)
        assert got[2][rank] == per_expert * own
    assert sum(got[2]) == got["stage"] and max(got[2]) < got["stage"]


@pytest.mark.parametrize("tied", [True, False], ids=["tied-to-the-embedding", "own-head"])
def test_weight_bytes_count_a_head_kept_as_blocks_once(tmp_path, tied):
    """A step reads every layer's blocks and the head's once: a head tied to the embedding is
    the embedding's GGUF blocks (lm_head None) and counts as them; an own head counts its
    blocks (Q6_K here), not the embedding, which a step only gathers from."""
    ex = single_stage(k_quant_gguf(tmp_path / "k.gguf", tied=tied), "float32",
                      weight_dtype="gguf")
    w = ex.model.w
    assert w.lm_head is None and w.lm_head_packed is w.lm_head_quant
    assert (w.lm_head_quant is w.embed) == tied
    layers = sum(q.nbytes for layer in w.layers for q in layer.packed.values())
    vocab, hidden = ex.model.cfg.vocab_size, ex.model.cfg.hidden_size
    head = vocab * hidden * (34 / 32 if tied else 210 / 256)  # Q8_0's and Q6_K's bytes a weight
    assert weight_bytes(ex.model, packed=True) == layers + head
