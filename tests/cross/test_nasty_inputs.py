"""Nasty inputs: the strict JSON door (pure), a sampling failure that must fail one request and
not the stage (the scheduler alone, then the real stage executors in the in-memory loops),
and a real `pipefill serve` fed the issue's hand list of bad requests over HTTP; streamed
logprobs against the non-streamed ones with the official openai client."""
import json
import math
import threading

import httpx
import pytest

from pipefill.chunking.policy import ChunkPolicy
from pipefill.kv.pool import PagePool
from pipefill.base.plan import NewRequest, SamplingParams, SeqResult, StepResult
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig, check_prompt
from pipefill.server.protocol import MAX_JSON_DEPTH, json_depth, loads_body
from test_server import chat_model  # noqa: F401 - a fixture
from test_server_fuzz import assert_pages_back, serve_small

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# ---- the JSON door, pure ---------------------------------------------------------------------


@pytest.mark.parametrize("raw, message", [
    (b'{"temperature": NaN}', "NaN, which is not a JSON number"),
    (b'{"temperature": Infinity}', "Infinity, which is not a JSON number"),
    (b'{"top_p": -Infinity}', "-Infinity, which is not a JSON number"),
    (b'{"temperature": 1e999}', "1e999 in the request body is too large for a float"),
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    (b"[" * 5000 + b"]" * 5000, "nests 5000 levels deep; at most 64"),
    (b'{"prompt": "x"', "not valid JSON"),
])
def test_strict_json_refuses(raw, message):
    with pytest.raises(ValueError, match=message):
        loads_body(raw)


def test_json_depth_ignores_brackets_in_strings():
    text = json.dumps({"a": "[[[{{{", "b": [1, {"c": '\\"]]', "d": [[]]}]})
    assert json_depth(text) == 5 and json_depth("3") == 0
    deep = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert loads_body(deep.encode()) is not None  # the limit itself is accepted
    # An unterminated string over megabytes is not quadratic: it is one failed match.
    with pytest.raises(ValueError, match="not valid JSON"):
        loads_body(b'{"prompt": "' + b"a" * 5_000_000)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(temperature=math.nan), "temperature must be a finite number >= 0, got nan"),
    (SamplingParams(temperature=math.inf), "temperature must be a finite number >= 0, got inf"),
    (SamplingParams(top_p=math.nan), r"top_p must be in \(0, 1\], got nan"),
    (SamplingParams(top_p=math.inf), r"top_p must be in \(0, 1\], got inf"),
])
def test_engine_check_refuses_non_finite(params, message):
    """The Python Engine goes through the same check as the server."""
    with pytest.raises(ValueError, match=message):
        check_prompt([1, 2, 3], params, 512, 64, 1024)


# ---- a sampling failure fails one request --------------------------------------------------


class Unchecked(SamplingParams):
    """Parameters that slip past validation, as a bug at the door would let them."""

    def validate(self) -> None:
        pass


def test_scheduler_ends_a_failed_request_and_frees_its_pages():
    pool = PagePool(64)
    s = Scheduler(SchedulerConfig(16, 64, 8, 4096), pool, ChunkPolicy(32))
    s.add(NewRequest("bad", list(range(100)), SamplingParams(max_new_tokens=4,
                                                             return_prompt_logprobs=True)))
    s.add(NewRequest("good", list(range(10)), SamplingParams(max_new_tokens=2)))
    first, second = s.schedule(), s.schedule()  # two chunks of "bad" in flight
    assert [w.rid for w in first.seqs] == ["bad", "good"] and second.seqs[0].rid == "bad"
    outs = s.update(first, StepResult(first.step_id, [SeqResult("bad", error="boom"),
                                                      SeqResult("good", token=5)]))
    assert [(o.rid, o.finished, o.finish_reason, o.error) for o in outs] == [
        ("bad", True, "error", "boom"), ("good", False, None, None)]
    assert pool.num_used > 0  # "bad"'s second chunk is still in flight: its pages stay
    assert s.update(second, StepResult(second.step_id, [SeqResult("bad")])) == []
    while s.has_work:
        plan = s.schedule()
        s.update(plan, StepResult(plan.step_id, [SeqResult(w.rid, token=5) for w in plan.seqs]))
    pool.check_integrity()
    assert pool.num_free == pool.num_pages and not s.running


def test_stage_zero_refuses_ids_outside_the_vocabulary():
    """A request that skipped the front end's check (another client of stage 0's socket)
    is refused by the scheduler instead of reaching the embedding."""
    s = Scheduler(SchedulerConfig(16, 64, 8, 4096, vocab_size=100), PagePool(64),
                  ChunkPolicy(32))
    with pytest.raises(ValueError, match="token id 100 is outside the vocabulary"):
        s.add(NewRequest("r", [1, 2, 100], SamplingParams(max_new_tokens=2)))
    assert not s.waiting and not s.running


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from conftest import save_tiny_model
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def real_stages(path, pp_size):
    """The real stage executors of a tiny model (weights, KV pool, sampler), in process."""
    from pipefill.config import make_server_args
    from pipefill.frontend import prepare
    from pipefill.runtime.stage import build_stage
    args, source = prepare(make_server_args(path, pp_size=pp_size, dtype="float32",
                                            page_size=16, max_total_tokens=4096,
                                            attention_backend="sdpa"))
    return [build_stage(args, source, args.layout.stage(r))
            for r in range(pp_size)]


@pytest.mark.parametrize("pp_size", [1, 2])
def test_sampling_failure_fails_one_request_and_the_stage_serves_on(tiny_llama, pp_size):
    """NaN temperature reaches the real sampler (torch.multinomial raises): that request ends
    with finish_reason 'error' and a sentence, the others in the same micro-batch finish, the
    loops keep running and serve a request sent afterwards, and every page comes back."""
    import queue
    from test_loop_inmemory import MemoryChannel, MemoryPipe

    from pipefill.runtime.loop import FirstStageLoop, run_later_stage
    executors = real_stages(tiny_llama, pp_size)
    links, results = [queue.Queue() for _ in range(pp_size)], queue.Queue()
    pipes = [MemoryPipe(r, pp_size, links, results) for r in range(pp_size)]
    channel, pool = MemoryChannel(), PagePool(executors[0].cache.num_pages)
    scheduler = Scheduler(SchedulerConfig(16, 64, 8, 1024), pool, ChunkPolicy(32))
    first = FirstStageLoop(executors[0], scheduler, channel,
                           pipes[0] if pp_size > 1 else None, pp_size)
    threads = [threading.Thread(target=first.run, daemon=True)] + [
        threading.Thread(target=run_later_stage, args=(executors[r], pipes[r], channel),
                         daemon=True) for r in range(1, pp_size)]
    for t in threads:
        t.start()

    def run(requests):
        channel.inbox.put(("add", requests))
        done = {}
        while len(done) < len(requests):
            kind, payload = channel.reports.get(timeout=60)
            assert kind != "fatal", payload
            done.update({o.rid: o for o in payload if o.finished} if kind == "outputs" else {})
        return done
    sampled = dict(max_new_tokens=4, temperature=0.8, seed=1, ignore_eos=True)
    done = run([NewRequest("good1", [5, 6, 7], SamplingParams(**sampled)),
                NewRequest("bad", [8, 9, 10], Unchecked(**{**sampled, "temperature": math.nan})),
                NewRequest("good2", [11, 12], SamplingParams(**sampled))])
    assert done["bad"].finish_reason == "error"
    assert "sampling failed" in done["bad"].error and "probability tensor" in done["bad"].error
    assert done["good1"].finish_reason == done["good2"].finish_reason == "length"
    assert all(t.is_alive() for t in threads)
    after = run([NewRequest("after", [1, 2, 3], SamplingParams(**sampled))])
    assert after["after"].finish_reason == "length"
    channel.inbox.put(("stop", None))
    for t in threads:
        t.join(10)
    pool.check_integrity()
    assert pool.num_free == pool.num_pages


# ---- the hand list, over HTTP --------------------------------------------------------------


@pytest.fixture(scope="module")
def server(chat_model):  # noqa: F811
    yield from serve_small(chat_model)


def raw_body(fields: str) -> bytes:
    return ('{"prompt": "Hello", "max_tokens": 2, ' + fields + "}").encode()


NASTY = [  # (name, body, headers, status, words in the sentence)
    ("NaN temperature", raw_body('"temperature": NaN'), {}, 400, "NaN"),
    ("Infinity temperature", raw_body('"temperature": Infinity'), {}, 400, "Infinity"),
    ("-Infinity temperature", raw_body('"temperature": -Infinity'), {}, 400, "Infinity"),
    ("overflowing temperature", raw_body('"temperature": 1e400'), {}, 400, "too large"),
    ("negative temperature", raw_body('"temperature": -0.5'), {}, 400, "temperature"),
    ("NaN top_p", raw_body('"top_p": NaN'), {}, 400, "NaN"),
    ("Infinity top_p", raw_body('"top_p": Infinity'), {}, 400, "Infinity"),
    ("negative top_p", raw_body('"top_p": -0.5'), {}, 400, "top_p must be in (0, 1]"),
    ("zero top_p", raw_body('"top_p": 0'), {}, 400, "top_p must be in (0, 1]"),
    ("huge max_tokens", b'{"prompt": "Hello", "max_tokens": 1000000000000000000000000000000}',
     {}, 400, "exceeds --max-model-len"),
    ("huge top_k", raw_body('"top_k": 100000000000000000000000000'), {}, 400, "64 bits"),
    ("huge seed", raw_body('"seed": -100000000000000000000000000'), {}, 400, "64 bits"),
    ("10 MB prompt", json.dumps({"prompt": "x" * 10_000_000}).encode(), {}, 413,
     "larger than"),
    ("prompt past the tokenizer bound", json.dumps({"prompt": "hello " * 50_000}).encode(),
     {}, 400, "no prompt of --max-model-len"),
    ("invalid UTF-8", b'{"prompt": "\xc3\x28\xa0"}', {}, 400, "UTF-8"),
    ("lone surrogate", b'{"prompt": "a\\ud800b"}', {}, 400, "surrogate"),
    ("5,000 levels of nesting", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}, 400,
     "nests 5001 levels"),
    ("1,000 stop strings", json.dumps({"prompt": "Hello", "stop": [f"s{i}" for i in
                                                                  range(1000)]}).encode(),
     {}, 400, "at most 16 stop strings"),
    ("long stop string", json.dumps({"prompt": "Hello", "stop": "s" * 1000}).encode(), {}, 400,
     "at most 256 characters"),
    ("text/plain", b'{"prompt": "Hello"}', {"content-type": "text/plain"}, 415,
     "application/json"),
    ("form-encoded", b"prompt=Hello", {"content-type": "application/x-www-form-urlencoded"},
     415, "application/json"),
    ("a JSON array", b"[1, 2]", {}, 400, "must be a JSON object"),
    ("empty body", b"", {}, 400, "not valid JSON"),
]


@pytest.mark.parametrize("name, body, headers, status, words", NASTY, ids=[n[0] for n in NASTY])
def test_nasty_request_gets_a_sentence(server, name, body, headers, status, words):
    r = httpx.post(server + "/v1/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and len(err["message"].split()) >= 4, err
    assert err["type"] == "invalid_request_error" and err["code"] == status
    assert httpx.get(server + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("messages, words", [
    ([], "messages"),
    ([{"role": "user", "content": "a\ud800b"}], "surrogate"),
    ([{"role": "robot", "content": "hi"}], "messages.0.role"),
])
def test_nasty_chat_gets_a_sentence(server, messages, words):
    r = httpx.post(server + "/v1/chat/completions", timeout=60,
                   content=json.dumps({"messages": messages, "max_tokens": 2}))
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_nasty_list_leaves_the_server_whole(server):
    """After the list: healthy, nothing running, no page held, and a request that needs every
    page of the pool still runs."""
    for name, body, headers, _, _ in NASTY:
        httpx.post(server + "/v1/completions", content=body, headers=headers, timeout=60)
    assert_pages_back(server)


# ---- streamed logprobs ---------------------------------------------------------------------


def client(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_streamed_completion_logprobs_equal_whole(server):
    c = client(server)
    kw = dict(model=None, prompt=list(range(1000, 1012)), max_tokens=8, temperature=0,
              logprobs=2, echo=True, extra_body={"ignore_eos": True})
    whole = c.completions.create(**kw).choices[0].logprobs
    chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw) if ch.choices]
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in chunks:
        if ch.logprobs is not None:
            for key in streamed:
                streamed[key] += getattr(ch.logprobs, key)
    assert len(whole.tokens) == 12 + 8  # echo: the prompt's tokens, then the generated ones
    assert_close(streamed, {key: getattr(whole, key) for key in streamed})
    assert sum(ch.logprobs is not None for ch in chunks) >= 2  # spread over the chunks


def test_streamed_chat_logprobs_equal_whole(server):
    c = client(server)
    kw = dict(model=None, messages=[{"role": "user", "content": "Count to five."}],
              max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [entry for ch in c.chat.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs is not None
                for entry in ch.choices[0].logprobs.content]
    assert len(whole) == 6 and all(len(e.top_logprobs) == 3 for e in whole)
    assert_close([e.model_dump() for e in streamed], [e.model_dump() for e in whole])


def assert_close(a, b):
    """Equal, numbers within 1e-4: the second run of a prompt reads the prefix cache, whose
    float rounding differs a little from a fresh prefill."""
    if isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-4)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert list(a) == list(b)
        for key in a:
            assert_close(a[key], b[key])
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_close(x, y)
    else:
        assert a == b


def test_a_failed_request_is_a_500_or_an_error_event():
    """How the server words a request the stages ended with 'error' (the in-memory test above
    shows the stages do): a 500 with the sentence for a whole response; for a stream, an error
    event and then [DONE]."""
    import asyncio
    from types import SimpleNamespace

    from pipefill.base.plan import RequestOutput
    from pipefill.server.metrics import ServerMetrics
    from pipefill.server.responses import RequestFailed, Run, error_of

    class Stages:  # the AsyncEngine's generate(), answering as stage 0 does after a failure
        async def generate(self, rid, prompt_ids, params, priority=0):
            yield RequestOutput(rid, [], True, "error", error="sampling failed: RuntimeError: x")
    served = SimpleNamespace(engine=Stages(), tokenizer=None, metrics=ServerMetrics(),
                             model_name="m",
                             serving=SimpleNamespace(log_prefill_progress_interval=0.0))
    job = SimpleNamespace(rid="cmpl-1", prompt_ids=[1, 2], prompt_text=None, params=None,
                          stops=[], chat=False, echo=False, logprobs=None, created=0,
                          priority=0)
    with pytest.raises(RequestFailed) as failed:
        asyncio.run(Run(served, job).collect())
    err = error_of(failed.value)
    assert err.status == 500 and err.kind == "server_error"
    assert err.message == "the request failed while generating: sampling failed: RuntimeError: x"

    async def stream():
        return [event async for event in Run(served, job).sse(include_usage=False)]
    events = asyncio.run(stream())
    assert json.loads(events[-2][6:])["error"]["code"] == 500
    assert events[-1] == "data: [DONE]\n\n"
