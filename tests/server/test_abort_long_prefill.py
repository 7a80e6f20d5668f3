"""A client that leaves during a long prefill, through a real `pipefill serve --pp-size 2`: the
stages run no chunk of it that stage 0 had not launched when the abort came (only the micro-
batches already in flight finish, on every stage), its pages go back, and with the prefix
cache the chunks it computed serve a retry of the same prompt."""
import json
import time

import httpx
import pytest

from conftest import save_tiny_model
from test_server import start_server, stop_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHUNK = 256
NUM_CHUNKS = 16
PROMPT = [3 + (7 * i) % 500 for i in range(CHUNK * NUM_CHUNKS)]
MAX_INFLIGHT = 2 + 1  # --pp-size 2 + the default --pp-async-batch-depth 1


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """Wide enough that a 256-token chunk takes a while on one thread (the abort must land
    mid-prefill), still small to save and load."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("wide"), hidden_size=512,
                           intermediate_size=2048, num_attention_heads=8,
                           num_key_value_heads=4, max_position_embeddings=8192)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def leave_after_two_chunks(url: str) -> int:
    """Streams the prompt, closes the connection once a progress comment says two chunks are
    on their way; the prompt tokens scheduled by then."""
    body = {"prompt": PROMPT, "max_tokens": 1, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            assert not line.startswith("data: {"), "the prefill ended before the client left"
            if line.startswith(": prefill "):
                done = int(line.split()[2].split("/")[0])
                if done >= 2 * CHUNK:
                    break
    return done


def forwards_by_stage(trace_dir) -> dict[int, list[dict]]:
    """The trace's forward spans that computed the first request's tokens, per stage."""
    with open(trace_dir / "serve.json") as f:
        spans = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "forward"]
    first = min(spans, key=lambda e: e["ts"])["args"]["label"].split("[")[0]
    out: dict[int, list[dict]] = {}
    for e in spans:
        if any(part.split("[")[0] == first for part in e["args"]["label"].split()):
            out.setdefault(e["tid"], []).append(e)
    return out


def test_a_client_leaving_a_long_prefill_stops_it_and_its_chunks_stay_cached(wide_model,
                                                                              tmp_path):
    proc, url = start_server(wide_model, None, "--chunked-prefill-size", str(CHUNK),
                             "--max-model-len", str(len(PROMPT) + 64),
                             "--log-prefill-progress-interval", "0.02",
                             "--trace-dir", str(tmp_path), startup_s=300)
    try:
        done_at_close = leave_after_two_chunks(url)
        deadline = time.monotonic() + 60
        while metric(url, "pipefill_kv_pages_used") > 0 or \
                metric(url, "pipefill_requests_running") > 0:
            assert time.monotonic() < deadline, "pages were not returned after the client left"
            time.sleep(0.05)
        # The retry reuses the whole pages of the chunks the aborted request computed.
        retry = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                           timeout=300).json()
        cached = retry["usage"]["prompt_tokens_details"]["cached_tokens"]
    finally:
        assert stop_server(proc) == 0
    forwards = forwards_by_stage(tmp_path)
    assert sorted(forwards) == [0, 1]
    launched = len(forwards[0])
    # Every stage ran exactly the chunks stage 0 launched: what was in flight finished, no
    # stage started a chunk stage 0 had dropped.
    assert len(forwards[1]) == launched
    # Stage 0 launched no more than what was on its way when the client left (the progress
    # report lags by up to a load report, ~1 chunk), plus the slots in flight and the chunk
    # it was computing when the abort came: far from all of them.
    assert launched <= done_at_close // CHUNK + MAX_INFLIGHT + 2 < NUM_CHUNKS, \
        (launched, done_at_close)
    # The chunks it computed stay in the prefix cache: the retry starts after them.
    assert CHUNK <= cached <= launched * CHUNK, (cached, launched)
