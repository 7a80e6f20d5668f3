"""PD disaggregation with a decode pipeline (decode PP 2), real processes behind the unmodified
sglang-router: every decode stage receives its own layers' KV from the prefill stages that
hold them, and decodes only once every stage has all of them. Greedy text and logprobs must be
one colocated server's; pages come back on both sides. Fault cases are slow."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from test_pd_router import (PROMPTS, chat_model, client, completion, free_port,  # noqa: F401
                            metric, request_pages, spawn_router, spawn_server, stop,
                            wait_healthy, wait_pages_free)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def start_pd_pp(model: str, *extra: str, decode_extra=(), router_extra=(), reference=True):
    """Prefill PP 2 + decode PP 2 (+ a colocated PP 1 reference) + the router."""
    bport = free_port()
    procs, urls = {}, {}
    procs["prefill"], urls["prefill"] = spawn_server(
        model, "--pp-size", "2", "--disaggregation-mode", "prefill",
        "--disaggregation-bootstrap-port", str(bport), *extra)
    procs["decode"], urls["decode"] = spawn_server(
        model, "--pp-size", "2", "--disaggregation-mode", "decode", *extra, *decode_extra)
    if reference:
        procs["ref"], urls["ref"] = spawn_server(model, *extra)
    try:
        for name in list(procs):
            wait_healthy(procs[name], urls[name])
        procs["router"], urls["router"] = spawn_router(urls["prefill"], bport, urls["decode"],
                                                       *router_extra)
        wait_healthy(procs["router"], urls["router"], "/readiness", 60)
        urls["bootstrap_port"] = bport
    except BaseException:
        stop(*procs.values())
        raise
    return procs, urls


def assert_same(got, want) -> None:
    assert got[0] == want[0] and len(got[1]) == len(want[1])
    assert got[1] == pytest.approx(want[1], abs=1e-4)
    for a, b in zip(got[2], want[2]):
        assert a.keys() == b.keys()
        assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)


@pytest.mark.parametrize("partition", [
    (),  # the prefill's layer split: decode stage s takes its layers from prefill stage s
    ("--pp-layer-partition", "1,3")])  # decode stage 1 takes layers from both prefill stages
def test_decode_pipeline_answers_equal_a_colocated_server(chat_model, partition):
    procs, urls = start_pd_pp(chat_model, decode_extra=partition, reference=not partition)
    try:
        router = client(urls["router"])
        ref = client(urls.get("ref", urls["router"]))
        prompts = PROMPTS if not partition else PROMPTS[:2]
        want = [completion(ref, p) for p in prompts] if not partition else None
        hits = metric(urls["prefill"], "pipefill_cache_hit_tokens")
        for i, prompt in enumerate(prompts):
            got = completion(router, prompt)
            if want is not None:
                assert_same(got, want[i])
                assert completion(router, prompt, stream=True) == want[i][0]
            else:  # the same answer as the even split's (checked against the reference)
                assert completion(router, prompt, stream=True) == got[0]
        if not partition:  # PROMPTS[2] shares 9 whole pages with PROMPTS[1] on the prefill
            assert metric(urls["prefill"], "pipefill_cache_hit_tokens") > hits
        # Every page a transfer held is back, on both sides (the prefix caches keep theirs);
        # a later decode stage replays stage 0's page decisions and checks every micro-batch
        # against them, so a page it lost track of would have failed a request above.
        wait_pages_free(urls["prefill"], 10)
        wait_pages_free(urls["decode"], 10)
        assert httpx.get(urls["decode"] + "/health", timeout=5).status_code == 200
    finally:
        stop(*procs.values())


FAULTS = ("--disable-radix-cache", "--chunked-prefill-size", "16",
          "--disaggregation-heartbeat-interval", "0.5",
          "--disaggregation-waiting-timeout", "8", "--disaggregation-bootstrap-timeout", "4")
LONG = "word " * 2500  # ~160 chunks of 16 on the prefill


@pytest.mark.slow
def test_decode_stage_1_killed_mid_transfer(chat_model):
    """The decode's stage 1 dies while the KV streams in: the prefill frees every page of the
    room, the decode fails the request fast (no waiting timeout), restarts its stages and
    serves the next request through the same router."""
    procs, urls = start_pd_pp(chat_model, *FAULTS, router_extra=("--disable-circuit-breaker",),
                              reference=False)
    try:
        want = httpx.post(urls["router"] + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": "A short one", "max_tokens": 8, "temperature": 0})
        assert want.status_code == 200, want.text
        import threading
        box = {}

        def call():
            box["r"] = httpx.post(urls["decode"] + "/v1/completions", timeout=120, json={
                "model": "m", "prompt": LONG, "max_tokens": 8, "temperature": 0,
                "bootstrap_room": 4242, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": urls["bootstrap_port"]})
        # The decode's request alone: the prefill's part goes straight to the prefill server.
        t = threading.Thread(target=call, daemon=True)
        t.start()
        p = threading.Thread(target=lambda: httpx.post(
            urls["prefill"] + "/v1/completions", timeout=120, json={
                "model": "m", "prompt": LONG, "max_tokens": 8, "temperature": 0,
                "bootstrap_room": 4242, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": urls["bootstrap_port"]}), daemon=True)
        deadline = time.monotonic() + 60
        while request_pages(urls["decode"]) == 0:
            assert time.monotonic() < deadline, "the decode never admitted the request"
            time.sleep(0.02)
        p.start()
        deadline = time.monotonic() + 60
        while request_pages(urls["prefill"]) == 0:
            assert time.monotonic() < deadline, "the prefill never started"
            time.sleep(0.02)
        stages = subprocess.run(["pgrep", "-P", str(procs["decode"].pid)], capture_output=True,
                                text=True).stdout.split()
        t0 = time.monotonic()
        os.kill(int(stages[-1]), signal.SIGKILL)  # the decode's stage 1
        t.join(60)
        assert time.monotonic() - t0 < 8, "the decode waited for its timeout"
        assert box["r"].status_code >= 500, box["r"].text
        wait_pages_free(urls["prefill"], 10)
        wait_healthy(procs["decode"], urls["decode"], timeout_s=120)
        again = httpx.post(urls["router"] + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": "A short one", "max_tokens": 8, "temperature": 0})
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == \
            want.json()["choices"][0]["text"], again.text
        wait_pages_free(urls["prefill"], 10)
        wait_pages_free(urls["decode"], 10)
    finally:
        stop(*procs.values())
