"""Hostile bytes: a real `pipefill serve` run as two nodes on 127.0.0.1 (PP2, so the
multi-node TCP control port exists), then a pickle whose unpickling would create a file, and
random bytes, sent to every TCP port any of its processes listens on — as raw TCP and as a ZMQ
message (what reached the unpickler before). Nothing may be created, every process must stay
up, and the server must answer as before."""
from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time

import httpx
import pytest
import zmq

from conftest import save_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class _MakesFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from pipefill.model.loader import WeightSource, resolve_model_path
    from pipefill.model.tokenizer import load_tokenizer
    path = save_tiny_model("llama", tmp_path_factory.mktemp("chat"), vocab_size=49152,
                           max_position_embeddings=4096)
    load_tokenizer(WeightSource(resolve_model_path(None))).hf.save_pretrained(path)
    return path


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(p) for p in out.split()]
    return kids + [d for k in kids for d in descendants(k)]


def listening_ports(pids: list[int]) -> dict[int, int]:
    """{port: pid} of every TCP socket in LISTEN state that one of pids holds."""
    owner = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    ports = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in owner:  # 0A = LISTEN
                    ports[int(cols[1].rsplit(":", 1)[1], 16)] = owner[cols[9]]
    return ports


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def send_raw(port: int, data: bytes) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(data)
            time.sleep(0.05)
    except OSError:
        pass  # a receiver that hangs up on garbage is fine


def send_zmq(port: int, frames: list[bytes]) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.connect(f"tcp://127.0.0.1:{port}")
    for f in frames:
        try:
            s.send(f, zmq.NOBLOCK)
        except zmq.Again:
            pass  # not a ZMQ peer: the handshake never completed
    time.sleep(0.2)
    s.close(linger=500)
    ctx.term()


def attack(ports, payload: bytes) -> None:
    for port in ports:
        send_zmq(port, [payload, os.urandom(512), pickle.dumps(("fatal", "pwned"))])
        send_raw(port, payload)
        send_raw(port, os.urandom(4096))


def test_hostile_bytes_to_a_pp2_engine(tmp_path):
    """Fast variant, one node: the stages' TCP ports (torch's rendezvous store, gloo's pair
    listeners) and the front end's ipc:// events socket."""
    from conftest import track
    from pipefill import Engine
    model = save_tiny_model("llama", tmp_path / "m")
    prompt = [(7 * i) % 512 for i in range(40)]
    with track(Engine(model, dtype="float32", page_size=16, chunked_prefill_size=16,
                      pp_size=2, threads_per_stage=1)) as e:
        before = e.generate([prompt], max_new_tokens=8, ignore_eos=True)[0].output_ids
        pids = [p.pid for p in e._stages.procs]
        ports = listening_ports(pids)
        assert ports, "the stages listen on no TCP port?"
        marker = tmp_path / "pwned"
        payload = pickle.dumps(("add", _MakesFile(str(marker))))
        attack(ports, payload)
        events = e._stages.channel.addrs.events
        ctx = zmq.Context()
        s = ctx.socket(zmq.PUSH)
        s.connect(events)
        for frame in (payload, os.urandom(512), pickle.dumps(("fatal", "pwned"))):
            s.send(frame)
        s.close(linger=2000)
        ctx.term()
        assert e.generate([prompt], max_new_tokens=8, ignore_eos=True)[0].output_ids == before
        assert all(alive(pid) for pid in pids)
        assert not marker.exists()
        assert e._stages.channel.framer.drops.num_dropped >= 3


def serve(model, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "pipefill.cli.main", "serve", "--model-path", model,
         "--pp-size", "2", "--nnodes", "2", "--dtype", "float32", "--page-size", "16",
         "--chunked-prefill-size", "64", "--threads-per-stage", "1", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def complete(url: str) -> str:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": list(range(300, 340)), "max_tokens": 12, "temperature": 0,
        "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


@pytest.mark.slow
def test_hostile_bytes_to_every_listening_port(chat_model, tmp_path):
    from pipefill.base.platform import free_port
    http, rendezvous = free_port(), free_port()
    common = ["--dist-init-addr", f"127.0.0.1:{rendezvous}", "--cluster-secret", "s3cret"]
    node1 = serve(chat_model, *common, "--node-rank", "1")
    node0 = serve(chat_model, *common, "--node-rank", "0", "--port", str(http))
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 180
        while True:
            for p in (node0, node1):
                assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "server did not become healthy"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        before = complete(url)
        pids = [node0.pid, node1.pid] + descendants(node0.pid) + descendants(node1.pid)
        ports = listening_ports(pids)
        assert http in ports and rendezvous + 1 in ports, ports  # HTTP, multi-node events
        marker = tmp_path / "pwned"
        payload = pickle.dumps(("add", _MakesFile(str(marker))))
        attack(ports, payload)
        time.sleep(1.0)  # let every receiver process what it got
        dead = [(pid, port) for port, pid in ports.items() if not alive(pid)]
        dead += [(pid, None) for pid in pids if not alive(pid)]
        assert not dead, f"processes died after hostile bytes (pid, port): {dead}"
        assert not marker.exists(), "a pickle sent to the server was executed"
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert complete(url) == before
    finally:
        for p in (node0, node1):
            p.terminate()
        for p in (node0, node1):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    log = node0.stdout.read()
    assert "dropped a message" in log  # the ZMQ pickle reached the events socket and was refused


@pytest.mark.slow
def test_a_node_with_the_wrong_secret_is_not_accepted(tmp_path):
    """Two-node generate where node 1 has another secret: its stage's join fails the HMAC
    check, so node 0 refuses to start with a sentence instead of serving with a stage whose
    reports it cannot trust."""
    from pipefill.base.platform import free_port
    model = save_tiny_model("llama", tmp_path / "m")
    common = ["generate", "--model-path", model, "--dtype", "float32", "--pp-size", "2",
              "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}",
              "--input-len", "20", "--max-new-tokens", "2", "--threads-per-stage", "1"]
    (tmp_path / "secret").write_text("right\n")

    def cli(*argv):
        return subprocess.Popen([sys.executable, "-m", "pipefill.cli.main", *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    node1 = cli(*common, "--node-rank", "1", "--cluster-secret", "wrong")
    node0 = cli(*common, "--node-rank", "0", "--cluster-secret-file", str(tmp_path / "secret"))
    try:
        out0 = node0.communicate(timeout=180)[0]
        node1.communicate(timeout=60)
    finally:
        for p in (node0, node1):
            p.kill()
    assert node0.returncode != 0
    assert "stage(s) 1 did not join" in out0 and "same --cluster-secret" in out0, out0
    assert "bad HMAC" in out0, out0
