"""The stall watchdog (--stage-stall-timeout) on a real `pipefill serve` (tiny model, two stage
processes): a stage stopped with SIGSTOP while requests are in flight is declared stalled
within the timeout, its requests fail with a sentence that names it, /health names it with a
503 while the stages restart, and then requests are answered again. An idle server is never
declared stalled, nor is a long prefill that keeps making progress. First the watch's rules,
on a real board file written through the stages' own writer (runtime/heartbeat.py)."""
import os
import signal
import threading
import time

import httpx
import pytest

from conftest import save_tiny_model
from test_supervisor import (PROMPT, chat_model, children, generate, metric,  # noqa: F401
                             wait_gone, wait_health)

try:
    from server_util import start_server, stop_server
except ImportError:
    from test_server import start_server, stop_server

from pipefill.config import ServerArgs
from pipefill.runtime.heartbeat import Board, StageHeartbeat, StallWatch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ---- the watch's rules, with an explicit clock ---------------------------------------------

def stages_on_a_board(tmp_path, n: int, timeout_s: float = 3.0, local=None):
    """The front end's board and watch, and one writer per stage, each through its own mapping
    of the file as a stage process has."""
    path = str(tmp_path / "heartbeat")
    board = Board.create(path, n)
    stages = [StageHeartbeat(Board(path), rank) for rank in range(n)]
    return stages, StallWatch(board, local or range(n), n, timeout_s, now=0.0)


def step(stages, through: int) -> None:
    """One micro-batch launched by stage 0 and finished by stages 1..through."""
    stages[0].passed_on()
    for s in stages[1:through + 1]:
        s.passed_on()


def test_idle_stages_are_never_stalled(tmp_path):
    s, watch = stages_on_a_board(tmp_path, 3)
    for _ in range(5):  # some work first: every stage finished it
        step(s, 2)
        s[0].retired()
    for now in (1.0, 10.0, 1000.0):  # nothing beats, nothing is out
        assert watch.check(requests_in_flight=False, now=now) is None
    # Requests in flight (waiting for KV, say) and stage 0 beating; no micro-batch out.
    for now in (1001.0, 1002.0, 1003.0, 1004.0, 1005.0):
        s[0].beat()
        assert watch.check(True, now) is None


def test_a_later_stage_that_never_finishes_its_micro_batch_is_named(tmp_path):
    s, watch = stages_on_a_board(tmp_path, 3)
    assert watch.check(False, 100.0) is None  # idle for 100 s before the work came
    step(s, 0)  # stage 0 launched a micro-batch; stage 1 never finishes it
    for now in (100.1, 101.0, 102.0, 102.9):
        s[0].beat()  # stage 0 spins waiting for the result
        assert watch.check(True, now) is None, now
    s[0].beat()
    stall = watch.check(True, 103.5)
    assert stall is not None and stall.rank == 1
    # Counted from the first check that saw it out, not from the idle 100 s.
    assert stall.seconds == pytest.approx(3.4)
    assert stall.sentence(4242) == ("stage 1 (pid 4242) stalled: it had work but made no "
                                    "progress for 3.4 s (--stage-stall-timeout 3)")


def test_the_stage_holding_the_oldest_micro_batch_is_named(tmp_path):
    s, watch = stages_on_a_board(tmp_path, 4)
    step(s, 3)
    step(s, 3)
    s[0].retired()  # one result back, one on its way
    step(s, 1)  # a third micro-batch got through stage 1
    assert watch.check(True, 0.5) is None
    s[0].beat()
    assert watch.check(True, 1.0) is None
    for now in (2.0, 3.0, 3.4):  # stage 0 keeps beating, nothing else moves
        s[0].beat()
        assert watch.check(True, now) is None
    # The oldest micro-batch out passed every stage: the last stage's result never came.
    s[0].beat()
    assert watch.check(True, 3.6).rank == 3
    s[0].retired()  # it came after all; now the oldest out is the third, at stage 2
    s[0].beat()
    assert watch.check(True, 5.0) is None
    s[0].beat()
    assert watch.check(True, 8.1).rank == 2


def test_progress_anywhere_in_the_pipeline_resets_the_count(tmp_path):
    s, watch = stages_on_a_board(tmp_path, 2)
    step(s, 0)
    for now in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0):  # a long prefill: one chunk every second
        s[0].beat()
        s[1].passed_on()
        s[0].retired()
        step(s, 0)
        assert watch.check(True, now) is None


def test_a_chunk_longer_than_the_timeout_counts_its_layers_as_progress(tmp_path):
    """One chunk deep into a long prompt outlasts the timeout on CPU; its layers do not."""
    s, watch = stages_on_a_board(tmp_path, 2)
    for now in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):  # stage 0: one chunk, a layer a second
        s[0].layer_done()
        assert watch.check(True, now) is None
    step(s, 0)  # launched; stage 1 runs it, stage 0 spins
    for now in (7.0, 8.0, 9.0, 10.0, 11.0, 12.0):
        s[0].beat()
        s[1].layer_done()
        assert watch.check(True, now) is None
    s[0].beat()  # stage 1 wedged inside its forward: its layers stop
    assert watch.check(True, 14.0) is None
    s[0].beat()
    assert watch.check(True, 15.1).rank == 1


def test_stage_0_wedged_inside_a_forward_is_named(tmp_path):
    s, watch = stages_on_a_board(tmp_path, 2)
    s[0].layer_done()
    assert watch.check(True, 1.0) is None
    assert watch.check(True, 4.1).rank == 0  # no beat, no layer since 1.0


def test_stage_0_silent_with_requests_is_named_before_a_stage_behind_it(tmp_path):
    s, watch = stages_on_a_board(tmp_path, 2)
    # Stage 0 silent (as if stopped) with nothing to do: not stalled.
    assert watch.check(False, 50.0) is None
    # A request arrives: counted from the last check without work.
    assert watch.check(True, 50.1) is None
    assert watch.check(True, 52.9) is None
    assert watch.check(True, 53.2).rank == 0
    s[0].beat()  # it moved again: the count starts over
    assert watch.check(True, 55.0) is None
    # Frozen with a micro-batch out that stage 1 finished: stage 0 never takes its result.
    step(s, 1)
    assert watch.check(True, 55.5) is None
    assert watch.check(True, 58.1).rank == 0


def test_work_that_stops_on_another_node_names_the_first_stage_there(tmp_path):
    s, watch = stages_on_a_board(tmp_path, 4, local=range(2))  # node 0 runs stages 0 and 1
    step(s, 1)
    s[0].beat()
    assert watch.check(True, 1.0) is None
    s[0].beat()
    assert watch.check(True, 3.9) is None
    s[0].beat()
    stall = watch.check(True, 4.1)
    assert (stall.rank, stall.watched) == (2, False)
    assert stall.sentence(None).startswith("stage 2 (on another node) stalled")


def test_a_negative_stall_timeout_is_refused_with_a_sentence():
    with pytest.raises(ValueError, match=r"--stage-stall-timeout must be >= 0 \(0 = off\)"):
        ServerArgs(stage_stall_timeout=-1)


# ---- a real server -------------------------------------------------------------------------

def stream_tokens(url: str, max_tokens: int, first_token: threading.Event,
                  into: dict) -> None:
    """One streamed request; records its lines and when it ended."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in filter(None, r.iter_lines()):
            lines.append(line)
            first_token.set()
    into.update(lines=lines, ended=time.monotonic())


def post_completion(url: str, max_tokens: int, into: dict) -> None:
    r = generate(url, max_tokens=max_tokens, timeout=120)
    into.update(status=r.status_code, body=r.json(), ended=time.monotonic())


def wait_running(url: str, n: int, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while metric(url, "pipefill_requests_running") < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests running"
        time.sleep(0.05)


def wedge_under_load(proc, url: str, rank: int, timeout_s: float) -> float:
    """SIGSTOPs stage rank while two requests (one streamed, one whole) are generating;
    checks that both fail soon after the timeout with a sentence naming the stage and that
    /health names it with a 503; returns the seconds from the stop to the clients' errors."""
    stream, whole, first_token = {}, {}, threading.Event()
    clients = [threading.Thread(target=stream_tokens, args=(url, 3000, first_token, stream)),
               threading.Thread(target=post_completion, args=(url, 3000, whole))]
    for c in clients:
        c.start()
    assert first_token.wait(30)
    wait_running(url, 2)
    victim = children(proc.pid)[rank]
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    for c in clients:
        c.join(60)
        assert not c.is_alive(), "a request hung on the wedged stage"
    detected = max(r["ended"] - stopped_at for r in (stream, whole))
    print(f"\nwedged stage {rank} (SIGSTOP): its 2 requests failed after {detected:.2f} s "
          f"(--stage-stall-timeout {timeout_s})")
    # Not before the timeout (the stage was working until the stop), and soon after it.
    assert timeout_s * 0.9 <= detected <= timeout_s + 5, detected
    named = f"stage {rank} (pid {victim}) stalled: it had work"
    assert stream["lines"][-1] == "data: [DONE]", stream["lines"][-2:]
    assert named in stream["lines"][-2], stream["lines"][-2]
    assert whole["status"] == 503, whole
    assert whole["body"]["error"]["message"].startswith(named), whole
    # (A fresh group takes seconds to start: torch, the model, a warm-up forward.)
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503, health.text
    assert named in health.json()["error"], health.text
    assert "restarting the stages" in health.json()["error"], health.text
    wait_gone([victim])  # the stopped stage was killed, not left behind
    return detected


@pytest.mark.slow
def test_a_wedged_stage_is_detected_its_requests_fail_and_the_stages_restart(chat_model):
    """Stage 1 stopped: stage 0 waits for its results but keeps beating, so only stage 1 is
    named. Then stage 0 stopped: stage 1 waits for input with nothing owed, so only stage 0
    is named."""
    timeout_s = 3
    proc, url = start_server(chat_model, None, "--stage-stall-timeout", str(timeout_s))
    try:
        before = generate(url).json()["choices"][0]["text"]
        for restarts, rank in enumerate((1, 0), start=1):
            wedge_under_load(proc, url, rank, timeout_s)
            wait_health(url, 200, 90)
            after = generate(url)
            assert after.status_code == 200, after.text
            assert after.json()["choices"][0]["text"] == before
            assert metric(url, "pipefill_stage_restarts_total") == restarts
    except AssertionError:
        stop_server(proc)
        print(proc.stdout.read()[-20000:])
        raise
    finally:
        assert stop_server(proc) == 0


@pytest.mark.slow
def test_in_three_stages_the_wedged_middle_stage_is_named_not_its_neighbours(chat_model):
    """Stage 1 of 3 stopped: stage 0 keeps beating while it waits for results, stage 2 waits
    for input with nothing owed; the micro-batch that stopped is at stage 1."""
    proc, url = start_server(chat_model, None, "--pp-size", "3", "--stage-stall-timeout", "3")
    try:
        assert len(children(proc.pid)) == 3
        wedge_under_load(proc, url, 1, 3)
        wait_health(url, 200, 90)
        assert generate(url).status_code == 200
    finally:
        assert stop_server(proc) == 0


def test_an_idle_server_is_not_declared_stalled(chat_model):
    timeout_s = 1
    proc, url = start_server(chat_model, None, "--stage-stall-timeout", str(timeout_s))
    try:
        assert generate(url).status_code == 200  # every stage has run a micro-batch
        deadline = time.monotonic() + 6 * timeout_s
        while time.monotonic() < deadline:
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            time.sleep(0.2)
        assert generate(url).status_code == 200
        assert metric(url, "pipefill_stage_restarts_total") == 0
    finally:
        assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory):
    """Tiny in every way but width and depth: a 128-token chunk takes a few tenths of a second
    per stage on one core, so a long prompt takes many seconds in many steps."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("wide"), hidden_size=512,
                           intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                           num_key_value_heads=4, max_position_embeddings=8192)


def prefill_under_the_watch(model, timeout_s: float, chunk: int, num_tokens: int,
                            *extra) -> float:
    """Seconds one prompt of num_tokens took through a server with that stall timeout and
    chunk size; it must be answered with no stage restarted."""
    proc, url = start_server(model, None, "--stage-stall-timeout", str(timeout_s),
                             "--chunked-prefill-size", str(chunk), "--max-model-len", "8192",
                             *extra)
    try:
        prompt = [(7 * i) % 500 + 1 for i in range(num_tokens)]
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", timeout=300,
                       json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        took = time.monotonic() - t0
        print(f"\nprefill of {num_tokens} tokens in chunks of {chunk}: {took:.1f} s "
              f"(--stage-stall-timeout {timeout_s})")
        assert r.status_code == 200, r.text
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert metric(url, "pipefill_stage_restarts_total") == 0
        return took
    finally:
        assert stop_server(proc) == 0


@pytest.mark.slow
def test_a_long_prefill_that_keeps_progressing_is_not_declared_stalled(wider_model):
    took = prefill_under_the_watch(wider_model, 2, 128, 6144)  # 48 chunks
    # Only meaningful if the request outlived the timeout (about 10x on 2 busy cores).
    assert took > 2 * 2, f"the prefill took only {took:.1f} s: use a longer prompt"


@pytest.mark.slow
def test_one_chunk_longer_than_the_timeout_is_not_declared_stalled(wider_model):
    """A prefill chunk that outlasts --stage-stall-timeout while each of its layers does not
    (a 2,048-token chunk at 128K of context: ~55 s, under 2 s a layer) is progress. Here a
    2,048-token chunk through 8 layers on one thread takes ~3 s, a layer ~0.4 s."""
    took = prefill_under_the_watch(wider_model, 2, 2048, 8000, "--pp-size", "1")  # 4 chunks
    # Only meaningful if a chunk outlived the timeout.
    assert took / 4 > 2, f"a chunk took only {took / 4:.1f} s: use wider chunks"
