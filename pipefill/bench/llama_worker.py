"""llama.cpp's side of `--peer llama.cpp` (pipefill/bench/llama_peer.py starts it).

Run as a script by the Python of an environment with llama-cpp-python installed, which need
not have pipefill: it imports the standard library and llama_cpp only. It loads one GGUF file
and answers one JSON object per line on stdin with one JSON line on stdout:

  {"op": "prefill", "ids": [...]}              -> {"seconds": s}   a cold prefill, empty cache
  {"op": "decode", "ids": [...], "steps": n}   -> {"ms_per_token": t}   greedy steps after it
                                                  (the same ids again rewind to their end
                                                  instead of prefilling them again)
  {"op": "nll", "ids": [...]}                   -> {"nll": mean, "tokens": n}  of ids[1:]

Anything it cannot do is {"error": "sentence"}; it never dies on a bad line.
"""
import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--n-ctx", type=int, required=True)
    ap.add_argument("--logits-all", action="store_true", help="keep every row's logits (nll)")
    a = ap.parse_args()
    try:
        from llama_cpp import Llama
        llm = Llama(a.model, n_ctx=a.n_ctx, n_threads=a.threads, n_threads_batch=a.threads,
                    n_batch=2048, n_ubatch=512, logits_all=a.logits_all, verbose=False)
    except Exception as e:  # the client turns this into its own sentence
        reply({"error": f"llama.cpp could not load {a.model}: {e}"})
        return 1
    llm.eval(list(range(100, 164)))  # warm-up
    reply({"ready": True, "n_vocab": llm.n_vocab(), "version": version()})
    for line in sys.stdin:
        try:
            reply(answer(llm, json.loads(line)))
        except Exception as e:
            reply({"error": f"{type(e).__name__}: {e}"})
    return 0


HELD: list = []  # the ids whose KV the cache holds from the last decode request


def answer(llm, req: dict) -> dict:
    ids = req["ids"]
    if req["op"] == "decode":
        return decode(llm, ids, req["steps"])
    HELD.clear()
    llm.reset()
    if req["op"] == "prefill":
        t = time.perf_counter()
        llm.eval(ids)
        return {"seconds": time.perf_counter() - t}
    if req["op"] == "nll":
        import numpy as np  # a dependency of llama-cpp-python
        llm.eval(ids)
        rows = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)
        top = rows.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
        picked = rows[np.arange(len(ids) - 1), ids[1:]]
        return {"nll": float((log_z - picked).mean()), "tokens": len(ids) - 1}
    return {"error": f"unknown op {req['op']!r}"}


def decode(llm, ids: list, steps: int) -> dict:
    """Greedy steps after ids; the cache keeps ids between requests (llama.cpp drops the KV
    past n_tokens on its next eval), so a repetition at 8K of context costs no new prefill."""
    if HELD == ids:
        llm.n_tokens = len(ids)
    else:
        llm.reset()
        llm.eval(ids)
        HELD[:] = ids
    t = time.perf_counter()
    for _ in range(steps):
        llm.eval([llm.sample(temp=0.0)])
    return {"ms_per_token": (time.perf_counter() - t) / steps * 1e3}


def version() -> str:
    try:
        import llama_cpp
        return llama_cpp.__version__
    except Exception:
        return "unknown"


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
