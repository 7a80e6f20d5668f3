"""PD disaggregation under faults, real processes behind the real sglang-router (slow): a decode
killed mid-transfer, a prefill killed, a prefill stage killed and restarted (the router's
retry gets a correct answer, never a stale one), mismatched page sizes."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from test_pd_router import (chat_model, client, metric, request_pages, spawn_server,  # noqa: F401
                            start_pd, stop, wait_healthy, wait_pages_free)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

FAULTS = ("--disable-radix-cache", "--chunked-prefill-size", "16",
          "--disaggregation-heartbeat-interval", "0.5",
          "--disaggregation-waiting-timeout", "8", "--disaggregation-bootstrap-timeout", "4")
ROUTER = ("--disable-circuit-breaker",)
LONG = "word " * 2500  # ~160 chunks of 16 on the prefill


def post(url: str, prompt: str, max_tokens: int = 8, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def in_background(fn, *args):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", _catch(fn, *args)), daemon=True)
    t.start()
    return t, box


def _catch(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_decode_killed_mid_transfer_frees_the_prefills_pages(chat_model):
    procs, urls = start_pd(chat_model, 2, *FAULTS, router_extra=ROUTER, reference=False)
    try:
        want = post(urls["router"], "A short one").json()["choices"][0]["text"]
        t, _ = in_background(post, urls["router"], LONG)
        wait_until(lambda: request_pages(urls["decode"]) > 0, 60, "the decode never started")
        os.killpg(procs["decode"].pid, signal.SIGKILL)
        procs["decode"].wait()
        # The room in flight fails at once (its decode's connection closed); the router's
        # retries reach the prefill alone, and their rooms time out without a bootstrap.
        wait_pages_free(urls["prefill"], 10)
        # A decode on the same port again: the same router and prefill serve the next request.
        port = int(urls["decode"].rsplit(":", 1)[1])
        procs["decode"], _ = spawn_server(chat_model, "--disaggregation-mode", "decode",
                                          *FAULTS, port=port)
        wait_healthy(procs["decode"], urls["decode"])
        t.join(120)
        r = post(urls["router"], "A short one")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
        wait_pages_free(urls["prefill"], 10)
        wait_pages_free(urls["decode"], 10)
    finally:
        stop(*procs.values())


def test_prefill_killed_fails_the_decodes_rooms_and_frees_their_pages(chat_model):
    procs, urls = start_pd(chat_model, 2, *FAULTS, router_extra=ROUTER, reference=False)
    try:
        t, box = in_background(post, urls["router"], LONG)
        wait_until(lambda: request_pages(urls["decode"]) > 0, 60,
                   "the decode never admitted the request")
        os.killpg(procs["prefill"].pid, signal.SIGKILL)
        procs["prefill"].wait()
        t.join(60)
        r = box["r"]
        assert isinstance(r, httpx.Response) and r.status_code >= 500, r
        wait_pages_free(urls["decode"], 10)
        assert httpx.get(urls["decode"] + "/health", timeout=5).status_code == 200
    finally:
        stop(*procs.values())


def test_prefill_stage_restart_the_routers_retry_gets_the_right_answer(chat_model):
    procs, urls = start_pd(chat_model, 2, *FAULTS, router_extra=ROUTER, reference=False)
    try:
        want = post(urls["router"], LONG).json()["choices"][0]["text"]
        other = post(urls["router"], "Something else").json()["choices"][0]["text"]
        t, box = in_background(post, urls["router"], LONG)
        wait_until(lambda: request_pages(urls["prefill"]) > 0, 60, "the prefill never started")
        stage = subprocess.run(["pgrep", "-P", str(procs["prefill"].pid)], capture_output=True,
                               text=True).stdout.split()
        os.kill(int(stage[-1]), signal.SIGKILL)  # one prefill stage: its server restarts them
        t.join(180)
        r = box["r"]
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want  # never another prompt's answer
        again = post(urls["router"], "Something else")
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == other
        wait_pages_free(urls["decode"], 10)
        wait_pages_free(urls["prefill"], 10)
    finally:
        stop(*procs.values())


def test_mismatched_page_size_is_a_sentence_not_a_hang(chat_model):
    procs, urls = start_pd(chat_model, 1, router_extra=ROUTER, reference=False,
                           decode_page_size=32)
    try:
        r = post(urls["router"], "hello", timeout=60)
        assert r.status_code >= 500
        assert "start both with the same --page-size" in r.text, r.text
        wait_pages_free(urls["decode"], 10)
    finally:
        stop(*procs.values())


@pytest.mark.parametrize("flag,value,needle", [
    ("--page-size", "32", "start both with the same --page-size"),
    ("--dtype", "bfloat16", "start both with the same --dtype")])
def test_mismatch_is_a_start_up_sentence(chat_model, tmp_path, flag, value, needle):
    """--disaggregation-prefill-bootstrap: the decode checks the pairing before it serves."""
    from test_pd_router import free_port
    bport = free_port()
    prefill, url = spawn_server(chat_model, "--disaggregation-mode", "prefill",
                                "--disaggregation-bootstrap-port", str(bport))
    try:
        wait_healthy(prefill, url)
        log = tmp_path / "decode.log"
        with open(log, "w") as f:
            decode, _ = spawn_server(chat_model, "--disaggregation-mode", "decode",
                                     "--disaggregation-prefill-bootstrap", f"127.0.0.1:{bport}",
                                     flag, value, log=f)
            code = decode.wait(120)
        out = log.read_text()
        assert code != 0 and needle in out and "Traceback" not in out, out
    finally:
        stop(prefill)
