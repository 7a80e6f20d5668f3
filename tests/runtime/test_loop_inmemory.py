"""The micro-batch loops with an in-memory transport, no processes and no torch.distributed:
no deadlock for P in 1..8 and async depth 0..2, micro-batches executed in order on every stage,
every request finished, every page back; a PD role's reports from later stages reach stage 0
inside the pipeline."""
import queue
import threading
import time
from types import SimpleNamespace

import pytest

from pipefill.chunking.policy import ChunkPolicy
from pipefill.kv.pool import PagePool
from pipefill.kv.tiers import StageKV
from pipefill.runtime.loop import FirstStageLoop, report_to_first, run_later_stage
from pipefill.base.plan import NewRequest, PDInfo, SamplingParams, SeqResult, StepResult
from pipefill.kv.radix import RadixCache
from pipefill.scheduler.role import PrefillRole
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig


class Handle:
    def __init__(self):
        self.sent = threading.Event()

    def done(self):
        return self.sent.is_set()

    def wait(self):
        self.sent.wait()


class MemoryPipe:
    """Asynchronous sends (queued, never blocking the sender), blocking receives."""

    def __init__(self, rank, size, links, results):
        self.rank, self.size, self.links, self.results = rank, size, links, results
        self.in_flight = self.max_in_flight = 0

    def send_forward(self, msg, acts):
        if msg.plan is not None:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.links[self.rank + 1].put((msg, acts))
        return Handle()

    def recv_forward(self):
        return self.links[self.rank].get(timeout=10)

    def post_local(self, msg):
        self.links[self.rank].put((msg, None))

    def send_result(self, result):
        self.results.put(result)
        return Handle()

    def result_ready(self):
        return not self.results.empty()

    def recv_result(self):
        self.in_flight -= 1
        return self.results.get(timeout=10)

    def flush(self):
        pass


class FakeExecutor:
    """Records the order of micro-batches and replays the page decisions with the real
    ownership check; the last stage answers every sample with token 7."""

    def __init__(self, rank, num_pages=256, page_size=16):
        self.rank = rank
        self.steps = []
        self.num_forwards = 0
        self.memory = {}  # the stage's memory marks (runtime/worker.stage_memory_marks): none here
        # The real page-ops replay, over no tensors and no tiers.
        self.kv = StageKV(SimpleNamespace(num_pages=num_pages, page_size=page_size))
        self.cache = self.kv.cache

    def forward(self, plan, acts):
        self.steps.append(plan.step_id)
        self.kv.before_forward(plan.page_ops, plan.seqs)
        self.kv.after_forward(plan.page_ops)
        return ("acts", plan.step_id, self.rank), 0.0

    def results(self, plan, acts):
        return StepResult(plan.step_id, [SeqResult(w.rid, 7 if w.sample else None)
                                         for w in plan.seqs])

    def apply_page_ops(self, ops):
        self.kv.without_forward(ops)

    def close(self):
        self.kv.close()


class MemoryChannel:
    def __init__(self):
        self.inbox = queue.Queue()
        self.reports = queue.Queue()

    def poll(self, timeout_ms):
        try:
            first = self.inbox.get(timeout=timeout_ms / 1000) if timeout_ms else \
                self.inbox.get_nowait()
        except queue.Empty:
            return []
        msgs = [first]
        while not self.inbox.empty():
            msgs.append(self.inbox.get_nowait())
        return msgs

    def report(self, kind, payload=None):
        self.reports.put((kind, payload))


def run_pipeline(pp_size, depth, requests, prefix_cache=False):
    links = [queue.Queue() for _ in range(pp_size)]
    results = queue.Queue()
    pipes = [MemoryPipe(r, pp_size, links, results) for r in range(pp_size)]
    executors = [FakeExecutor(r) for r in range(pp_size)]
    channel = MemoryChannel()
    pool = PagePool(256)
    cache = RadixCache(16, pool) if prefix_cache else None
    scheduler = Scheduler(SchedulerConfig(16, 64, 8, 4096, eos_token_ids=()), pool,
                          ChunkPolicy(32), cache=cache)
    first = FirstStageLoop(executors[0], scheduler, channel,
                           pipes[0] if pp_size > 1 else None, pp_size + depth)
    threads = [threading.Thread(target=first.run, daemon=True)]
    threads += [threading.Thread(target=run_later_stage, args=(executors[r], pipes[r], channel),
                                 daemon=True) for r in range(1, pp_size)]
    for t in threads:
        t.start()
    channel.inbox.put(("add", requests))
    finished, tokens = set(), {}
    while len(finished) < len(requests):
        kind, payload = channel.reports.get(timeout=20)  # a deadlock fails here
        if kind == "outputs":
            for out in payload:
                tokens.setdefault(out.rid, []).extend(out.new_token_ids)
                if out.finished:
                    finished.add(out.rid)
    channel.inbox.put(("stats", None))  # carries the last frees to every stage
    channel.inbox.put(("stop", None))
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a stage did not stop"
    return executors, pool, tokens, pipes[0]


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("pp_size", range(1, 9))
def test_no_deadlock_and_in_order(pp_size, depth):
    requests = [NewRequest(f"r{i}", list(range(n)), SamplingParams(max_new_tokens=m))
                for i, (n, m) in enumerate([(150, 3), (20, 6), (64, 1), (33, 4), (5, 2)])]
    executors, pool, tokens, _ = run_pipeline(pp_size, depth, requests)
    steps = executors[0].steps
    assert steps == sorted(steps)
    for ex in executors[1:]:
        assert ex.steps == steps  # every micro-batch reached every stage, in order
    assert {rid: len(t) for rid, t in tokens.items()} == {"r0": 3, "r1": 6, "r2": 1, "r3": 4,
                                                          "r4": 2}
    pool.check_integrity()
    assert pool.num_free == pool.num_pages


@pytest.mark.parametrize("depth", [0, 2])
def test_chunks_of_one_request_fill_the_pipeline(depth):
    """Consecutive chunks of one request are launched without waiting for each other's
    results, up to pp_size + depth micro-batches in flight."""
    req = [NewRequest("long", list(range(320)), SamplingParams(max_new_tokens=1))]
    executors, _, _, pipe0 = run_pipeline(4, depth, req)
    assert len(executors[0].steps) == 10  # 320 / 32 chunks
    assert pipe0.max_in_flight == 4 + depth


def test_new_requests_join_between_steps_of_one_stage():
    """With one stage, the loop reads the front end after every step: a request that arrives
    during a long prefill is served before that prefill ends."""
    channel = MemoryChannel()
    executor = FakeExecutor(0)
    seen = []
    forward = executor.forward

    def forward_and_record(plan, acts):
        seen.append([w.rid for w in plan.seqs])
        if len(seen) == 1:
            channel.inbox.put(("add", [NewRequest("short", [1, 2, 3],
                                                  SamplingParams(max_new_tokens=1))]))
        return forward(plan, acts)
    executor.forward = forward_and_record
    scheduler = Scheduler(SchedulerConfig(16, 64, 8, 4096), PagePool(64), ChunkPolicy(32))
    loop = FirstStageLoop(executor, scheduler, channel)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    channel.inbox.put(("add", [NewRequest("long", list(range(320)),
                                          SamplingParams(max_new_tokens=1))]))
    done = set()
    while len(done) < 2:
        kind, payload = channel.reports.get(timeout=20)
        done |= {o.rid for o in payload if o.finished} if kind == "outputs" else set()
    channel.inbox.put(("stop", None))
    thread.join(10)
    first_short = next(i for i, rids in enumerate(seen) if "short" in rids)
    assert first_short < 3 and len(seen) >= 10


@pytest.mark.parametrize("pp_size", [1, 2, 4])
def test_prefix_cache_pages_agree_on_every_stage(pp_size):
    """Requests sharing prefixes, several in flight: every stage replays the page decisions
    (allocations, cache transfers, frees) and checks each micro-batch; in the end every
    stage's pages in use are exactly the cache's."""
    doc = list(range(100, 190))
    requests = [NewRequest(f"r{i}", doc[:n] + [i] * m, SamplingParams(max_new_tokens=k))
                for i, (n, m, k) in enumerate([(90, 5, 3), (90, 9, 20), (64, 1, 2), (40, 30, 5),
                                               (90, 0, 4)])]
    executors, pool, tokens, _ = run_pipeline(pp_size, 1, requests, prefix_cache=True)
    assert {rid: len(t) for rid, t in tokens.items()} == {"r0": 3, "r1": 20, "r2": 2, "r3": 5,
                                                          "r4": 4}
    pool.check_integrity()
    for ex in executors:
        assert ex.kv.owners.num_used == pool.num_used > 0


class ReportingPrefill(PrefillRole):
    """A PD prefill stage whose "sender" lets a room go on a thread of its own once the
    prompt's last chunk ran here, and only after `let_go` is set on later stages."""

    def __init__(self, num_stages, rank, pipe, let_go):
        super().__init__(num_stages)
        self.rank, self.let_go = rank, let_go
        self.own = queue.SimpleQueue()
        self.to_first = report_to_first(pipe) if rank > 0 else self.own.put

    def after_forward(self, plan):
        for w in plan.seqs:
            if w.room is not None and w.sample is not None:
                threading.Thread(target=self._release, args=(w.room,), daemon=True).start()

    def _release(self, room):
        if self.rank > 0:
            self.let_go.wait(10)
        self.to_first((room, self.rank))

    def poll(self, scheduler):
        while not self.own.empty():
            self.on_kv_done(scheduler, self.own.get())
        return []

    def on_kv_done(self, scheduler, event):
        self.stage_done(scheduler, event[0])


@pytest.mark.parametrize("pp_size", [2, 4])
def test_later_stages_kv_done_reaches_stage_0_inside_the_pipeline(pp_size):
    """PD prefill: a request's pages stay until every stage's sender let its room go; the later
    stages' reports ride the pipe to the last stage and back with the results, with no front
    end in between (the channel never carries them)."""
    links = [queue.Queue() for _ in range(pp_size)]
    results = queue.Queue()
    pipes = [MemoryPipe(r, pp_size, links, results) for r in range(pp_size)]
    let_go = threading.Event()
    roles = [ReportingPrefill(pp_size, r, pipes[r], let_go) for r in range(pp_size)]
    channel, pool = MemoryChannel(), PagePool(256)
    scheduler = Scheduler(SchedulerConfig(16, 64, 8, 4096), pool, ChunkPolicy(32), role=roles[0])
    first = FirstStageLoop(FakeExecutor(0), scheduler, channel, pipes[0], pp_size)
    threads = [threading.Thread(target=first.run, daemon=True)]
    threads += [threading.Thread(target=run_later_stage, daemon=True,
                                 args=(FakeExecutor(r), pipes[r], channel, None, roles[r]))
                for r in range(1, pp_size)]
    for t in threads:
        t.start()
    channel.inbox.put(("add", [NewRequest(f"r{i}", list(range(20 + 40 * i)),
                                          SamplingParams(max_new_tokens=1),
                                          PDInfo(i, "127.0.0.1", 8998)) for i in range(3)]))
    finished = set()
    while len(finished) < 3:
        kind, payload = channel.reports.get(timeout=20)
        finished |= {o.rid for o in payload if o.finished} if kind == "outputs" else set()
    assert pool.num_free < pool.num_pages  # the later stages' senders still hold the rooms
    let_go.set()
    deadline = time.monotonic() + 10
    while (pool.num_free < pool.num_pages or roles[0].rooms) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.num_free == pool.num_pages and not roles[0].rooms
    channel.inbox.put(("stop", None))
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a stage did not stop"
