"""`pipefill serve-pd` (slow): the three child processes come up with one cluster secret (a
0600 file, removed at exit), the printed router URL answers with the openai client, SIGTERM
stops all of them (no orphans), and a flag that serve-pd sets itself is refused with a
sentence."""
from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import sys
import time

import pytest

from test_pd_router import COMMON, chat_model, client, free_port  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(p) for p in out.split()]
    return kids + [d for k in kids for d in _descendants(k)]


@pytest.mark.slow
def test_serve_pd_serves_and_stops_everything(chat_model):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipefill.cli.main", "serve-pd", "--port", str(port),
         "--prefill-pp-size", "2", "--disaggregation-bootstrap-port", str(free_port()), "--",
         "--model-path", chat_model, "--page-size", "16", *COMMON],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        url, secrets = None, []
        deadline = time.monotonic() + 240
        while url is None:
            assert time.monotonic() < deadline and proc.poll() is None, "serve-pd never ready"
            line = proc.stdout.readline()
            if line.startswith(("serve-pd: prefill: ", "serve-pd: decode: ")):
                cmd = shlex.split(line.split(": ", 2)[2])
                secrets.append(cmd[cmd.index("--cluster-secret-file") + 1])
            if line.startswith("serve-pd: ready: "):
                url = line.split("ready: ", 1)[1].strip()
        assert url == f"http://127.0.0.1:{port}"
        assert len(secrets) == 2 and secrets[0] == secrets[1]
        assert stat.S_IMODE(os.stat(secrets[0]).st_mode) == 0o600
        out = client(url).completions.create(model="m", prompt="Hello", max_tokens=5,
                                             temperature=0)
        assert out.usage.completion_tokens == 5
        family = _descendants(proc.pid)
        assert len(family) >= 3 + 3  # prefill (+2 stages), decode (+1 stage), router
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not os.path.exists(secrets[0])
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in family):
            assert time.monotonic() < deadline, [p for p in family if _alive(p)]
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_serve_pd_refuses_flags_it_sets_itself(capsys):
    from pipefill.cli.main import main
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["serve-pd", "--", "--pp-size", "2"]) == 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "--pp-size is set by serve-pd itself" in capsys.readouterr().err


def test_serve_pd_passes_the_decode_pipeline_size_and_refuses_zero(capsys):
    from pipefill.cli.main import build_parser, main
    from pipefill.cli.serve_pd import commands
    ns = build_parser().parse_args(["serve-pd", "--prefill-pp-size", "2", "--decode-pp-size", "2"])
    prefill, decode, _, _ = commands(ns)
    assert prefill[prefill.index("--pp-size") + 1] == "2"
    assert decode[decode.index("--pp-size") + 1] == "2"
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["serve-pd", "--decode-pp-size", "0"]) == 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "--decode-pp-size must be at least 1" in capsys.readouterr().err
