"""`pipefill bench link`: its arguments, and (slow, root) a tiny run of the stage link alone
across two network namespaces and of a tiny model's PP2 prefill."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import save_tiny_model
from pipefill.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("argv, said", [
    (["--reps", "0"], "--reps must be at least 1"),
    (["--chunk-size", "0"], "--chunk-size must be at least 1"),
    (["--delay-ms", "0"], "--delay-ms and --rate-gbit must be positive"),
])
def test_bad_arguments_exit_2_with_a_sentence(capsys, argv, said):
    assert main(["bench", "link", *argv]) == 2
    assert said in capsys.readouterr().err


def bench_link(*argv: str) -> str:
    if os.geteuid() != 0 or not os.path.exists("/dev/net/tun"):
        pytest.skip("needs root and /dev/net/tun")
    r = subprocess.run([sys.executable, "-m", "pipefill.cli.main", "bench", "link", *argv],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": ROOT})
    if "cannot create network namespaces" in r.stderr:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.slow
def test_a_tiny_p2p_run_prints_both_links_and_the_cost_per_chunk():
    out = bench_link("--p2p", "--reps", "1", "--chunks", "2", "--chunk-size", "4",
                     "--hidden-size", "64")
    assert "| 0 |" in out and "| 1 |" in out, out
    assert "round trips per chunk" in out, out


@pytest.mark.slow
def test_a_tiny_prefill_run_prints_its_chunks(tmp_path):
    model = save_tiny_model("llama", tmp_path / "m")
    out = bench_link("--reps", "1", "--model-path", model, "--dtype", "float32",
                     "--input-len", "256", "--chunked-prefill-size", "64")
    assert "(4 chunks)" in out and "round trips per chunk" in out, out
