"""`pipefill bench decode --compare-tp-size`: its refusal, and (slow) a tiny run that times the
batch-1 step at TP 1 and TP 2 (no timing is checked: only that both ran and were recorded)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import save_tiny_model
from pipefill.cli.main import main


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
