"""Schemathesis against a real `pipefill serve`'s own /openapi.json: every route, cases that fit
the published request models (positive) and cases that break them (negative). No answer may
be a 5xx or hang; afterwards the server is healthy, runs nothing and holds no KV page, and a
request that needs the whole pool still runs.

Cheap by construction rather than by editing the schema: --max-model-len 128 bounds every
generation (max_tokens null means "up to the context"), and --max-total-tokens 128 makes the
pool exactly one full-length request, so a single leaked page shows as a request that cannot
be admitted."""
import json
import threading
import time
from collections import Counter

import httpx
import pytest

from test_server import chat_model, start_server, stop_server  # noqa: F401 - a fixture

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MAX_MODEL_LEN = 128
FAST_CASES = 15  # per route and mode: 30 a POST route in the default run
SLOW_CASES = 100  # 200 a POST route


def serve_small(model):
    """A server whose generations are cheap and whose log is read as it comes (a full pipe
    would block it); after the module, its log must hold no traceback."""
    proc, url = start_server(model, None, "--max-model-len", str(MAX_MODEL_LEN),
                             "--max-total-tokens", str(MAX_MODEL_LEN))
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    yield url
    assert stop_server(proc) == 0
    reader.join(10)
    assert not [line for line in log if "Traceback" in line], "".join(log[-200:])


@pytest.fixture(scope="module")
def server(chat_model):  # noqa: F811
    yield from serve_small(chat_model)


def metric(url, name):
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def assert_pages_back(url):
    """Healthy, nothing running or waiting, no page in use (/metrics shows stage 0's pushed
    snapshots, hence the wait), and a request of max-model-len tokens (every page of a pool
    that small) is admitted and finishes."""
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 15
    while (metric(url, "pipefill_requests_running"), metric(url, "pipefill_requests_waiting"),
           metric(url, "pipefill_kv_pages_used")) != (0, 0, 0):
        assert time.monotonic() < deadline, "requests or pages still held after the fuzzing"
        time.sleep(0.2)
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": list(range(100, 100 + MAX_MODEL_LEN - 1)), "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == MAX_MODEL_LEN, r.text


def fuzz(url: str, cases_per_mode: int) -> dict[str, Counter]:
    """Runs schemathesis's generated cases for every operation of the live schema; returns the
    status codes seen per operation. Fails on the first 5xx or timeout, with the case."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_dict(httpx.get(url + "/openapi.json").json())
    seen: dict[str, Counter] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        statuses = seen.setdefault(f"{op.method.upper()} {op.path}", Counter())
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=cases_per_mode, deadline=None, database=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            def call(case):
                response = case.call(base_url=url, timeout=60)  # a hang fails here
                statuses[response.status_code] += 1
                assert response.status_code < 500, (case.body, response.text)
                kind = {k.lower(): v[0] for k, v in response.headers.items()}.get("content-type")
                if (kind or "").startswith("text/event-stream"):
                    statuses["streamed"] += 1  # a stream's status is sent before it fails
                    assert_no_server_error_event(response.text, case.body)
            try:
                call()
            except Unsatisfiable:  # a route without parameters has no negative case
                assert mode == schemathesis.GenerationMode.NEGATIVE and op.method == "get"
    return seen


def assert_no_server_error_event(text: str, body) -> None:
    for line in text.splitlines():
        if line.startswith("data: {"):
            error = json.loads(line[6:]).get("error")
            assert error is None or error["code"] < 500, (body, error)


def check_fuzzed(url: str, cases_per_mode: int) -> None:
    seen = fuzz(url, cases_per_mode)
    for route, statuses in seen.items():
        print(route, dict(statuses))
    assert set(seen) == {"GET /health", "GET /metrics", "GET /v1/models",
                         "POST /v1/completions", "POST /v1/chat/completions"}
    for route in ("POST /v1/completions", "POST /v1/chat/completions"):
        statuses = seen[route]
        assert sum(statuses.values()) >= 2 * cases_per_mode, (route, statuses)
        # The fuzzer got past the door as well as being stopped at it.
        assert statuses[200] > 0 and statuses[400] > 0, (route, statuses)
    assert_pages_back(url)


def test_openapi_publishes_the_request_models(server):
    spec = httpx.get(server + "/openapi.json").json()
    models = spec["components"]["schemas"]
    for path, name in (("/v1/completions", "CompletionRequest"),
                       ("/v1/chat/completions", "ChatCompletionRequest")):
        post = spec["paths"][path]["post"]
        body = post["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert post["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
        props = models[name]["properties"]
        assert props["top_p"]["maximum"] == 1 and props["temperature"]["minimum"] == 0
    assert models["CompletionRequest"]["required"] == ["prompt"]
    assert models["ChatCompletionRequest"]["required"] == ["messages"]
    assert "ChatMessage" in models and "StreamOptions" in models
    assert "<title>" in httpx.get(server + "/docs").text


def test_fuzz_every_route(server):
    check_fuzzed(server, FAST_CASES)


@pytest.mark.slow
def test_fuzz_every_route_200_cases(server):
    check_fuzzed(server, SLOW_CASES)
