"""Faults under load (slow): while `pipefill bench serving` drives a real `pipefill serve`
(tiny model, two stages), SIGKILL a stage, SIGSTOP one for 20 s, and finally SIGKILL the server
itself mid-stream. Every client gets an answer or an error (the benchmark ends, no request
hangs past its timeout), no process is orphaned, no page leaks, and the supervisor brings the
pipeline back after the kill."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_supervisor import (alive, chat_model, children, metric, wait_gone,  # noqa: F401
                             wait_health)

try:
    from server_util import start_server, stop_server
except ImportError:
    from test_server import start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

STOP_S = 20  # how long one stage stays SIGSTOPped
REQUEST_TIMEOUT_S = 120  # the benchmark client's per-request timeout
CONCURRENCY = 4


def start_bench(url: str, out: str, num_prompts: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipefill.cli.main", "bench", "serving", "--base-url", url,
         "--num-prompts", str(num_prompts), "--random-input-len", "160",
         "--random-range-ratio", "0.5", "--random-output-len", "48",
         "--max-concurrency", str(CONCURRENCY), "--timeout", str(REQUEST_TIMEOUT_S),
         "--json", out], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_busy(url: str, bench: subprocess.Popen, within_s: float = 60) -> None:
    """Until the server runs requests (so that a fault hits requests in flight)."""
    deadline = time.monotonic() + within_s
    while metric(url, "pipefill_requests_running") == 0:
        assert bench.poll() is None, "the benchmark ended before the fault"
        assert time.monotonic() < deadline, "no request running"
        time.sleep(0.1)


def finish(bench: subprocess.Popen, out: str) -> list[dict]:
    """The benchmark must end on its own: every request answered or failed in time."""
    try:
        log, _ = bench.communicate(timeout=REQUEST_TIMEOUT_S + 300)
    except subprocess.TimeoutExpired:
        bench.kill()
        raise AssertionError("the benchmark hung: some request got neither answer nor error")
    with open(out) as f:
        requests = json.load(f)["requests"]
    for r in requests:
        assert r["ok"] or r["error"], r
    return requests


def assert_pages_back(url: str, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while metric(url, "pipefill_kv_pages_used") or metric(url, "pipefill_requests_running"):
        assert time.monotonic() < deadline, "pages were not returned"
        time.sleep(0.2)
    assert metric(url, "pipefill_kv_pages_free") > 0


def test_faults_under_load(chat_model, tmp_path):
    proc, url = start_server(chat_model, None, "--max-stage-restarts", "3",
                             "--stage-restart-timeout", "90")
    try:
        out = str(tmp_path / "bench1.json")
        bench = start_bench(url, out, num_prompts=400)
        # 1. SIGKILL stage 1 under load: its requests fail fast, the rest wait, then go on.
        wait_busy(url, bench)
        first = children(proc.pid)
        os.kill(first[1], signal.SIGKILL)
        wait_health(url, 503, 30)  # noticed
        wait_health(url, 200, 90)  # back
        assert metric(url, "pipefill_stage_restarts_total") == 1
        wait_gone(first)
        # 2. SIGSTOP stage 0 of the new group for 20 s: requests stall, nothing dies.
        wait_busy(url, bench)
        stage0 = children(proc.pid)[0]
        os.kill(stage0, signal.SIGSTOP)
        time.sleep(STOP_S)
        os.kill(stage0, signal.SIGCONT)
        assert bench.poll() is None, "the benchmark ended before the SIGSTOP was over"
        requests = finish(bench, out)
        failed = [r for r in requests if not r["ok"]]
        # Only requests in flight at the kill may fail (at most the concurrency limit).
        print(f"\nkill + stop under load: {len(requests) - len(failed)} answered, "
              f"{len(failed)} failed: {sorted({r['error'][:80] for r in failed})}")
        assert 1 <= len(failed) <= CONCURRENCY, [r["error"] for r in failed]
        assert metric(url, "pipefill_stage_restarts_total") == 1  # the stop was no failure
        assert_pages_back(url)
        # 3. SIGKILL the server mid-stream: clients get errors, its stages die with it.
        out2 = str(tmp_path / "bench2.json")
        bench = start_bench(url, out2, num_prompts=40)
        wait_busy(url, bench)
        stages = children(proc.pid)
        proc.kill()
        proc.wait(10)
        requests = finish(bench, out2)
        print(f"server killed: {sum(r['ok'] for r in requests)} answered, "
              f"{sum(not r['ok'] for r in requests)} failed")
        assert any(not r["ok"] for r in requests)
        wait_gone(stages)
    finally:
        if proc.poll() is None:
            stop_server(proc)
