"""A long prompt streamed through `pipefill serve` gets SSE comment lines with its prefill's
progress before the first token (valid SSE: the openai client reads the same text), /metrics
shows it while it prefills, and the server logs its progress; with_ticks closes what it wraps."""
import asyncio

import httpx

from pipefill.server.responses import TICK, with_ticks
from test_server import start_server, stop_server

PROMPT = [3 + i % 500 for i in range(1000)]  # 1,000 tokens in chunks of 8: 125 micro-batches


def test_with_ticks_ticks_and_closes():
    closed = []

    async def slow():
        try:
            await asyncio.sleep(0.35)
            yield "a"
            await asyncio.sleep(10)
            yield "b"
        finally:
            closed.append(True)

    async def main():
        got = []
        gen = with_ticks(slow(), 0.1)
        async for item in gen:
            got.append(item)
            if item == "a":
                break
        await gen.aclose()
        return got

    got = asyncio.run(main())
    assert got[-1] == "a" and got.count(TICK) >= 2 and closed == [True]


def test_stream_carries_progress_comments_before_the_first_token(tiny_models):
    proc, url = start_server(tiny_models["llama"], None, "--chunked-prefill-size", "8",
                             "--page-size", "8", "--log-prefill-progress-interval", "0.05",
                             "--max-model-len", "1024")
    try:
        check_stream(url)
    finally:
        stop_server(proc)
    assert "request cmpl-0: prefill " in proc.stdout.read()  # the progress log line


def check_stream(url: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: {"))
    comments = [line for line in lines[:first_data] if line.startswith(": prefill ")]
    assert comments, lines[:first_data + 1]
    done, total = comments[-1].split()[2].split("/")
    assert int(total) == len(PROMPT) and 0 <= int(done) <= len(PROMPT)
    assert lines[-1] == "data: [DONE]"
    from openai import OpenAI  # the same stream through the openai client: comments skipped
    client = OpenAI(base_url=f"{url}/v1", api_key="x")
    model = client.models.list().data[0].id
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
