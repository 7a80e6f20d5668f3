"""PD disaggregation with a decode pipeline (decode PP 2), real processes behind the unmodified
sglang-router: every decode stage receives its own layers' KV from the prefill stages that
hold them, and decodes only once every stage has all of them. Greedy text and logprobs must be
one colocated server's; pages come back on both sides. The fast case (the prefill's layer
split) is in test_pd_router.py; here: the room bookkeeping, another split and a fault (slow)."""
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


def test_pipeline_room_is_ready_only_when_every_stage_has_its_layers():
    from pipefill.disagg.decode_rooms import DecodePipelineRooms
    rooms = DecodePipelineRooms(3)
    rooms.open(7)
    assert rooms.ready(7, 2) == set() and rooms.ready(7, 0) == set()
    assert rooms.ready(7, 1) == {"ready"} and 7 not in rooms.live
    assert rooms.ready(7, 1) == set()  # a late report of an ended room is ignored


def test_pipeline_room_fails_once_and_releases_when_no_stage_can_write():
    from pipefill.disagg.decode_rooms import DecodePipelineRooms
    rooms = DecodePipelineRooms(3)
    rooms.open(7)
    assert rooms.ready(7, 1) == set()  # stage 1 is done: its pages are no longer written
    assert rooms.fail(7) == {"fail"}  # stage 2 failed: the request fails at once...
    assert rooms.fail(7) == set()  # ...once
    assert rooms.released(7, 2) == set()  # ...but stage 0 may still write the pages
    assert rooms.ready(7, 0) == {"release"}  # a stage that finished anyway lets go too
    assert 7 not in rooms.live


def test_pipeline_room_aborted_before_any_stage_answered():
    from pipefill.disagg.decode_rooms import DecodePipelineRooms
    rooms = DecodePipelineRooms(2)
    rooms.open(9)
    assert rooms.fail(9) == {"fail"}
    assert rooms.released(9, 1) == set()
    assert rooms.released(9, 0) == {"release"}
    assert rooms.released(9, 0) == set() and rooms.fail(9) == set()


@pytest.mark.slow
def test_decode_pipeline_with_another_layer_split(chat_model):
    """Decode layers split 1,3 against the prefill's 2,2: decode stage 1 takes layer 1 from
    prefill stage 0 and layers 2-3 from prefill stage 1 (prefill stage 0 sends to both)."""
    procs, urls = start_pd_pp(chat_model, decode_extra=("--pp-layer-partition", "1,3"))
    try:
        router, ref = client(urls["router"]), client(urls["ref"])
        for prompt in PROMPTS[:3]:
            want = completion(ref, prompt)
            assert_same(completion(router, prompt), want)
            assert completion(router, prompt, stream=True) == want[0]
        wait_pages_free(urls["prefill"], 10)
        wait_pages_free(urls["decode"], 10)
    finally:
        stop(*procs.values())


FAULTS = ("--disable-radix-cache", "--chunked-prefill-size", "16",
          "--disaggregation-heartbeat-interval", "0.5",
          "--disaggregation-waiting-timeout", "8", "--disaggregation-bootstrap-timeout", "4")
LONG = "word " * 2500  # ~160 chunks of 16 on the prefill


def post(url: str, prompt: str, **pd_fields) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, **pd_fields})


def one_room_in_flight(urls: dict, room: int, prefill: bool = True) -> dict:
    """Sends the decode's (and, with `prefill`, the prefill's) part of one room of LONG
    straight to each server (no router, so no retry hides the decode's own answer) and returns
    once the decode waits for the KV (and the prefill is sending it); box["r"] gets the
    decode's response."""
    import threading
    fields = dict(bootstrap_room=room, bootstrap_host="127.0.0.1",
                  bootstrap_port=urls["bootstrap_port"])
    box: dict = {}
    threading.Thread(target=lambda: box.setdefault("r", post(urls["decode"], LONG, **fields)),
                     daemon=True).start()
    wait_until(lambda: request_pages(urls["decode"]) > 0, "the decode never admitted it")
    if not prefill:
        return box
    threading.Thread(target=lambda: box.setdefault("p", _catch(post, urls["prefill"], LONG,
                                                                **fields)), daemon=True).start()
    wait_until(lambda: request_pages(urls["prefill"]) > 0, "the prefill never started")
    return box


def _catch(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except httpx.HTTPError as e:
        return e


def wait_until(cond, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def stage_pids(proc) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                          text=True).stdout.split()


@pytest.mark.slow
def test_decode_stage_1_killed_mid_transfer(chat_model):
    """The decode's stage 1 dies while the KV streams in: the prefill frees every page of the
    room, the decode fails the request fast (not after its waiting timeout), restarts its
    stages and serves the next request through the same router."""
    procs, urls = start_pd_pp(chat_model, *FAULTS, router_extra=("--disable-circuit-breaker",),
                              reference=False)
    try:
        want = post(urls["router"], "A short one")
        assert want.status_code == 200, want.text
        box = one_room_in_flight(urls, 4242)
        t0 = time.monotonic()
        os.kill(int(stage_pids(procs["decode"])[-1]), signal.SIGKILL)  # the decode's stage 1
        wait_until(lambda: "r" in box, "the decode did not answer")
        assert time.monotonic() - t0 < 8, "the decode waited for its timeout"
        assert box["r"].status_code >= 500, box["r"].text
        wait_pages_free(urls["prefill"], 10)
        wait_healthy(procs["decode"], urls["decode"], timeout_s=120)
        again = post(urls["router"], "A short one")
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        wait_pages_free(urls["prefill"], 10)
        wait_pages_free(urls["decode"], 10)
    finally:
        stop(*procs.values())


@pytest.mark.slow
def test_prefill_stage_1_killed_fails_the_room_on_every_decode_stage(chat_model):
    """The prefill's stage 1 dies while the decode's stages wait for a room's KV (the
    prefill's part is not sent, so the room cannot complete first): decode stage 1 loses its
    only source, reports the failure to stage 0, which fails the request at once (a 5xx, not
    the waiting timeout) and drops the room on stage 0 too; every decode page comes back, the
    decode stays up (its stages never died) and serves the next request once the prefill
    restarted its stages."""
    procs, urls = start_pd_pp(chat_model, *FAULTS, router_extra=("--disable-circuit-breaker",),
                              reference=False)
    try:
        want = post(urls["router"], "A short one")
        assert want.status_code == 200, want.text
        box = one_room_in_flight(urls, 4343, prefill=False)
        time.sleep(0.5)  # decode stage 1 has asked prefill stage 1 for its layers by now
        decode_stages = stage_pids(procs["decode"])
        t0 = time.monotonic()
        os.kill(int(stage_pids(procs["prefill"])[-1]), signal.SIGKILL)  # the prefill's stage 1
        wait_until(lambda: "r" in box, "the decode did not answer")
        assert time.monotonic() - t0 < 8, "the decode waited for its timeout"
        assert box["r"].status_code >= 500, box["r"].text
        wait_pages_free(urls["decode"], 10)
        assert stage_pids(procs["decode"]) == decode_stages  # no restart on the decode
        wait_healthy(procs["prefill"], urls["prefill"], timeout_s=120)
        again = post(urls["router"], "A short one")
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        wait_pages_free(urls["prefill"], 10)
        wait_pages_free(urls["decode"], 10)
    finally:
        stop(*procs.values())
