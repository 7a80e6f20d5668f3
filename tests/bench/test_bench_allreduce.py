"""`pipefill bench allreduce`: its arguments, and (slow) a tiny run of two real ranks."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipefill.bench.allreduce import DEFAULT_SIZES, iterations, parse_sizes
from pipefill.cli.main import main


def test_default_sizes_span_one_token_to_a_chunk_of_each_hidden_size():
    sizes = parse_sizes(DEFAULT_SIZES)
    assert {h for _, h in sizes} == {2048, 4096, 8192}
    assert {r for r, _ in sizes} == {1, 16, 512, 4096}


def test_timed_loops_move_similar_bytes_whatever_the_size():
    assert iterations(8 << 10) == 1000 and iterations(128 << 20) == 1
    assert iterations(1 << 20) == 64


@pytest.mark.parametrize("argv, said", [
    (["--sizes", "1x"], "is not ROWSxHIDDEN"),
    (["--sizes", "0x576"], "is not ROWSxHIDDEN"),
    (["--world", "1"], "--world must be at least 2"),
    (["--dtype", "float16"], "float16 unknown"),
    (["--reps", "0"], "must be positive"),
])
def test_bad_arguments_exit_2_with_a_sentence(capsys, argv, said):
    assert main(["bench", "allreduce", *argv]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_run_prints_a_row_per_size_and_dtype(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "pipefill.cli.main", "bench", "allreduce",
                        "--sizes", "1x576,3x1000", "--reps", "1", "--max-bytes", "4096",
                        "--json", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 1 x 576")
            or line.startswith("| 3 x 1000")]
    assert len(rows) == 4, r.stdout  # two sizes x two dtypes
    assert "RESULTS DIFFER" not in r.stdout
    assert (tmp_path / "r.json").exists()
