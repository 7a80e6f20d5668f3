"""`pipefill bench serving`: load an OpenAI-compatible server the way SGLang's and vLLM's serving
benchmarks do, and report TTFT, time per output token, inter-token latency and end-to-end
latency (mean, p50, p90, p99) with request and token throughput.

Prompts (--prompt-mode): `tokens`, random token ids (exact lengths; any server that takes
token-id prompts on /v1/completions), or `text`, random whole words of --tokenizer's vocabulary
that it encodes back to exactly the wanted length (routers such as sglang-router take only text
prompts); the prompt tokens reported are the server's own count (`usage`) when it sends one.
Lengths are uniform in [I(1-r), I(1+r)] for --random-input-len I and --random-range-ratio r;
every request streams exactly its output length (ignore_eos). ITL is every gap between two
streamed tokens of a request; TPOT is a request's (E2E - TTFT) / (output tokens - 1).
Requests arrive as a Poisson process at --request-rate (inf: all at once), at most
--max-concurrency in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field


def add_parser(sub) -> None:
    p = sub.add_parser("serving", help="serving benchmark against an OpenAI-compatible server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=32, help="requests to send")
    p.add_argument("--random-input-len", type=int, default=1024, help="mean prompt tokens")
    p.add_argument("--random-output-len", type=int, default=128, help="mean output tokens")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--request-rate", default="inf",
                   help="requests per second (Poisson arrivals), or inf")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no limit)")
    p.add_argument("--vocab-size", type=int, default=49152,
                   help="token ids are drawn from [100, vocab-size) (--prompt-mode tokens)")
    p.add_argument("--prompt-mode", choices=["tokens", "text"], default="tokens",
                   help="token-id prompts, or text prompts of the same lengths (for routers)")
    p.add_argument("--tokenizer", default=None,
                   help="model (folder or .gguf) whose tokenizer builds text prompts "
                        "(default: the default model)")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths, prompts, arrivals")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per request")
    p.add_argument("--label", default="", help="a name for this run in the printout and JSON")
    p.add_argument("--json", metavar="FILE", help="write the summary and every request here")
    p.set_defaults(run=run)


@dataclass
class RequestResult:
    input_len: int  # the prompt tokens: the server's count (usage) when it sent one
    requested_input_len: int = 0
    output_len: int = 0
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.ok and self.output_len > 1:
            return (self.e2e_s - self.ttft_s) / (self.output_len - 1)
        return None


def lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


class TextPrompts:
    """Random text that `tokenizer` encodes to exactly n tokens: whole words of its vocabulary
    (a byte-level BPE or SentencePiece word token with its leading space), which re-encode one
    token each; a few rounds of re-encoding and trimming fix any that merge."""

    def __init__(self, model_path: str | None):
        from pipefill.model.loader import WeightSource, resolve_model_path
        from pipefill.model.tokenizer import load_tokenizer
        self.tok = load_tokenizer(WeightSource(resolve_model_path(model_path)))
        if self.tok is None:
            raise ValueError(f"--tokenizer {model_path}: that model has no tokenizer")
        vocab = self.tok.hf.get_vocab()
        self.words = sorted(i for t, i in vocab.items() if len(t) > 3 and t[0] in "Ġ▁"
                            and t[1:].isascii() and t[1:].isalpha())
        if len(self.words) < 100:  # an unusual vocabulary: any token will do
            self.words = sorted(vocab.values())
        self.specials = len(self.tok.encode(""))  # BOS and the like, added by the server

    def make(self, n: int, rng: random.Random) -> str:
        want = max(1, n - self.specials)
        ids = [rng.choice(self.words) for _ in range(want)]
        for _ in range(4):
            text = self.tok.decode(ids)
            ids = self.tok.hf.encode(text, add_special_tokens=False)
            if len(ids) == want:
                break
            ids = ids[:want] + [rng.choice(self.words) for _ in range(want - len(ids))]
        return text


@functools.lru_cache(maxsize=2)
def text_prompts(model_path: str | None) -> TextPrompts:
    """One tokenizer load per model (a GGUF's takes seconds) for runs in one process."""
    return TextPrompts(model_path)


def make_prompts(ns, ins: list[int], rng: random.Random) -> list:
    if ns.prompt_mode == "tokens":
        return [[rng.randrange(100, ns.vocab_size) for _ in range(n)] for n in ins]
    maker = text_prompts(ns.tokenizer)
    return [maker.make(n, rng) for n in ins]


async def one_request(client, url, headers, model, prompt, max_tokens, timeout,
                      input_len: int, extra: dict | None = None):
    """One streamed completion; extra: more fields of the body (e.g. a priority)."""
    result = RequestResult(input_len, input_len)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **(extra or {})}
    t0 = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers,
                                 timeout=timeout) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                if data.get("usage"):
                    result.output_len = data["usage"]["completion_tokens"]
                    result.input_len = data["usage"].get("prompt_tokens") or result.input_len
                if data.get("choices") and data["choices"][0].get("text"):
                    now = time.perf_counter()
                    if result.ttft_s is None:
                        result.ttft_s = now - t0
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    chunks += 1
                elif data.get("choices") and data["choices"][0].get("finish_reason") and \
                        result.ttft_s is None:  # tokens without text (held back, no tokenizer)
                    result.ttft_s = time.perf_counter() - t0
        result.e2e_s = time.perf_counter() - t0
        result.output_len = result.output_len or chunks
        result.ok = result.ttft_s is not None
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_benchmark(ns) -> tuple[list[RequestResult], float]:
    import httpx
    from tqdm import tqdm
    rng = random.Random(ns.seed)
    ins = lengths(ns.random_input_len, ns.random_range_ratio, ns.num_prompts, rng)
    outs = lengths(ns.random_output_len, ns.random_range_ratio, ns.num_prompts, rng)
    prompts = make_prompts(ns, ins, rng)
    rate = float(ns.request_rate)
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    base = ns.base_url.rstrip("/")
    limit = asyncio.Semaphore(ns.max_concurrency or ns.num_prompts)
    async with httpx.AsyncClient(timeout=ns.timeout,
                                 limits=httpx.Limits(max_connections=None)) as client:
        model = ns.model or (await client.get(base + "/v1/models", headers=headers)
                             ).json()["data"][0]["id"]
        bar = tqdm(total=ns.num_prompts, desc="requests", unit="req")

        async def limited(prompt, out_len, in_len):
            async with limit:
                res = await one_request(client, base + "/v1/completions", headers, model,
                                        prompt, out_len, ns.timeout, in_len)
            bar.update(1)
            return res

        tasks = []
        start = time.perf_counter()
        for prompt, out_len, in_len in zip(prompts, outs, ins):
            tasks.append(asyncio.create_task(limited(prompt, out_len, in_len)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return results, duration


def stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = sorted(values)

    def pct(p):
        return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]
    return {"mean": statistics.fmean(v), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_s": stats([r.ttft_s for r in ok]),
        "tpot_s": stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": stats([x for r in ok for x in r.itl_s]),
        "e2e_s": stats([r.e2e_s for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def print_summary(s: dict, label: str) -> None:
    title = f" serving benchmark {label} ".center(60, "=")
    print(title)
    print(f"{'completed / failed':<34}{s['completed']} / {s['failed']}")
    print(f"{'duration (s)':<34}{s['duration_s']:.2f}")
    print(f"{'input / output tokens':<34}{s['input_tokens']} / {s['output_tokens']}")
    print(f"{'request throughput (req/s)':<34}{s['request_throughput']:.3f}")
    print(f"{'output token throughput (tok/s)':<34}{s['output_token_throughput']:.1f}")
    print(f"{'total token throughput (tok/s)':<34}{s['total_token_throughput']:.1f}")
    print(f"{'(ms)':<14}{'mean':>11}{'p50':>11}{'p90':>11}{'p99':>11}")
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"),
                      ("e2e_s", "E2E")):
        row = s[key]
        cells = "".join(f"{1000 * row[k]:>11.1f}" if row[k] is not None else f"{'-':>11}"
                        for k in ("mean", "p50", "p90", "p99"))
        print(f"{name:<14}{cells}")
    for err in s["errors"]:
        print(f"error: {err}")
    print("=" * len(title))


def run(ns: argparse.Namespace) -> int:
    if ns.num_prompts < 1 or ns.random_input_len < 1 or ns.random_output_len < 1:
        raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if not 0 <= ns.random_range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    try:
        if float(ns.request_rate) <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"--request-rate {ns.request_rate!r}: a positive number or inf") from None
    results, duration = asyncio.run(run_benchmark(ns))
    summary = summarize(results, duration)
    print_summary(summary, ns.label)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"label": ns.label, "config": {k: v for k, v in vars(ns).items()
                                                     if k != "run"},
                       "summary": summary, "requests": [asdict(r) for r in results]}, f,
                      indent=2)
    return 0 if summary["completed"] else 1
