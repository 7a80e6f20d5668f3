"""`pipefill bench multiturn`: one long chat about a shared document, as a real chat client
sends it, against any OpenAI-compatible server (pipefill, vLLM, SGLang).

Turn 1 sends a system prompt, the document (--doc-tokens, about 6,000 by default) and the first
question (--question-tokens); every later turn re-sends the whole history (document, earlier
questions, the server's own answers) plus a new question. Answers are --answer-tokens long
(greedy; `ignore_eos` so every answer has the same length). A server with a prefix cache
prefills only the new tokens of turns 2..N, so their TTFT falls far below turn 1's.

Printed per turn: prompt tokens (the server's count), cached tokens (when the server reports
usage.prompt_tokens_details.cached_tokens), TTFT (request sent -> first streamed content),
TTFT / TTFT of turn 1, end-to-end time. Text is generated from --seed, so two runs with the
same flags send the same document and questions; --replay FILE (a --json output) also re-sends
that run's answers, so the history is byte-identical even if the server now answers otherwise
(e.g. to measure a restarted server's storage tier against the recorded cold turn 1).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

from pipefill.base.platform import cpu_name

# Measured with the default model's tokenizer (SmolLM2) on text from make_text(): 1.24 tokens
# per word (seeds 0-4, 2,000 and 8,000 words, 1.226-1.256). Other tokenizers differ by some
# percent; the printout gives the server's own counts.
TOKENS_PER_WORD = 1.24

_WORDS = """
the a of and to in is that for on with as by at from this which be are was it its an or
not have has had but their they can will may more than also into over such these between
system data model time process value energy river city market system network signal
pressure water light memory layer page token record archive harbor engine valve circuit
measure sample report period region council library bridge railway canal winter summer
north south east west ancient modern early late small large careful rapid quiet bright
early central local national public private simple complex stable open closed narrow wide
committee engineer farmer merchant teacher student captain doctor author painter builder
observed described recorded measured built opened closed moved carried changed reached
followed increased reduced produced supported replaced studied noted found kept held
because although while after before during within without until unless whether where
copper timber grain salt wool iron glass paper stone cotton silver coal oil clay brick
""".split()
_NAMES = ["Arden", "Belmont", "Corvin", "Dalby", "Esker", "Fenwick", "Galloway", "Harwell",
          "Islay", "Jarrow", "Kelso", "Lindum", "Moray", "Norwood", "Orrin", "Pellam"]


def add_parser(sub) -> None:
    p = sub.add_parser("multiturn", help="multi-turn chat TTFT against an OpenAI-compatible "
                       "server (prefix cache benchmark)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--doc-tokens", type=int, default=6000,
                   help="approximate tokens of the shared document (default model's tokenizer)")
    p.add_argument("--turns", type=int, default=8, help="questions asked, one per turn")
    p.add_argument("--question-tokens", type=int, default=200,
                   help="approximate tokens of each question")
    p.add_argument("--answer-tokens", type=int, default=None,
                   help="max_tokens of each answer (default 64, or the replayed run's)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (for servers that reject unknown fields); "
                        "answers may then end early")
    p.add_argument("--seed", type=int, default=0, help="seed of the document and questions")
    p.add_argument("--replay", metavar="FILE",
                   help="a --json file of an earlier run: re-send its document, questions and "
                        "answers exactly, and compare with its turn 1 too")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per request")
    p.add_argument("--label", default="", help="a name for this run in the printout and JSON")
    p.add_argument("--json", metavar="FILE", help="write the per-turn results and the "
                   "conversation here")
    p.set_defaults(run=run)


# ---- text ------------------------------------------------------------------------------------

def make_text(rng: random.Random, num_words: int) -> str:
    """Deterministic prose-like paragraphs of about num_words words."""
    paragraphs, words = [], 0
    while words < num_words:
        sentences = []
        for _ in range(rng.randint(3, 7)):
            if words >= num_words:
                break
            n = rng.randint(8, 20)
            w = [rng.choice(_NAMES) if rng.random() < 0.08 else rng.choice(_WORDS)
                 for _ in range(n)]
            if rng.random() < 0.15:
                w.insert(rng.randrange(n), str(rng.randint(2, 1990)))
            sentences.append(" ".join([w[0].capitalize(), *w[1:]]) + ".")
            words += len(w)
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs)


def words_for(tokens: int) -> int:
    return max(1, round(tokens / TOKENS_PER_WORD))


@dataclass
class Conversation:
    system: str
    document: str
    questions: list[str]
    answers: list[str | None]     # recorded answers to re-send (--replay), else None

    @staticmethod
    def generate(seed: int, doc_tokens: int, turns: int, question_tokens: int) -> Conversation:
        rng = random.Random(seed)
        document = make_text(rng, words_for(doc_tokens))
        q_words = max(1, words_for(question_tokens) - 20)   # the framing is ~20 words' worth
        questions = [f"Question {k + 1}: {make_text(rng, q_words)}\n"
                     "Which parts of the document above relate to this? Answer briefly."
                     for k in range(turns)]
        system = "You are a careful assistant. Answer questions about the document."
        return Conversation(system, document, questions, [None] * turns)

    def messages(self, turn: int, answers: list[str]) -> list[dict]:
        """The whole history a chat client sends at `turn` (0-based)."""
        msgs = [{"role": "system", "content": self.system},
                {"role": "user", "content": f"Document:\n\n{self.document}\n\n"
                                            f"{self.questions[0]}"}]
        for k in range(1, turn + 1):
            msgs.append({"role": "assistant", "content": answers[k - 1]})
            msgs.append({"role": "user", "content": self.questions[k]})
        return msgs


# ---- one turn --------------------------------------------------------------------------------

@dataclass
class TurnResult:
    turn: int
    ok: bool = False
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    answer: str = ""


def chat_turn(client, url: str, headers: dict, body: dict, turn: int,
              timeout: float) -> TurnResult:
    res = TurnResult(turn)
    parts = []
    t0 = time.perf_counter()
    try:
        with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {r.read()[:300]!r}"
                return res
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    res.error = str(data["error"])
                    return res
                _read_usage(res, data.get("usage"))
                delta = (data.get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content"):   # the role-only first chunk is not a token
                    if res.ttft_s is None:
                        res.ttft_s = time.perf_counter() - t0
                    parts.append(delta["content"])
        res.e2e_s = time.perf_counter() - t0
        res.answer = "".join(parts)
        res.ok = res.ttft_s is not None
        if not res.ok:
            res.error = "the stream carried no content"
    except Exception as e:  # noqa: BLE001 - a failed turn is reported, the run goes on
        res.error = f"{type(e).__name__}: {e}"
    return res


def _read_usage(res: TurnResult, usage: dict | None) -> None:
    if not usage:
        return
    res.prompt_tokens = usage.get("prompt_tokens")
    res.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        res.cached_tokens = details["cached_tokens"]


# ---- the run ---------------------------------------------------------------------------------

def run_conversation(ns, conv: Conversation) -> list[TurnResult]:
    import httpx
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    base = ns.base_url.rstrip("/")
    results, answers = [], []
    with httpx.Client(timeout=ns.timeout) as client:
        model = ns.model or _first_model(client, base, headers)
        for turn in range(len(conv.questions)):
            body = {"model": model, "messages": conv.messages(turn, answers),
                    "max_tokens": ns.answer_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            if not ns.no_ignore_eos:
                body["ignore_eos"] = True
            res = chat_turn(client, base + "/v1/chat/completions", headers, body, turn + 1,
                            ns.timeout)
            results.append(res)
            print(_row(res, results[0]), flush=True)
            if not res.ok:
                break       # the next turn's history would be wrong
            recorded = conv.answers[turn]
            answers.append(recorded if recorded is not None else res.answer)
    return results


def _first_model(client, base: str, headers: dict) -> str:
    r = client.get(base + "/v1/models", headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"{base}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    return r.json()["data"][0]["id"]


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _row(res: TurnResult, first: TurnResult) -> str:
    if not res.ok:
        return f"{res.turn:>4}  failed: {res.error}"
    ratio = res.ttft_s / first.ttft_s if first.ok else None
    return (f"{res.turn:>4} {_fmt(res.prompt_tokens, ',d'):>8} {_fmt(res.cached_tokens, ',d'):>8}"
            f" {res.ttft_s:>9.3f} {_fmt(ratio, '.3f'):>9} {res.e2e_s:>8.3f}")


HEADER = f"{'turn':>4} {'prompt':>8} {'cached':>8} {'TTFT s':>9} {'/turn 1':>9} {'E2E s':>8}"



def summary(results: list[TurnResult], recorded_turn1: float | None) -> dict:
    ok = [r for r in results if r.ok]
    out = {"turns_ok": len(ok), "turns": len(results)}
    if ok and results[0].ok:
        t1 = results[0].ttft_s
        out["ttft_turn1_s"] = t1
        later = [r.ttft_s for r in ok[1:]]
        if later:
            out["ttft_later_mean_s"] = sum(later) / len(later)
            out["ratio_later_mean_to_turn1"] = out["ttft_later_mean_s"] / t1
            out["ratio_turn2_to_turn1"] = ok[1].ttft_s / t1
    if recorded_turn1 and len(ok) > 1:
        out["ratio_later_mean_to_recorded_turn1"] = (
            sum(r.ttft_s for r in ok[1:]) / (len(ok) - 1) / recorded_turn1)
    return out


def load_replay(ns) -> tuple[Conversation, float | None]:
    """The recorded conversation with its answers, and the recorded turn-1 TTFT."""
    try:
        with open(ns.replay) as f:
            old = json.load(f)
        conv = Conversation(**old["conversation"])
        conv.answers = [t["answer"] for t in old["results"] if t["ok"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--replay {ns.replay}: not a multiturn --json file ({e})") from None
    if not conv.answers:
        raise ValueError(f"--replay {ns.replay}: the recorded run has no successful turn")
    conv.questions = conv.questions[:len(conv.answers)]
    ns.answer_tokens = ns.answer_tokens or old.get("settings", {}).get("answer_tokens")
    return conv, old["results"][0]["ttft_s"]


def run(ns) -> int:
    for flag in ("doc_tokens", "turns", "question_tokens", "answer_tokens"):
        if getattr(ns, flag) is not None and getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if ns.replay:
        conv, recorded_turn1 = load_replay(ns)
        what = f"replaying {ns.replay}"
    else:
        conv = Conversation.generate(ns.seed, ns.doc_tokens, ns.turns, ns.question_tokens)
        recorded_turn1 = None
        what = f"document ~{ns.doc_tokens:,} tokens, questions ~{ns.question_tokens}"
    ns.answer_tokens = ns.answer_tokens or 64
    print(f"multiturn {ns.label} {ns.base_url}: {len(conv.questions)} turns, {what}, answers "
          f"{ns.answer_tokens} tokens; client CPU {cpu_name()}")
    print(HEADER)
    results = run_conversation(ns, conv)
    summ = summary(results, recorded_turn1)
    print("summary: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                  for k, v in summ.items()))
    if ns.json:
        with open(ns.json, "w") as f:
            settings = {k: getattr(ns, k) for k in ("doc_tokens", "question_tokens",
                                                     "answer_tokens", "seed", "replay")}
            json.dump({"label": ns.label, "base_url": ns.base_url, "cpu": cpu_name(),
                       "settings": settings, "summary": summ,
                       "results": [asdict(r) for r in results],
                       "conversation": asdict(conv)}, f, indent=1)
    return 0 if results and all(r.ok for r in results) else 1
