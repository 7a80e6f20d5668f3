"""`pipefill bench serving --prompt-mode text` against a real `pipefill serve` (tiny model with
the default model's tokenizer): the text prompts are the wanted lengths by the server's own
count, and TTFT/ITL/TPOT come out; `bench pd-serving` refuses bad flags with a sentence."""
from __future__ import annotations

import json
import signal

import pytest

from test_pd_router import chat_model, spawn_server, stop, wait_healthy  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _run_cli(argv: list[str]) -> int:
    from pipefill.cli.main import main
    previous = signal.getsignal(signal.SIGTERM)
    try:
        return main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_text_prompts_are_the_wanted_lengths_by_the_servers_count(chat_model, tmp_path):
    proc, url = spawn_server(chat_model, "--max-model-len", "512")
    try:
        wait_healthy(proc, url)
        out = tmp_path / "bench.json"
        assert _run_cli(["bench", "serving", "--base-url", url, "--prompt-mode", "text",
                         "--tokenizer", chat_model, "--num-prompts", "4",
                         "--random-input-len", "120", "--random-range-ratio", "0.5",
                         "--random-output-len", "6", "--max-concurrency", "2",
                         "--json", str(out)]) == 0
    finally:
        stop(proc)
    data = json.loads(out.read_text())
    s, requests = data["summary"], data["requests"]
    assert s["completed"] == 4 and s["failed"] == 0
    assert len({r["requested_input_len"] for r in requests}) > 1  # lengths vary
    for r in requests:
        # usage.prompt_tokens, the server's tokenizer on our text, is exactly the wanted length
        assert r["input_len"] == r["requested_input_len"], r
        assert 3 <= r["output_len"] <= 9 and r["ttft_s"] > 0
        assert 1 <= len(r["itl_s"]) <= r["output_len"] - 1
    assert s["itl_s"]["p99"] >= s["itl_s"]["p50"] > 0 and s["tpot_s"]["mean"] > 0
    assert s["input_tokens"] == sum(r["input_len"] for r in requests)


@pytest.mark.parametrize("argv,needle", [
    (["--configs", "pd,pp3"], "--configs"),
    (["--cores", "0,0"], "--cores"),
    (["--output-lens", "64,x"], "--output-lens"),
    (["--range-ratio", "1.5"], "--range-ratio"),
    (["--", "--pp-size", "2"], "--pp-size is set by pd-serving"),
    (["--", "--threads-per-stage=2"], "--threads-per-stage is set by pd-serving")])
def test_pd_serving_refuses_bad_flags_with_a_sentence(argv, needle, capsys):
    assert _run_cli(["bench", "pd-serving", *argv]) == 2
    assert needle in capsys.readouterr().err
