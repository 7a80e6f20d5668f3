"""PD disaggregation through the unmodified sglang-router (PD mode), real processes: a prefill
server (PP 2), a decode server (PP 1; one test pairs the prefill with a decode PP 2 as well), the
router, and a colocated server as the reference; the official openai client. Fault tests are in
test_pd_faults.py and test_pd_decode_pp.py (slow)."""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from pipefill.disagg.launch import gives_secret, write_secret_file

COMMON = ["--dtype", "float32", "--chunked-prefill-size", "64", "--threads-per-stage", "1",
          "--served-model-name", "m"]


def free_port() -> int:
    from pipefill.base.platform import free_port as fp
    return fp()


_SECRET_FILE: list[str] = []


def pd_secret_file() -> str:
    """One cluster secret file for every PD server these tests start (as serve-pd makes it:
    0600 in a private folder), removed when the test process exits."""
    if not _SECRET_FILE:
        folder = tempfile.mkdtemp(prefix="pipefill-test-pd-")
        atexit.register(shutil.rmtree, folder, True)
        _SECRET_FILE.append(write_secret_file(folder))
    return _SECRET_FILE[0]


def secret_flags(extra) -> list[str]:
    """A PD server's --cluster-secret-file, unless its flags settle authentication."""
    if "--disaggregation-mode" not in extra or gives_secret(list(extra)):
        return []
    return ["--cluster-secret-file", pd_secret_file()]


def spawn_server(model: str, *extra: str, page_size: int = 16, log=None,
                 port: int | None = None) -> tuple[subprocess.Popen, str]:
    """Starts `pipefill serve` (not waiting for it); (process, URL). PD servers share one
    cluster secret."""
    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipefill.cli.main", "serve", "--model-path", model, "--port",
         str(port), "--page-size", str(page_size), *COMMON, *extra, *secret_flags(extra)],
        stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, path: str = "/health",
                 timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited with code {proc.returncode}"
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url}{path} did not turn healthy within {timeout_s} s")


def spawn_router(prefill_url: str, bootstrap_port: int, decode_url: str,
                 *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
         "--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url,
         "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(free_port()), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all labels)."""
    total, found = 0.0, False
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total


def request_pages(url: str) -> float:
    """KV pages held by requests (the gauge leaves out cache pages nobody holds)."""
    return metric(url, "pipefill_kv_pages_used")


def wait_pages_free(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while request_pages(url) > 0 or metric(url, "pipefill_requests_running") > 0:
        assert time.monotonic() < deadline, \
            f"{url} still holds {request_pages(url)} request pages after {timeout_s} s"
        time.sleep(0.2)


def client(url: str):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


# ---------------------------------------------------------------- the tests

import concurrent.futures  # noqa: E402

import pytest  # noqa: E402

from conftest import save_tiny_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer and chat template."""
    from pipefill.model.loader import WeightSource, resolve_model_path
    from pipefill.model.tokenizer import load_tokenizer
    path = save_tiny_model("llama", tmp_path_factory.mktemp("pd"), vocab_size=49152,
                           max_position_embeddings=4096)
    load_tokenizer(WeightSource(resolve_model_path(None))).hf.save_pretrained(path)
    return path


def start_pd(model: str, prefill_pp: int = 2, *extra: str, router_extra=(), reference=True,
             decode_page_size: int = 16):
    """Prefill (PP prefill_pp) + decode (PP 1) [+ a colocated reference] + the router:
    a dict of processes and URLs."""
    bport = free_port()
    procs, urls = {}, {}
    procs["prefill"], urls["prefill"] = spawn_server(
        model, "--pp-size", str(prefill_pp), "--disaggregation-mode", "prefill",
        "--disaggregation-bootstrap-port", str(bport), *extra)
    procs["decode"], urls["decode"] = spawn_server(model, "--disaggregation-mode", "decode",
                                                   *extra, page_size=decode_page_size)
    if reference:
        procs["ref"], urls["ref"] = spawn_server(model, *extra)
    for name in procs:
        wait_healthy(procs[name], urls[name])
    procs["router"], urls["router"] = spawn_router(urls["prefill"], bport, urls["decode"],
                                                   *router_extra)
    wait_healthy(procs["router"], urls["router"], "/readiness", 60)
    urls["bootstrap_port"] = bport
    return procs, urls


@pytest.fixture(scope="module")
def pd(chat_model):
    procs, urls = start_pd(chat_model)
    yield urls
    stop(*procs.values())


PROMPTS = ["The capital of France is",
           "word " * 150,  # three chunks of 64 on the prefill
           "word " * 150 + "and more",  # its first 9 pages come from the prefill's cache
           "Hello there, how are you today? " * 5]


def completion(c, prompt: str, stream: bool = False, max_tokens: int = 12):
    if stream:
        chunks = c.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, stream=True)
        return "".join(ch.choices[0].text for ch in chunks if ch.choices)
    out = c.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                               logprobs=3)
    lp = out.choices[0].logprobs
    return out.choices[0].text, lp.token_logprobs, lp.top_logprobs


def test_completions_through_the_router_equal_a_colocated_server(pd):
    """Greedy text and every logprob (the first token's comes from the prefill) are the
    colocated server's, streamed or not; multi-chunk prompts and prefix-cache hits too."""
    router, ref = client(pd["router"]), client(pd["ref"])
    for prompt in PROMPTS:
        got, want = completion(router, prompt), completion(ref, prompt)
        assert got[0] == want[0] and len(got[1]) == 12
        assert got[1] == pytest.approx(want[1], abs=1e-4)
        for a, b in zip(got[2], want[2]):
            assert a.keys() == b.keys()
            assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
        assert completion(router, prompt, stream=True) == want[0]


def test_chat_through_the_router_equals_a_colocated_server(pd):
    router, ref = client(pd["router"]), client(pd["ref"])
    msgs = [{"role": "user", "content": "Say hello."}]
    want = ref.chat.completions.create(model="m", messages=msgs, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=2)
    got = router.chat.completions.create(model="m", messages=msgs, max_tokens=10,
                                         temperature=0, logprobs=True, top_logprobs=2)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert [t.logprob for t in got.choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in want.choices[0].logprobs.content], abs=1e-4)
    # No model: the router sends "unknown", which a PD server takes for its own.
    r = httpx.post(pd["router"] + "/v1/chat/completions", timeout=60,
                   json={"messages": msgs, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want.choices[0].message.content
    chunks = router.chat.completions.create(model="m", messages=msgs, max_tokens=10,
                                            temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want.choices[0].message.content


def test_eight_concurrent_clients(pd):
    prompts = [f"number {i} " * (10 + 9 * i) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda p: completion(client(pd["router"]), p, max_tokens=8)[0],
                          prompts))
    want = [completion(client(pd["ref"]), p, max_tokens=8)[0] for p in prompts]
    assert got == want
    # Every page a transfer held is back, on both sides (the prefix caches keep theirs).
    wait_pages_free(pd["prefill"], 10)
    wait_pages_free(pd["decode"], 10)


def test_seeded_sampling_continues_the_prefills_draw(pd):
    """Sampling with a seed: the decode continues the prefill's random sequence, so the
    answer is the colocated server's."""
    kw = dict(model="m", prompt="Once upon a time", max_tokens=10, temperature=0.9, seed=7)
    got = client(pd["router"]).completions.create(**kw).choices[0].text
    assert got == client(pd["ref"]).completions.create(**kw).choices[0].text


def test_client_gone_while_the_decode_waits_for_kv_frees_its_pages(pd):
    """A request whose prefill part never comes (no prefill request for its room): the client
    gives up, the decode drops the room and frees the pages it pre-allocated."""
    body = {"model": "m", "prompt": "word " * 100, "max_tokens": 4, "bootstrap_room": 12345,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": pd["bootstrap_port"]}
    import threading
    errors = []

    def call():
        try:
            httpx.post(pd["decode"] + "/v1/completions", json=body,
                       timeout=httpx.Timeout(30, read=4))
        except httpx.TimeoutException as e:
            errors.append(e)
    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 4
    while request_pages(pd["decode"]) == 0:  # admitted: its prompt's pages wait for the KV
        assert time.monotonic() < deadline, "the decode never pre-allocated the pages"
        time.sleep(0.05)
    t.join(30)
    assert errors, "the decode answered a request whose KV never came"
    wait_pages_free(pd["decode"], 10)
    wait_pages_free(pd["prefill"], 10)


@pytest.mark.parametrize("extra,needle", [
    ({}, "send requests through the PD router"),
    ({"bootstrap_room": [1, 2], "bootstrap_host": ["h", "h"], "bootstrap_port": [1, 1]},
     "batched PD requests"),
    ({"bootstrap_room": 5, "bootstrap_host": "127.0.0.1", "bootstrap_port": None},
     "bootstrap_port"),
    ({"bootstrap_room": 5, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "echo": True,
      "logprobs": 1}, "echo with logprobs")])
def test_pd_servers_refuse_requests_the_router_did_not_shape(pd, extra, needle):
    for role in ("prefill", "decode"):
        r = httpx.post(pd[role] + "/v1/completions", timeout=30,
                       json={"prompt": "hi", "max_tokens": 2, **extra})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


@pytest.mark.slow
def test_mooncake_transport_through_the_router(chat_model):
    """The same answers with Mooncake's transfer engine (one-sided writes) moving the KV."""
    procs, urls = start_pd(chat_model, 2, "--disaggregation-transfer-backend", "mooncake")
    try:
        router, ref = client(urls["router"]), client(urls["ref"])
        for prompt in PROMPTS[:2]:
            got, want = completion(router, prompt), completion(ref, prompt)
            assert got[0] == want[0]
            assert got[1] == pytest.approx(want[1], abs=1e-4)
        wait_pages_free(urls["prefill"], 10)
        wait_pages_free(urls["decode"], 10)
    finally:
        stop(*procs.values())


def test_decode_pipeline_pp2_equals_a_colocated_server(pd, chat_model):
    """Decode PP 2 behind its own router, paired with the same prefill (PP 2): every decode
    stage receives its own layers' KV; greedy text and logprobs are the colocated server's,
    streamed or not, with prefix-cache hits on the prefill; pages come back on both sides (a
    later decode stage replays stage 0's page decisions and checks every micro-batch, so a
    page it lost track of fails a request). More in test_pd_decode_pp.py (slow)."""
    decode, decode_url = spawn_server(chat_model, "--pp-size", "2",
                                      "--disaggregation-mode", "decode")
    router = None
    try:
        wait_healthy(decode, decode_url)
        router, router_url = spawn_router(pd["prefill"], pd["bootstrap_port"], decode_url)
        wait_healthy(router, router_url, "/readiness", 60)
        hits = metric(pd["prefill"], "pipefill_cache_hit_tokens")
        for prompt in PROMPTS:
            want = completion(client(pd["ref"]), prompt)
            got = completion(client(router_url), prompt)
            assert got[0] == want[0] and len(got[1]) == 12
            assert got[1] == pytest.approx(want[1], abs=1e-4)
            for a, b in zip(got[2], want[2]):
                assert a.keys() == b.keys()
                assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
            assert completion(client(router_url), prompt, stream=True) == want[0]
        assert metric(pd["prefill"], "pipefill_cache_hit_tokens") > hits
        wait_pages_free(pd["prefill"], 10)
        wait_pages_free(decode_url, 10)
    finally:
        stop(*[p for p in (router, decode) if p is not None])
