"""Soak (slow, SOAK_S seconds = 10 minutes): mixed load on a real `pipefill serve` (two stages,
--trace-dir on) with random client disconnects and aborts. After warm-up the resident memory
of every process (server and stages) grows by less than 5%, pages return to their baseline,
and the p99 latency of the last minute is within 20% of the first minute's.

The fast test checks the stage tracer's ring buffer: --trace-dir on a long-running server
keeps a bounded number of spans."""
import random
import statistics
import threading
import time

import httpx
import pytest

from test_supervisor import chat_model, children, metric  # noqa: F401

try:
    from server_util import start_server, stop_server
except ImportError:
    from test_server import start_server, stop_server

SOAK_S = 600  # the 10 minutes; shorten here for a quick local run
WARMUP_S = 240  # the tracer ring (--trace-dir) fills during the first minutes
WINDOW_S = 60  # the first and last minute compared for p99
CLIENTS = 4
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


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


class Load:
    """CLIENTS threads, each looping over a random mix of requests until stopped. Timed
    requests (one fixed shape) give the latency samples; the rest vary the traffic."""

    def __init__(self, url: str, seed: int = 0):
        self.url, self.rng = url, random.Random(seed)
        self.stop = threading.Event()
        self.latencies: list[tuple[float, float]] = []  # (end time, seconds)
        self.counts = {"timed": 0, "stream": 0, "disconnect": 0, "abort": 0, "chat": 0,
                       "error": 0}
        self.lock = threading.Lock()

    def run(self, rng: random.Random) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                kind = rng.choice(["timed", "timed", "stream", "disconnect", "abort", "chat"])
                try:
                    getattr(self, kind)(c, rng)
                except httpx.HTTPError:
                    kind = "error" if kind != "abort" else kind
                with self.lock:
                    self.counts[kind] += 1

    def _body(self, rng, n_in: int, n_out: int, **kw) -> dict:
        return {"prompt": [rng.randrange(100, 49000) for _ in range(n_in)], "max_tokens": n_out,
                "temperature": rng.choice([0, 0.8]), "ignore_eos": True, **kw}

    def timed(self, c, rng) -> None:
        t0 = time.monotonic()
        r = c.post(self.url + "/v1/completions", json=self._body(rng, 128, 32))
        r.raise_for_status()
        with self.lock:
            self.latencies.append((time.monotonic(), time.monotonic() - t0))

    def stream(self, c, rng) -> None:
        body = self._body(rng, rng.randint(16, 600), rng.randint(8, 96), stream=True)
        with c.stream("POST", self.url + "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                pass

    def disconnect(self, c, rng) -> None:
        """Streams, then hangs up after a few events: the server must abort the request."""
        body = self._body(rng, rng.randint(16, 600), 500, stream=True)
        with c.stream("POST", self.url + "/v1/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > rng.randint(2, 40):
                    break

    def abort(self, c, rng) -> None:
        """A non-streamed request whose client gives up before the answer."""
        c.post(self.url + "/v1/completions", json=self._body(rng, rng.randint(200, 800), 200),
               timeout=rng.uniform(0.2, 2.0))

    def chat(self, c, rng) -> None:
        r = c.post(self.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Tell me about the sea " * rng.randint(1, 20)}],
            "max_tokens": rng.randint(4, 48), "temperature": 0})
        r.raise_for_status()


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else values[0]


@pytest.mark.slow
def test_soak(chat_model, tmp_path):
    proc, url = start_server(chat_model, None, "--trace-dir", str(tmp_path / "traces"),
                             "--disable-radix-cache")
    try:
        pids = [proc.pid] + children(proc.pid)
        baseline_pages = metric(url, "pipefill_kv_pages_used")
        load = Load(url)
        threads = [threading.Thread(target=load.run, args=(random.Random(i),), daemon=True)
                   for i in range(CLIENTS)]
        start = time.monotonic()
        for t in threads:
            t.start()
        samples: list[tuple[float, list[int]]] = []
        while time.monotonic() - start < SOAK_S:
            time.sleep(10)
            samples.append((time.monotonic() - start, [rss_kb(p) for p in pids]))
        load.stop.set()
        for t in threads:
            t.join(150)
        deadline = time.monotonic() + 30
        while metric(url, "pipefill_kv_pages_used") != baseline_pages or \
                metric(url, "pipefill_requests_running"):
            assert time.monotonic() < deadline, "pages did not return to the baseline"
            time.sleep(0.5)
        assert children(proc.pid) == pids[1:], "a stage was replaced during the soak"
        report(load, samples, start, pids)
    finally:
        assert stop_server(proc) == 0


def report(load: Load, samples, start: float, pids: list[int]) -> None:
    after_warmup = [rss for t, rss in samples if t >= WARMUP_S]
    first = [statistics.median(x) for x in zip(*after_warmup[:3])]
    last = [statistics.median(x) for x in zip(*after_warmup[-3:])]
    growth = [(b - a) / a for a, b in zip(first, last)]
    lat = [(t - start, s) for t, s in load.latencies]
    end = max(t for t, _ in lat)
    first_min = [s for t, s in lat if t < WINDOW_S]
    last_min = [s for t, s in lat if t > end - WINDOW_S]
    drift = p99(last_min) / p99(first_min) - 1
    print(f"\nsoak {SOAK_S} s, {CLIENTS} clients: {load.counts}")
    for pid, a, b, g in zip(pids, first, last, growth):
        print(f"  pid {pid}: RSS {a / 1024:.1f} -> {b / 1024:.1f} MiB ({100 * g:+.2f}%)")
    print(f"  p99 latency (128 in / 32 out): first minute {p99(first_min):.3f} s "
          f"({len(first_min)} requests), last minute {p99(last_min):.3f} s "
          f"({len(last_min)}) -> {100 * drift:+.1f}%")
    assert load.counts["error"] == 0, load.counts
    assert max(growth) < MAX_RSS_GROWTH, growth
    assert drift < MAX_P99_DRIFT, drift  # slower by at most 20% (faster is fine)
