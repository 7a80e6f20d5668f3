"""A real `pipefill serve` (tiny model, --pp-size 2) on a free port, driven over HTTP: the official
openai client, concurrency, bad input, disconnects, /metrics, SIGTERM."""
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import save_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Llama that carries the default model's tokenizer and chat template."""
    from pipefill.model.loader import WeightSource, resolve_model_path
    from pipefill.model.tokenizer import load_tokenizer
    path = save_tiny_model("llama", tmp_path_factory.mktemp("chat"), vocab_size=49152,
                           max_position_embeddings=4096)
    tok = load_tokenizer(WeightSource(resolve_model_path(None)))
    tok.hf.save_pretrained(path)
    return path


def spawn_serve(*args, port: int | None = None):
    """`pipefill serve ARGS --port PORT` (a free port unless given) in a subprocess, as a user
    types it; (the process, its URL) at once, while it starts."""
    from pipefill.base.platform import free_port
    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipefill.cli.main", "serve", *args, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def launch_serve(*args, port: int | None = None, startup_s: float = 120):
    """spawn_serve, then (the process, its URL) once /health answers 200."""
    proc, url = spawn_serve(*args, port=port)
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"server did not become healthy in {startup_s:.0f} s")


TINY_FLAGS = ("--pp-size", "2", "--dtype", "float32", "--page-size", "16",
              "--chunked-prefill-size", "64", "--threads-per-stage", "1")


def start_server(model, port, *extra, startup_s: float = 120):
    """The tiny model's server: two float32 stages, small pages and chunks, one thread each."""
    return launch_serve("--model-path", model, *TINY_FLAGS, *extra, port=port,
                        startup_s=startup_s)


def stop_server(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def server(chat_model):
    proc, url = start_server(chat_model, None, "--api-key", "sk-test")
    yield url
    assert stop_server(proc) == 0


def client(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)


AUTH = {"Authorization": "Bearer sk-test"}


def test_openai_client_completions(server):
    c = client(server)
    model = c.models.list().data[0].id
    out = c.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                               temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens == 12 or out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens > 0
    stream = c.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                  temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_openai_client_chat(server):
    c = client(server)
    msgs = [{"role": "user", "content": "Say hello."}]
    out = c.chat.completions.create(model=c.models.list().data[0].id, messages=msgs,
                                    max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model=out.model, messages=msgs, max_tokens=10,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_stop_strings_logprobs_and_echo(server):
    c = client(server)
    ids = list(range(1000, 1040))
    full = c.completions.create(model=None, prompt=ids, max_tokens=20, temperature=0,
                                extra_body={"ignore_eos": True})
    text = full.choices[0].text
    cut = text[3:6]
    stopped = c.completions.create(prompt=ids, max_tokens=20, temperature=0, stop=[cut],
                                   model=None, extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.index(cut)]
    lp = c.completions.create(prompt=ids, max_tokens=5, temperature=0, logprobs=3, echo=True,
                              model=None, extra_body={"ignore_eos": True})
    choice = lp.choices[0]
    assert len(choice.logprobs.tokens) == len(ids) + 5
    assert choice.logprobs.token_logprobs[0] is None
    assert all(x <= 0 for x in choice.logprobs.token_logprobs[1:])
    assert all(len(t) == 3 for t in choice.logprobs.top_logprobs[len(ids):])


def generate(url, prompt):
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120, json={
        "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def test_concurrent_clients_equal_serial(server):
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + 20 + 13 * i)) for i in range(16)]
    serial = [generate(server, p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: generate(server, p), prompts))
    assert together == serial


BAD = [
    ("not json", 400, "not valid JSON"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"max_tokens": 5}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    ({"prompt": "x", "max_tokens": 5000}, 400, "exceeds --max-model-len (4096)"),
    ({"prompt": "x", "model": "gpt-9"}, 400, "not served here"),
    ({"prompt": "x", "n": 2}, 400, "n = 2 is not supported"),
    ({"prompt": [1, 2, 99999999]}, 400, "outside the vocabulary"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
]


@pytest.mark.parametrize("body, status, message", BAD)
def test_bad_input(server, body, status, message):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server + "/v1/completions", headers=AUTH, content=content, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error"
    assert httpx.get(server + "/health").status_code == 200


def test_prompt_plus_max_tokens_names_both_numbers(server):
    r = httpx.post(server + "/v1/completions", headers=AUTH, timeout=30,
                   json={"prompt": list(range(100, 4000)), "max_tokens": 500})
    assert r.status_code == 400
    assert "3900 tokens" in r.text and "500" in r.text and "4096" in r.text


def test_api_key_required(server):
    r = httpx.post(server + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server + "/health").status_code == 200  # health needs no key


def metric(url, name):
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def test_metrics_parse(server):
    from prometheus_client.parser import text_string_to_metric_families
    generate(server, [5, 6, 7])
    names = {f.name for f in text_string_to_metric_families(httpx.get(server + "/metrics").text)}
    for n in ("pipefill_requests", "pipefill_time_to_first_token_seconds",
              "pipefill_time_per_output_token_seconds", "pipefill_e2e_request_latency_seconds",
              "pipefill_prompt_tokens", "pipefill_generation_tokens",
              "pipefill_prefill_chunk_size_tokens", "pipefill_requests_running",
              "pipefill_requests_waiting", "pipefill_kv_pages_used", "pipefill_kv_pages_free"):
        assert n in names
    assert metric(server, "pipefill_requests_total") >= 1


def test_disconnect_frees_pages(server):
    body = {"prompt": list(range(200, 600)), "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", headers=AUTH, json=body,
                      timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        deadline = time.monotonic() + 5  # /metrics shows stage 0's pushed snapshots
        while metric(server, "pipefill_kv_pages_used") == 0:
            assert time.monotonic() < deadline, "the running request holds no pages"
            next(lines)
    deadline = time.monotonic() + 15
    while metric(server, "pipefill_kv_pages_used") > 0 or \
            metric(server, "pipefill_requests_running") > 0:
        assert time.monotonic() < deadline, "pages were not returned after the disconnect"
        time.sleep(0.2)
    assert metric(server, "pipefill_kv_pages_free") > 0


def stage_pids(server_pid):
    out = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_sigterm_with_a_request_in_flight(chat_model):
    proc, url = start_server(chat_model, None, "--shutdown-timeout", "2")
    pids = stage_pids(proc.pid)
    assert len(pids) == 2
    body = {"prompt": list(range(200, 300)), "max_tokens": 3900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        proc.send_signal(signal.SIGTERM)
        rest = [x for x in lines if x]  # the server finishes or fails it, closes the stream
    assert proc.wait(30) == 0
    events = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
    assert rest[-1] == "data: [DONE]"
    assert "error" in events[-1] or events[-1]["choices"][0]["finish_reason"]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sigterm_while_the_stages_load(chat_model):
    """Stopped before it is ready: the stages stopped, exit 0, no error printed."""
    proc, url = spawn_serve("--model-path", chat_model, *TINY_FLAGS)
    deadline = time.monotonic() + 120
    while True:  # the HTTP side answers while the two stages still load
        assert proc.poll() is None and time.monotonic() < deadline
        try:
            health = httpx.get(url + "/health", timeout=1)
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        pids = stage_pids(proc.pid)
        if len(pids) == 2:
            break
    assert health.json()["status"] == "loading"
    proc.send_signal(signal.SIGTERM)
    try:
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0 and "error" not in out.lower(), out
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
