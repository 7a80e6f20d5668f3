"""`pipefill bench multiturn` as a user runs it: the CLI against a real `pipefill serve` (tiny
model with the default tokenizer and chat template), over HTTP with streaming."""
import json
import random
import subprocess
import sys

import pytest

from pipefill.bench.multiturn import Conversation, make_text
from test_server import chat_model, start_server, stop_server  # noqa: F401 - fixture

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def server(chat_model):  # noqa: F811
    proc, url = start_server(chat_model, None, "--max-model-len", "2048")
    yield url
    assert stop_server(proc) == 0


def bench(url, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pipefill.cli.main", "bench", "multiturn",
                           "--base-url", url, *args], capture_output=True, text=True,
                          timeout=timeout)


def test_text_is_deterministic_and_sized():
    assert make_text(random.Random(3), 500) == make_text(random.Random(3), 500)
    assert make_text(random.Random(3), 500) != make_text(random.Random(4), 500)
    conv = Conversation.generate(0, 6000, 8, 200)
    assert len(conv.questions) == 8 and len(set(conv.questions)) == 8
    # The history of turn k: system, document + question 1, then (answer, question) pairs.
    msgs = conv.messages(2, ["first answer", "second answer"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant",
                                         "user"]
    assert conv.document in msgs[1]["content"] and msgs[5]["content"] == conv.questions[2]


def test_multiturn_against_pipefill_serve(server, tmp_path):
    out = tmp_path / "run.json"
    args = ["--doc-tokens", "300", "--turns", "3", "--question-tokens", "40",
            "--answer-tokens", "8"]
    r = bench(server, *args, "--json", str(out), "--label", "first")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "/turn 1" in r.stdout and "summary:" in r.stdout
    run = json.loads(out.read_text())
    turns = run["results"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["ok"] for t in turns)
    assert all(t["completion_tokens"] == 8 for t in turns)            # ignore_eos
    # About 300 + 40 tokens plus the chat template (the server's own count) ...
    assert 280 <= turns[0]["prompt_tokens"] <= 450, turns[0]
    # ... and each turn re-sends the whole history: + the answer + a new ~40-token question.
    for a, b in zip(turns, turns[1:]):
        grew = b["prompt_tokens"] - a["prompt_tokens"]
        assert 8 + 30 <= grew <= 8 + 70, (a, b)
    assert run["summary"]["turns_ok"] == 3 and run["summary"]["ttft_turn1_s"] > 0
    # A replay re-sends the recorded conversation: the server sees the same prompts.
    replay = tmp_path / "replay.json"
    r = bench(server, "--replay", str(out), "--json", str(replay))   # its answer length too
    assert r.returncode == 0, r.stdout + r.stderr
    again = json.loads(replay.read_text())
    assert [t["prompt_tokens"] for t in again["results"]] == \
        [t["prompt_tokens"] for t in turns]
    assert "ratio_later_mean_to_recorded_turn1" in again["summary"]


def test_multiturn_bad_flags_and_dead_server(tmp_path):
    r = bench("http://127.0.0.1:9", "--turns", "0")
    assert r.returncode == 2 and "--turns must be at least 1" in r.stderr
    (tmp_path / "junk.json").write_text("{}")
    r = bench("http://127.0.0.1:9", "--replay", str(tmp_path / "junk.json"))
    assert r.returncode == 2 and "not a multiturn --json file" in r.stderr, r.stderr
    from pipefill.base.platform import free_port
    r = bench(f"http://127.0.0.1:{free_port()}", "--model", "m", "--turns", "2",
              "--timeout", "10", timeout=120)
    assert r.returncode == 1 and "failed: ConnectError" in r.stdout, r.stdout + r.stderr
