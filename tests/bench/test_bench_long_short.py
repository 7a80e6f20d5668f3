"""`pipefill bench long-short` as a user runs it: the CLI starts real `pipefill serve` processes
(a tiny model, prompts of a few chunks) once per policy and prints its table and bars; the
table's arithmetic on fabricated measurements; bad flags get a sentence."""
import json
import subprocess
import sys

import pytest

from pipefill.bench.long_short import Measurement, Plan, bars, check_args, table
from pipefill.cli.main import build_parser

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "pipefill.cli.main", "bench", "long-short",
                           *args], capture_output=True, text=True, timeout=timeout)


def test_ratios_are_medians_of_per_repetition_ratios():
    plan = Plan(1000, (100,), ("fcfs", "fair"), ())
    runs = []
    for rep, (alone_long, alone_short, fcfs_short) in enumerate(
            [(10.0, 1.0, 5.0), (20.0, 2.0, 4.0), (10.0, 1.0, 9.0)]):
        runs += [Measurement(rep, "long", 1000, "alone", alone_long),
                 Measurement(rep, "short", 100, "alone", alone_short),
                 Measurement(rep, "long", 1000, "fcfs", alone_long * 1.1),
                 Measurement(rep, "short", 100, "fcfs", fcfs_short),
                 Measurement(rep, "long", 1000, "fair", None, "HTTP 500"),
                 Measurement(rep, "short", 100, "fair", alone_short * 2)]
    rows = {(r["case"], r["policy"]): r for r in table(runs, plan)}
    assert rows["short", "fcfs"]["ttft_s"] == {"median": 5.0, "min": 4.0, "max": 9.0}
    # per repetition 5/1, 4/2, 9/1: the median of the ratios, not a ratio of medians
    assert rows["short", "fcfs"]["ratio_to_alone"] == {"median": 5.0, "min": 2.0, "max": 9.0}
    assert rows["long", "fair"]["failed"] == 3 and rows["long", "fair"]["ttft_s"] is None
    assert rows["long", "alone"]["ratio_to_alone"] is None
    checks = {(c["case"], c["policy"]): c for c in bars(table(runs, plan))}
    assert checks["long", "fcfs"]["pass"] and not checks["short", "fcfs"]["pass"]
    assert checks["short", "fair"]["pass"] and not checks["long", "fair"]["pass"]


@pytest.mark.parametrize("args, words", [
    (["--policies", "fcfs,lifo"], "--policies"),
    (["--short-lens", "1k"], "--short-lens"),
    (["--serve-args", "--port 9"], "--port is set by long-short"),
    (["--long-len", "600", "--max-model-len", "600"], "no room"),
])
def test_bad_flags_get_a_sentence(args, words):
    parser = build_parser()
    with pytest.raises(ValueError, match=words):
        check_args(parser.parse_args(["bench", "long-short", *args]))


def test_a_bad_flag_exits_2_with_a_sentence():
    r = bench("--reps", "0", timeout=60)
    assert r.returncode == 2 and "--reps" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_long_short_against_pipefill_serve(tiny_models, tmp_path):
    out = tmp_path / "run.json"
    serve = (f"--model-path {tiny_models['llama']} --pp-size 2 --threads-per-stage 1 "
             "--page-size 16 --chunked-prefill-size 64")   # the long prompt: 10 chunks
    r = bench("--long-len", "600", "--short-lens", "64,160", "--delay", "0.2", "--reps", "1",
              "--dtype", "float32", "--vocab-size", "512", "--serve-args", serve,
              "--log-dir", str(tmp_path / "logs"), "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for case in ("long 600", "short 64", "short 160"):
        for policy in ("alone", "fcfs", "fair*", "priority"):
            assert any(line.startswith(case) and line.split()[2] == policy for line in lines), \
                (case, policy, r.stdout)
    assert sum(line.startswith(("PASS ", "FAIL ")) for line in lines) == 9
    assert "PASS fair (default): " in r.stdout or "FAIL fair (default): " in r.stdout
    run = json.loads(out.read_text())
    assert run["default_policy"] == "fair" and run["cpu"]
    assert len(run["runs"]) == 3 + 3 * 3 and all(m["ttft_s"] > 0 for m in run["runs"])
    assert len(run["table"]) == 3 * 4 and len(run["bars"]) == 9
    assert "--max-model-len" in run["serve_flags"] and "664" in run["serve_flags"]
    assert len(list((tmp_path / "logs").iterdir())) == 3   # a server per policy
