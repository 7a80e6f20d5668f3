"""`--peer llama.cpp` of `pipefill bench prefill|decode` (bench/llama_peer.py and the worker it
runs, bench/llama_worker.py).

* Without llama-cpp-python anywhere it looks, the bench stops with exit 2 and a sentence that
  names the flag to fix it, before any stage starts; a model that is not a GGUF file likewise.
* The worker run by a Python without llama_cpp answers with an error line, not a traceback,
  and the client turns it into the same kind of sentence.
* With llama-cpp-python installed (the shared peer setup's venv, or PIPEFILL_LLAMA_PYTHON),
  the real llama.cpp on the default GGUF file: a prefill, greedy decode steps (the second
  request at the same context rewinds instead of prefilling again), a mean negative
  log-likelihood a real model gives a real sentence, and the bench line with its ratio.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pipefill.bench.llama_peer import LlamaPeer, PeerError, can_import_llama, peer_python
from pipefill.cli.main import main
from pipefill.model.loader import resolve_model_path

HAS_HERE = can_import_llama(sys.executable)


def llama_python() -> str | None:
    try:
        return peer_python(None)
    except PeerError:
        return None


@pytest.mark.skipif(HAS_HERE, reason="this Python has llama_cpp")
def test_a_python_without_llama_cpp_is_a_sentence_naming_the_flag(capsys):
    with pytest.raises(PeerError, match="install it .* or name that Python with --peer-python"):
        peer_python(sys.executable)
    assert main(["bench", "prefill", "--input-len", "64", "--reps", "1", "--no-hf", "--no-split",
                 "--peer", "llama.cpp", "--peer-python", sys.executable]) == 2
    err = capsys.readouterr().err
    assert "error: --peer llama.cpp needs a Python with llama-cpp-python" in err
    assert "Traceback" not in err


def test_a_model_that_is_not_gguf_is_refused(tmp_path):
    with pytest.raises(PeerError, match="runs GGUF files; .* is not one"):
        LlamaPeer(str(tmp_path), 1, 128, sys.executable)


@pytest.mark.skipif(HAS_HERE, reason="this Python has llama_cpp")
def test_the_worker_without_llama_cpp_answers_with_an_error_line():
    from pipefill.bench.llama_peer import WORKER
    out = subprocess.run([sys.executable, str(WORKER), resolve_model_path(None), "--threads",
                          "1", "--n-ctx", "64"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout.startswith('{"error": "llama.cpp could not load')
    assert "Traceback" not in out.stderr
    with pytest.raises(PeerError, match="llama.cpp could not load"):
        LlamaPeer(resolve_model_path(None), 1, 64, sys.executable)


needs_llama = pytest.mark.skipif(llama_python() is None,
                                 reason="llama-cpp-python is not installed where the peer looks")


@needs_llama
def test_the_real_llama_cpp_prefills_decodes_and_scores():
    peer = LlamaPeer(resolve_model_path(None), 2, 512, llama_python())
    try:
        ids = [100 + (37 * i) % 20000 for i in range(300)]
        assert peer.prefill_seconds(ids) > 0
        first = peer.decode_ms_per_token(ids, 4)
        again = peer.decode_ms_per_token(ids, 4)  # rewinds to the same context
        assert first > 0 and again > 0
        text = peer_tokens_of_a_sentence()
        nll = peer.mean_nll(text)
        assert 0 < nll < math.log(peer.n_vocab)  # a real model beats a uniform guess
    finally:
        peer.close()


CHECK_PIECES = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import llama_worker
from llama_cpp import Llama
ids = json.loads(sys.argv[3])
every = Llama(sys.argv[2], n_ctx=len(ids) + 8, n_threads=2, n_batch=2048, n_ubatch=512,
              logits_all=True, verbose=False)
every.eval(ids)
rows = np.asarray(every.scores[:len(ids) - 1], dtype=np.float64)
top = rows.max(axis=1)
log_z = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
whole = float((log_z - rows[np.arange(len(ids) - 1), ids[1:]]).mean())
llm = Llama(sys.argv[2], n_ctx=len(ids) + 8, n_threads=2, n_batch=2048, n_ubatch=512,
            verbose=False)
llm.eval(ids[:100])  # a cache that holds something already
print(json.dumps([whole, llama_worker.mean_nll(llm, ids), llama_worker.mean_nll(llm, ids)]))
"""


@needs_llama
@pytest.mark.slow
def test_the_nll_in_pieces_is_every_rows_logits_at_once():
    """The worker scores a prompt NLL_PIECE tokens at a time (a 262K-word vocabulary's
    logits of every row do not fit): the same mean as llama.cpp's logits of every row in
    one eval, over a prompt of three pieces (the last one partial), twice in a row."""
    from pipefill.bench import llama_worker
    ids = peer_tokens_of_a_sentence() * 60
    assert 2 * llama_worker.NLL_PIECE < len(ids) < 3 * llama_worker.NLL_PIECE
    out = subprocess.run([llama_python(), "-c", CHECK_PIECES, str(Path(llama_worker.__file__)
                                                                   .parent),
                          resolve_model_path(None), json.dumps(ids)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    whole, pieces, again = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0 < whole < math.log(49152)
    assert abs(pieces - whole) < 1e-4 * whole and pieces == again


def peer_tokens_of_a_sentence() -> list[int]:
    from pipefill.model.loader import WeightSource
    from pipefill.model.tokenizer import load_tokenizer
    tok = load_tokenizer(WeightSource(resolve_model_path(None)))
    return tok.encode("The capital of France is Paris. The capital of Italy is Rome. The "
                      "capital of Spain is Madrid.")


@needs_llama
@pytest.mark.slow
def test_bench_prefill_prints_the_llama_cpp_column(capsys):
    assert main(["bench", "prefill", "--input-len", "128", "--reps", "1", "--no-hf",
                 "--no-split", "--peer", "llama.cpp", "--peer-python", llama_python()]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp TTFT" in out and "pipefill/llama.cpp" in out
