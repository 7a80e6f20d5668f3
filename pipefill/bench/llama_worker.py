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
    a = ap.parse_args()
    try:
        from llama_cpp import Llama
        llm = Llama(a.model, n_ctx=a.n_ctx, n_threads=a.threads, n_threads_batch=a.threads,
                    n_batch=2048, n_ubatch=512, verbose=False)
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
        return {"nll": mean_nll(llm, ids), "tokens": len(ids) - 1}
    return {"error": f"unknown op {req['op']!r}"}


NLL_PIECE = 512  # tokens a decode call scores: their float32 logits, 512 MiB at 262K words


def mean_nll(llm, ids: list) -> float:
    """Mean -log p(ids[t] | ids[:t]) over t >= 1, from every row's logits, a piece of the
    prompt at a time. Llama.eval under logits_all would copy every row's logits into a table
    of n_ctx rows (4 GiB for 4K tokens of a 262K-word vocabulary) beside llama.cpp's own
    buffer of n_batch rows (2 GiB); decoding pieces of NLL_PIECE tokens (llama.cpp's
    n_ubatch, so it computes what one eval would) and reducing each piece's rows at once
    holds one piece's."""
    import numpy as np  # a dependency of llama-cpp-python

    llm._ctx.kv_cache_clear()  # reset() keeps llama.cpp's cache; decode below does not clear it
    total, n_vocab = 0.0, llm.n_vocab()
    for start in range(0, len(ids) - 1, NLL_PIECE):
        piece = ids[start:start + NLL_PIECE]
        llm._batch.set_batch(batch=piece, n_past=start, logits_all=True)
        llm._ctx.decode(llm._batch)
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(piece), n_vocab))
        targets = ids[start + 1:start + 1 + len(piece)]  # the piece's last row may have none
        rows = logits[:len(targets)].astype(np.float64)
        top = rows.max(axis=1)
        log_z = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
        total += float((log_z - rows[np.arange(len(targets)), targets]).sum())
    llm.n_tokens = 0  # nothing this request computed is kept for the next one
    return total / (len(ids) - 1)


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
