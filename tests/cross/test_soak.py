"""Soak (slow, $PIPEFILL_SOAK_S seconds, default 600 = 10 minutes): mixed load on a real
`pipefill serve` in its default configuration (radix prefix cache on; two stages, --trace-dir
on) with random client disconnects and aborts. Every response is checked: an HTTP status other
than 200, a body or SSE event that is not JSON or carries an "error", a stream that does not
end with a finish reason and 'data: [DONE]' all fail the test; only a client's own timeout (an
abort) or hang-up (a disconnect) ends a request early. After warm-up the resident memory of
every process (server and stages) grows by less than 5%, every page is back with the prefix
cache or free, and the p99 latency of the last minute is within 20% of the first minute's.
A run shorter than MIN_TREND_S (e.g. PIPEFILL_SOAK_S=60 for a quick check) is too short for
the warm-up: it checks the responses and the pages, and prints the memory and latency trends
without judging them.

The fast test checks the stage tracer's ring buffer: --trace-dir on a long-running server
keeps a bounded number of spans."""
import json
import os
import random
import signal
import statistics
import threading
import time

import httpx
import pytest

from test_supervisor import chat_model, children, metric  # noqa: F401

try:
    from server_util import start_server
except ImportError:
    from test_server import start_server

SOAK_S = float(os.environ.get("PIPEFILL_SOAK_S", 600))  # 10 minutes by default
MIN_TREND_S = 300  # shorter runs do not reach the end of the warm-up
WARMUP_S = min(240, SOAK_S * 0.4)  # the tracer ring (--trace-dir) fills during the first minutes
WINDOW_S = min(60, SOAK_S / 4)  # the first and last minute compared for p99
SAMPLE_S = min(10, SOAK_S / 12)  # RSS sampling interval
CLIENTS = 4
STOP_TIMEOUT_S = 120
MAX_RSS_GROWTH = 0.05
MAX_P99_DRIFT = 0.20


def test_tracer_keeps_a_bounded_ring_of_the_newest_spans():
    from pipefill.runtime.trace import StageTracer
    tracer = StageTracer(rank=1, enabled=True, max_spans=100)
    for step in range(1000):
        with tracer.span("forward", "forward", step=step):
            pass
    assert len(tracer.events) == 100
    spans = tracer.drain()
    assert [s["args"]["step"] for s in spans] == list(range(900, 1000))  # the newest kept
    assert len(tracer.events) == 0
    with tracer.span("send", "send"):
        pass
    assert len(tracer.drain()) == 1


def sse(*events: str, status: int = 200) -> httpx.Response:
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})


GOOD_CHUNK = '{"choices": [{"text": "a", "finish_reason": null}]}'
LAST_CHUNK = '{"choices": [{"text": "", "finish_reason": "length"}]}'


def test_response_checks_fail_on_every_kind_of_error():
    SseReader(sse(GOOD_CHUNK, LAST_CHUNK, "[DONE]")).read_to_end()
    bad = [sse(GOOD_CHUNK, '{"error": {"message": "boom"}}', "[DONE]"),  # an error event
           sse(GOOD_CHUNK, LAST_CHUNK),  # no [DONE]
           sse(GOOD_CHUNK, "[DONE]"),  # no finish reason
           sse(GOOD_CHUNK, "[DONE]", LAST_CHUNK),  # an event after [DONE]
           sse(GOOD_CHUNK, status=500)]
    for r in bad:
        with pytest.raises(BadResponse):
            SseReader(r).read_to_end()
    with pytest.raises(ValueError):  # a chunk that is not JSON
        SseReader(sse("{not json", "[DONE]")).read_to_end()
    with pytest.raises(BadResponse):
        check_json(httpx.Response(200, json={"error": {"message": "boom"}}))
    with pytest.raises(BadResponse):
        check_json(httpx.Response(503, json={"status": "down"}))
    assert check_json(httpx.Response(200, json={"choices": [{"text": "a"}]}))


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


class BadResponse(AssertionError):
    """The server answered, and the answer is an error or malformed."""


def check_status(r: httpx.Response) -> None:
    if r.status_code != 200:
        r.read()
        raise BadResponse(f"HTTP {r.status_code}: {r.text[:300]}")


def check_json(r: httpx.Response) -> dict:
    check_status(r)
    body = r.json()
    if "error" in body or not body.get("choices"):
        raise BadResponse(f"a 200 without an answer: {str(body)[:300]}")
    return body


class SseReader:
    """Reads an SSE stream event by event and fails on anything but well-formed chunks: an
    "error" event, a line that is not 'data: ...' JSON, an event after [DONE]."""

    def __init__(self, r: httpx.Response):
        check_status(r)
        self.lines = r.iter_lines()
        self.done = False
        self.finish_reason = None

    def __iter__(self):
        for line in self.lines:
            if not line:
                continue
            if not line.startswith("data: "):
                raise BadResponse(f"not an SSE data line: {line[:200]!r}")
            if self.done:
                raise BadResponse(f"an event after [DONE]: {line[:200]!r}")
            data = line[len("data: "):]
            if data == "[DONE]":
                self.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                raise BadResponse(f"SSE error event: {data[:300]}")
            for choice in event.get("choices", []):
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
            yield event

    def read_to_end(self) -> None:
        for _ in self:
            pass
        if not self.done or self.finish_reason is None:
            raise BadResponse(f"the stream ended without a finish reason and [DONE] "
                              f"(finish {self.finish_reason}, done {self.done})")


class Load:
    """CLIENTS threads, each looping over a random mix of requests until stopped. Timed
    requests (one fixed shape) give the latency samples; the rest vary the traffic. Any
    error a request meets is counted and its first few messages kept for the report."""

    def __init__(self, url: str, seed: int = 0):
        self.url, self.rng = url, random.Random(seed)
        self.stop = threading.Event()
        self.latencies: list[tuple[float, float]] = []  # (end time, seconds)
        self.counts = {"timed": 0, "stream": 0, "disconnect": 0, "abort": 0,
                       "abort_answered": 0, "chat": 0, "error": 0}
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def run(self, rng: random.Random) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                kind = rng.choice(["timed", "timed", "stream", "disconnect", "abort", "chat"])
                try:
                    kind = getattr(self, kind)(c, rng) or kind
                except (httpx.HTTPError, BadResponse, ValueError) as e:  # ValueError: bad JSON
                    self._error(kind, e)
                    kind = "error"
                with self.lock:
                    self.counts[kind] += 1

    def _error(self, kind: str, e: Exception) -> None:
        with self.lock:
            if len(self.errors) < 10:
                self.errors.append(f"{kind}: {type(e).__name__}: {e}")

    def _body(self, rng, n_in: int, n_out: int, **kw) -> dict:
        return {"prompt": [rng.randrange(100, 49000) for _ in range(n_in)], "max_tokens": n_out,
                "temperature": rng.choice([0, 0.8]), "ignore_eos": True, **kw}

    def timed(self, c, rng) -> None:
        t0 = time.monotonic()
        check_json(c.post(self.url + "/v1/completions", json=self._body(rng, 128, 32)))
        with self.lock:
            self.latencies.append((time.monotonic(), time.monotonic() - t0))

    def stream(self, c, rng) -> None:
        body = self._body(rng, rng.randint(16, 600), rng.randint(8, 96), stream=True,
                          stream_options={"include_usage": True})
        with c.stream("POST", self.url + "/v1/completions", json=body) as r:
            SseReader(r).read_to_end()

    def disconnect(self, c, rng) -> None:
        """Streams, then hangs up after a few events: the server must abort the request.
        The events before the hang-up are checked like any others."""
        body = self._body(rng, rng.randint(16, 600), 500, stream=True)
        with c.stream("POST", self.url + "/v1/completions", json=body) as r:
            reader = SseReader(r)
            for i, _ in enumerate(reader):
                if i > rng.randint(2, 40):
                    return None
            if not reader.done:
                raise BadResponse("the stream ended before the client hung up, without [DONE]")
        return None

    def abort(self, c, rng) -> str | None:
        """A non-streamed request whose client gives up before the answer (its timeout); an
        answer that comes in time is checked like any other."""
        try:
            r = c.post(self.url + "/v1/completions",
                       json=self._body(rng, rng.randint(200, 800), 200),
                       timeout=rng.uniform(0.2, 2.0))
        except httpx.TimeoutException:
            return None  # the abort itself
        check_json(r)
        return "abort_answered"

    def chat(self, c, rng) -> None:
        body = check_json(c.post(self.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Tell me about the sea " * rng.randint(1, 20)}],
            "max_tokens": rng.randint(4, 48), "temperature": 0}))
        if body["choices"][0].get("finish_reason") is None:
            raise BadResponse(f"a chat answer without a finish reason: {str(body)[:300]}")


def labelled_metric(url: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def pages_held_by_requests(url: str) -> float:
    """Pages in use, less the prefix cache's pages that no request uses (the server counts
    those as free: they are evicted on demand); zero when no request holds any."""
    return metric(url, "pipefill_kv_pages_used")


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else values[0]


@pytest.mark.slow
def test_soak(chat_model, tmp_path):
    proc, url = start_server(chat_model, None, "--trace-dir", str(tmp_path / "traces"))
    try:
        pids = [proc.pid] + children(proc.pid)
        baseline_pages = pages_held_by_requests(url)
        load = Load(url)
        threads = [threading.Thread(target=load.run, args=(random.Random(i),), daemon=True)
                   for i in range(CLIENTS)]
        start = time.monotonic()
        for t in threads:
            t.start()
        samples: list[tuple[float, list[int]]] = []
        while time.monotonic() - start < SOAK_S:
            time.sleep(SAMPLE_S)
            samples.append((time.monotonic() - start, [rss_kb(p) for p in pids]))
        load.stop.set()
        for t in threads:
            t.join(150)
        deadline = time.monotonic() + 30
        while pages_held_by_requests(url) != baseline_pages or \
                metric(url, "pipefill_requests_running"):
            assert time.monotonic() < deadline, (
                f"pages did not return to the baseline ({baseline_pages} held by requests): "
                f"{pages_held_by_requests(url)} held by requests, "
                f"{metric(url, 'pipefill_requests_running')} running, "
                f"{metric(url, 'pipefill_requests_waiting')} waiting")
            time.sleep(0.5)
        assert children(proc.pid) == pids[1:], "a stage was replaced during the soak"
        assert labelled_metric(url, "pipefill_cache_pages", tier="l1") > 0  # the cache was on
        report(load, samples, start, pids)
    finally:
        assert stop_soak_server(proc) == 0


def stop_soak_server(proc) -> int:
    """SIGTERM, like stop_server, with more time: the server writes the stages' trace
    (--trace-dir: a full span ring, JSON and a PNG timeline) before it exits, which took 15 s
    after a 20 s load on two busy cores."""
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    try:
        return proc.wait(STOP_TIMEOUT_S)
    finally:
        print(f"  server stopped in {time.monotonic() - t0:.1f} s")
        proc.kill()


def report(load: Load, samples, start: float, pids: list[int]) -> None:
    print(f"\nsoak {SOAK_S:.0f} s, {CLIENTS} clients: {load.counts}")
    assert load.counts["error"] == 0, (load.counts, load.errors)
    assert all(load.counts[k] > 0 for k in ("timed", "stream", "disconnect", "chat")), \
        load.counts
    after_warmup = [rss for t, rss in samples if t >= WARMUP_S]
    first = [statistics.median(x) for x in zip(*after_warmup[:3])]
    last = [statistics.median(x) for x in zip(*after_warmup[-3:])]
    growth = [(b - a) / a for a, b in zip(first, last)]
    lat = [(t - start, s) for t, s in load.latencies]
    end = max(t for t, _ in lat)
    first_min = [s for t, s in lat if t < WINDOW_S]
    last_min = [s for t, s in lat if t > end - WINDOW_S]
    drift = p99(last_min) / p99(first_min) - 1
    for pid, a, b, g in zip(pids, first, last, growth):
        print(f"  pid {pid}: RSS {a / 1024:.1f} -> {b / 1024:.1f} MiB ({100 * g:+.2f}%)")
    print(f"  p99 latency (128 in / 32 out): first minute {p99(first_min):.3f} s "
          f"({len(first_min)} requests), last minute {p99(last_min):.3f} s "
          f"({len(last_min)}) -> {100 * drift:+.1f}%")
    if SOAK_S < MIN_TREND_S:
        print(f"  (a {SOAK_S:.0f} s run ends before the warm-up does: trends not judged)")
        return
    assert max(growth) < MAX_RSS_GROWTH, growth
    assert drift < MAX_P99_DRIFT, drift  # slower by at most 20% (faster is fine)
