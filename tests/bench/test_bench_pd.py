"""`pipefill bench pd-serving` end to end (slow, ~3 min): it starts PD (prefill + decode + the
real sglang-router), colocated PP1 and PP2 itself, runs a tiny workload through each, prints
the table with the ITL ratios, measures the last chunk -> first token timeline from the
servers' pd-timeline lines against one chunk's KV transfer, and leaves no server behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_pd_router import chat_model  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _pids_with(needle: str) -> set[int]:
    out = subprocess.run(["pgrep", "-f", needle], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def test_pd_serving_smoke(chat_model, tmp_path):
    out, logs = tmp_path / "pd.json", tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "pipefill.cli.main", "bench", "pd-serving", "--num-prompts", "4",
         "--input-len", "300", "--range-ratio", "0.5", "--output-lens", "8,16",
         "--timeline-len", "1024", "--log-dir", str(logs), "--json", str(out), "--",
         "--model-path", chat_model, "--page-size", "16", "--chunked-prefill-size", "256",
         "--dtype", "float32"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ITL p99 PD / pp1 =" in proc.stdout and "ITL p99 PD / pp2 =" in proc.stdout
    data = json.loads(out.read_text())
    assert {(r["config"], r["output_len"]) for r in data["rows"]} == {
        (c, n) for c in ("pd", "pp1", "pp2") for n in (8, 16)}
    for r in data["rows"]:
        s = r["summary"]
        assert s["completed"] == 4 and s["itl_s"]["p99"] > 0 and s["ttft_s"]["mean"] > 0, r
    # The same text prompts everywhere, counted by each server alike.
    assert len({r["summary"]["input_tokens"] for r in data["rows"]}) == 1

    t = data["timeline"]
    ev = t["events_s_after_last_forward"]
    assert set(ev) == {"stage0-last-forward-end", "stage0-released", "decode-ready"}
    assert ev["stage0-last-forward-end"] == 0
    # Causality on one clock: pages sent, then the decode ready, then the client's token.
    assert 0 <= ev["stage0-released"] <= ev["decode-ready"] <= \
        t["first_token_s_after_last_forward"] < t["ttft_s"]
    x = t["chunk_transfer"]
    assert x["page_size"] == 16 and x["kv_dtype"] == "float32" and x["chunk_tokens"] == 256
    assert x["contiguous"]["chunk_s"] > 0 and x["shuffled"]["gbs"] > 0
    assert "last forward -> first token" in proc.stdout
    # Every server it started is gone (their logs name the folder they were started with).
    assert sorted(os.listdir(logs)) == ["pd-decode.log", "pd-prefill.log", "pd-router.log",
                                        "pp1-pp1.log", "pp2-pp2.log"]
    assert not _pids_with(chat_model)
