"""Prometheus metrics of the server, in a registry of its own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TPOT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_CHUNK = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "pipefill_"
        self.requests = Counter(p + "requests", "Finished requests by status", ["status"],
                                registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Time per output token after the first", buckets=_TPOT,
                              registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens",
                                         registry=r)
        self.chunk_size = Histogram(p + "prefill_chunk_size_tokens", "Prefill chunk sizes",
                                    buckets=_CHUNK, registry=r)
        self.running = Gauge(p + "requests_running", "Requests admitted", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests queued for admission",
                             registry=r)
        self.pages_used = Gauge(p + "kv_pages_used", "KV pages in use", registry=r)
        self.pages_free = Gauge(p + "kv_pages_free", "KV pages free", registry=r)
        # Sliding-window layers' own pages (ARCHITECTURE.md, 'Window pages'); 0 without.
        self.window_pages_used = Gauge(p + "kv_window_pages_used",
                                       "Window layers' KV pages in use", registry=r)
        self.window_pages_peak = Gauge(p + "kv_window_pages_peak",
                                       "Most window layers' KV pages in use at once",
                                       registry=r)
        self.healthy = Gauge(p + "stages_up", "1 when every stage is up", registry=r)
        # Long prompts in prefill (longer than one chunk), from stage 0's load reports.
        self.prefill_requests = Gauge(p + "prefill_long_requests",
                                      "Prompts longer than one chunk in prefill", registry=r)
        self.prefill_tokens_left = Gauge(p + "prefill_tokens_remaining",
                                         "Prompt tokens of long prompts not yet computed",
                                         registry=r)
        self.prefill_oldest_age = Gauge(p + "prefill_oldest_age_seconds",
                                        "Time since the oldest long prompt in prefill was "
                                        "admitted", registry=r)
        # Prefix cache (stage 0's counters since the stages started, pushed with the load).
        self.cache_hit_tokens = Gauge(p + "cache_hit_tokens",
                                      "Prompt tokens served from the prefix cache, by tier",
                                      ["tier"], registry=r)
        self.cache_pages = Gauge(p + "cache_pages", "Pages held by the prefix cache, by tier",
                                 ["tier"], registry=r)
        self.cache_capacity = Gauge(p + "cache_capacity_pages", "Pages each tier can hold",
                                    ["tier"], registry=r)
        self.cache_evicted_pages = Gauge(p + "cache_evicted_pages",
                                         "Pages evicted from the KV pool by the prefix cache",
                                         registry=r)
        self.preemptions = Gauge(p + "preemptions",
                                 "Requests preempted (back to the queue, resumed from the cache)",
                                 registry=r)
        self.stage_restarts = Counter(p + "stage_restarts",
                                      "Automatic restarts of the stage group after a stage died",
                                      registry=r)
        self.held = Gauge(p + "requests_held", "Requests the server holds: tokenizing, "
                          "waiting or running (at most --max-running-requests + "
                          "--max-queued-requests)", registry=r)
        self.tokenizing = Gauge(p + "requests_tokenizing",
                                "Requests whose long prompt is in the tokenizer thread",
                                registry=r)
        self.queue_full = Counter(p + "requests_queue_full",
                                  "Requests answered 429: running and queued at their limit",
                                  registry=r)

    def observe_load(self, load: dict) -> None:
        prefill = load.get("prefill") or []  # [rid, done, total, age_s, eta_s] per long prompt
        self.prefill_requests.set(len(prefill))
        self.prefill_tokens_left.set(sum(total - done for _, done, total, _, _ in prefill))
        self.prefill_oldest_age.set(max((age for _, _, _, age, _ in prefill), default=0))
        self.running.set(load.get("running", 0))
        self.waiting.set(load.get("waiting", 0))
        # Cache pages nobody uses are as good as free: they are evicted on demand.
        spare = load.get("cache_evictable_pages", 0)
        self.pages_used.set(load.get("pages_used", 0) - spare)
        self.pages_free.set(load.get("pages_free", 0) + spare)
        self.window_pages_used.set(load.get("window_pages_used", 0))
        self.window_pages_peak.set(load.get("window_pages_peak", 0))
        hits, host, storage = (load.get(k, 0) for k in (
            "cache_hit_tokens", "cache_hit_tokens_host", "cache_hit_tokens_storage"))
        for tier, value in (("l1", hits - host - storage), ("l2", host), ("l3", storage)):
            self.cache_hit_tokens.labels(tier=tier).set(value)
        self.cache_pages.labels(tier="l1").set(load.get("cache_pages", 0))
        self.cache_pages.labels(tier="l2").set(load.get("host_slots_used", 0))
        self.cache_pages.labels(tier="l3").set(load.get("storage_stored_pages", 0))  # stage 0's
        self.cache_capacity.labels(tier="l1").set(load.get("pages_total", 0))
        self.cache_capacity.labels(tier="l2").set(load.get("host_slots_total", 0))
        self.cache_evicted_pages.set(load.get("cache_evicted_pages", 0))
        self.preemptions.set(load.get("preemptions", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
