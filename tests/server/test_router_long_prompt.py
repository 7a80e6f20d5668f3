"""A 32K-token prompt through `pipefill serve` directly and through the unmodified sglang-router
(one worker, plain mode), streamed and not, with the router flags README's 'Long prompts behind
a router' gives: both answer, with the same greedy text."""
import random
import subprocess
import sys

import httpx
import pytest

from pipefill.base.platform import free_port
from pipefill.bench.serving import text_prompts
from test_pd_router import stop, wait_healthy
from test_server import start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

LONG = 32768
# What a long prefill needs from the router (README, 'Long prompts behind a router').
ROUTER_FLAGS = ["--request-timeout-secs", "7200", "--disable-retries",
                "--queue-timeout-secs", "7200"]


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer (the router takes text) and
    room for the long prompt."""
    from conftest import save_tiny_model
    from pipefill.model.loader import WeightSource, resolve_model_path
    from pipefill.model.tokenizer import load_tokenizer
    path = save_tiny_model("llama", tmp_path_factory.mktemp("long"), vocab_size=49152,
                           max_position_embeddings=LONG + 1024)
    load_tokenizer(WeightSource(resolve_model_path(None))).hf.save_pretrained(path)
    return path


def spawn_router(worker: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", worker,
         "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
         *ROUTER_FLAGS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def complete(url: str, prompt: str, stream: bool) -> tuple[str, int | None]:
    """(text, prompt tokens the server counted) of a greedy 4-token completion."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=3600)
        assert r.status_code == 200, r.text[:300]
        out = r.json()
        return out["choices"][0]["text"], out["usage"]["prompt_tokens"]
    import json
    body["stream_options"] = {"include_usage": True}
    text, usage = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        assert r.status_code == 200, r.read()[:300]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                assert "error" not in data, data
                text += [c["text"] for c in data["choices"]]
                usage = data.get("usage") or usage
    return "".join(text), usage and usage["prompt_tokens"]


def test_a_32k_prompt_through_the_server_and_the_router(long_model):
    prompt = text_prompts(None).make(LONG, random.Random(0))
    proc, url = start_server(long_model, None, "--served-model-name", "m",
                             "--max-model-len", str(LONG + 64), "--chunked-prefill-size",
                             "8192", "--page-size", "64", "--disable-radix-cache",
                             startup_s=600)
    router = None
    try:
        router, router_url = spawn_router(url)
        wait_healthy(router, router_url, "/readiness", 120)
        answers = {(via, stream): complete(u, prompt, stream)
                   for via, u in (("server", url), ("router", router_url))
                   for stream in (False, True)}
    finally:
        if router is not None:
            stop(router)
        assert stop_server(proc) == 0
    texts = {text for text, _ in answers.values()}
    assert len(texts) == 1 and texts.pop(), answers   # greedy: one answer, not empty
    for via_stream, (_, n) in answers.items():
        assert abs(n - LONG) <= 8, (via_stream, n)      # the whole prompt reached the server
