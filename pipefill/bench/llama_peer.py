"""llama.cpp as a peer in `pipefill bench prefill|decode --peer llama.cpp`: the engine CPU users
run GGUF files with, on the same file and the same threads, timed in turn with pipefill.

llama.cpp comes from llama-cpp-python, usually in an environment of its own (it compiles
llama.cpp for the machine when installed). The peer runs `llama_worker.py` with that
environment's Python (--peer-python, or PIPEFILL_LLAMA_PYTHON, or ~/peers-work/llama-venv
where the shared peer setup puts it, or this Python if it has llama_cpp) and talks to it one
JSON line at a time, so the model stays loaded across repetitions and neither process imports
the other's packages.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("llama_worker.py")
DEFAULT_VENV_PYTHON = Path.home() / "peers-work" / "llama-venv" / "bin" / "python"


class PeerError(ValueError):
    """The peer cannot run: a sentence for the user (the CLI exits 2 with it)."""


def peer_python(explicit: str | None) -> str:
    """The Python that runs llama.cpp: the flag, the environment variable, the shared peer
    setup's venv, or this interpreter, the first that can import llama_cpp."""
    candidates = [explicit] if explicit else [
        os.environ.get("PIPEFILL_LLAMA_PYTHON"), str(DEFAULT_VENV_PYTHON), sys.executable]
    tried = []
    for python in filter(None, candidates):
        if can_import_llama(python):
            return python
        tried.append(python)
    raise PeerError("--peer llama.cpp needs a Python with llama-cpp-python installed "
                    f"(tried {', '.join(tried)}); install it (`pip install llama-cpp-python`) "
                    "or name that Python with --peer-python")


def can_import_llama(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class LlamaPeer:
    """One llama.cpp process holding the GGUF file, answering prefill, decode and nll
    requests (llama_worker.py)."""

    def __init__(self, gguf_path: str, threads: int, n_ctx: int, python: str):
        if not str(gguf_path).endswith(".gguf"):
            raise PeerError(f"--peer llama.cpp runs GGUF files; {gguf_path} is not one")
        cmd = [python, str(WORKER), str(gguf_path), "--threads", str(threads),
               "--n-ctx", str(n_ctx)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        hello = self._read()
        if not hello.get("ready"):
            self.close()
            raise PeerError(hello.get("error", "llama.cpp did not start"))
        self.version, self.n_vocab = hello["version"], hello["n_vocab"]

    def prefill_seconds(self, ids: list[int]) -> float:
        return self._ask({"op": "prefill", "ids": ids})["seconds"]

    def decode_ms_per_token(self, ids: list[int], steps: int) -> float:
        return self._ask({"op": "decode", "ids": ids, "steps": steps})["ms_per_token"]

    def mean_nll(self, ids: list[int]) -> float:
        return self._ask({"op": "nll", "ids": ids})["nll"]

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if "error" in out:
            raise RuntimeError(f"llama.cpp peer: {out['error']}")
        return out

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            return {"error": f"the llama.cpp process exited (code {self.proc.poll()})"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
