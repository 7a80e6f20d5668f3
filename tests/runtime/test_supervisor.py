"""The stage supervisor of `pipefill serve` (real server, tiny model, two stage processes):
a stage killed mid-stream fails its client fast, the stages come back with the same answers,
restarts are counted, nothing is orphaned, and a crash loop stops with a sentence. Also the
Python Engine's clean state after errors, interrupts and a dead stage."""
import os
import signal
import subprocess
import time

import httpx
import pytest

from conftest import assert_pages_free, save_tiny_model, track

try:
    from server_util import start_server, stop_server
except ImportError:
    from test_server import start_server, stop_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer (so that answers are text)."""
    from pipefill.model.loader import WeightSource, resolve_model_path
    from pipefill.model.tokenizer import load_tokenizer
    path = save_tiny_model("llama", tmp_path_factory.mktemp("sup"), vocab_size=49152,
                           max_position_embeddings=4096)
    load_tokenizer(WeightSource(resolve_model_path(None))).hf.save_pretrained(path)
    return path


def children(pid: int) -> list[int]:
    """Live child processes of pid, from /proc (the stage processes of a server)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return sorted(int(p) for p in out.stdout.split())


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def generate(url: str, prompt=PROMPT, max_tokens: int = 12, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=timeout, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def wait_health(url: str, status: int, within_s: float) -> dict:
    deadline = time.monotonic() + within_s
    while True:
        r = httpx.get(url + "/health", timeout=5)
        if r.status_code == status:
            return r.json()
        assert time.monotonic() < deadline, f"/health stayed {r.status_code}: {r.text}"
        time.sleep(0.2)


def stream_until_killed(url: str, victim: int) -> list[str]:
    """Streams a long request, SIGKILLs victim after the first tokens, returns the lines."""
    body = {"prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in filter(None, r.iter_lines()):
            lines.append(line)
            if len(lines) == 6:
                os.kill(victim, signal.SIGKILL)
    return lines


def wait_gone(pids, within_s: float = 15) -> None:
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"orphans: {[p for p in pids if alive(p)]}"
        time.sleep(0.1)


def kill_mid_stream_and_come_back(proc, url: str, health_within_s: float,
                                  ask_while_restarting: bool = False) -> list[int]:
    """SIGKILLs the second of the server's two stage processes mid-stream: that client gets
    an error at once, the supervisor restarts the stages (one restart, fresh processes, the
    old ones gone) and the answers are the same as before. ask_while_restarting: a request
    sent meanwhile waits for the new stages and is answered. Returns the new processes."""
    before = generate(url).json()["choices"][0]["text"]
    first = children(proc.pid)
    assert len(first) == 2
    t0 = time.monotonic()
    lines = stream_until_killed(url, first[1])
    assert time.monotonic() - t0 < 30  # the client heard about it, no hang
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2], lines[-2:]
    if ask_while_restarting:
        waiting = generate(url)
        assert waiting.status_code == 200, waiting.text
        assert waiting.json()["choices"][0]["text"] == before
    wait_health(url, 200, health_within_s)
    assert generate(url).json()["choices"][0]["text"] == before
    assert metric(url, "pipefill_stage_restarts_total") == 1
    wait_gone(first)
    second = children(proc.pid)
    assert len(second) == 2 and not set(second) & set(first)
    return second


def assert_stays_down(url: str) -> None:
    health = wait_health(url, 503, 30)
    assert "--max-stage-restarts 1" in health["error"] and "not restarting" in health["error"]
    time.sleep(2)  # no further restart
    assert wait_health(url, 503, 0) == health
    r = generate(url, timeout=30)
    assert r.status_code == 503 and "--max-stage-restarts" in r.text, r.text


def test_killed_stage_fails_its_client_then_the_pipeline_comes_back(chat_model):
    """Kill stage 1 mid-stream: that client gets an error, the stages restart, answers are
    the same; kill again (--max-stage-restarts 1): a crash loop, the server stays down."""
    proc, url = start_server(chat_model, None, "--max-stage-restarts", "1")
    try:
        second = kill_mid_stream_and_come_back(proc, url, 60, ask_while_restarting=True)
        os.kill(second[0], signal.SIGKILL)
        assert_stays_down(url)
        assert metric(url, "pipefill_stage_restarts_total") == 1
        wait_gone(second)
        assert children(proc.pid) == []
    finally:
        assert stop_server(proc) == 0


@pytest.mark.slow
def test_a_request_during_a_long_restart_gets_a_503_that_says_why(chat_model, tmp_path):
    proc, url = start_server(chat_model, None, "--stage-restart-timeout", "1",
                             "--trace-dir", str(tmp_path))
    try:
        first = children(proc.pid)
        os.kill(first[1], signal.SIGKILL)
        health = wait_health(url, 503, 30)
        assert "restarting the stages" in health["error"], health
        # The restart takes longer than a second (fresh interpreters load torch and the
        # model): a request meanwhile waits its second and gets a 503 that says why.
        r = generate(url, timeout=30)
        assert r.status_code == 503 and "--stage-restart-timeout 1" in r.text, r.text
        wait_health(url, 200, 60)
        assert generate(url).status_code == 200
        wait_gone(first)
    finally:
        assert stop_server(proc) == 0
    # The restarted stages lived until the graceful stop and handed over their spans.
    assert (tmp_path / "serve.json").exists()


# ---- the Python Engine: a failed call leaves nothing running and a clear state ---------------

LONG = [[(5 * i + n) % 512 for i in range(n)] for n in (30, 70)]


@pytest.fixture(scope="module")
def engine(tiny_models):
    from pipefill import Engine
    with track(Engine(tiny_models["llama"], dtype="float32", page_size=16,
                      chunked_prefill_size=32)) as e:
        yield e


def test_a_rejected_request_aborts_the_rest_of_its_call(engine, monkeypatch):
    # Skip the front-end check so that stage 0's own check rejects the middle request while
    # the other two are already admitted and holding pages.
    monkeypatch.setattr(engine, "check_prompt", lambda ids, params: None)
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.generate([LONG[0], [], LONG[1]], max_new_tokens=900, ignore_eos=True)
    assert_pages_free(engine)


def test_ctrl_c_aborts_every_request_of_the_call(engine, monkeypatch):
    # Ctrl-C once the call is under way: KeyboardInterrupt where Python raises it, in the
    # calling thread, after the 20th message from stage 0. Raised here rather than by sending
    # SIGINT: in a long suite run the process's SIGINT handler can be another test's (one
    # such run saw no KeyboardInterrupt), and what is tested is generate()'s answer to it.
    recv, seen = engine._stages.recv, []

    def recv_then_interrupt(timeout_ms):
        msg = recv(timeout_ms)
        if msg is not None:
            seen.append(msg)
            if len(seen) == 20:
                raise KeyboardInterrupt
        return msg

    monkeypatch.setattr(engine._stages, "recv", recv_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(LONG, max_new_tokens=950, ignore_eos=True)
    monkeypatch.undo()
    assert len(seen) >= 20
    assert_pages_free(engine)
    assert len(engine.generate([[1, 2, 3]], max_new_tokens=3)[0].output_ids) == 3


def test_an_engine_whose_stage_died_says_so(tiny_models):
    from pipefill import Engine
    e = Engine(tiny_models["llama"], dtype="float32")
    try:
        stage = e._stages.procs[0]
        stage.kill()
        stage.wait()
        with pytest.raises(RuntimeError, match="stage 0"):
            e.generate([[1, 2, 3]], max_new_tokens=4)
        for call in (lambda: e.generate([[1, 2]]), e.stats):
            with pytest.raises(RuntimeError, match="failed earlier.*start a new Engine"):
                call()
    finally:
        e.shutdown()


def test_restart_budget_counts_restarts_within_the_window():
    from pipefill.runtime.launch import RestartBudget
    budget = RestartBudget(max_restarts=2, window_s=10.0)
    assert budget.take(0.0) and budget.take(1.0)
    assert not budget.take(5.0)  # a third within 10 s: a crash loop
    assert budget.take(10.5)  # the restart at 0 s has left the window
    assert not budget.take(10.6)
    assert not RestartBudget(max_restarts=0, window_s=10.0).take(0.0)


def test_killed_tp_rank_fails_its_client_then_the_group_comes_back(chat_model):
    """One stage of two TP ranks: kill the peer rank mid-stream; that client gets an error at
    once, the supervisor restarts the stage's whole group and the answers are the same."""
    proc, url = start_server(chat_model, None, "--pp-size", "1", "--tp-size", "2")
    try:
        kill_mid_stream_and_come_back(proc, url, 90)
    finally:
        assert stop_server(proc) == 0
