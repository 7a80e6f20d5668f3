"""Real multi-node (slow): two Linux network namespaces joined by a veth pair (10 Gbit/s via
`tc tbf`), one `pipefill generate` per namespace, PP2 across them: the same tokens as PP1, and
the TTFT of both printed. A node that never joins fails with a sentence within
--dist-init-timeout, on either side. Skipped where namespaces are not permitted.

`tc netem` (the 1 ms delay) is not available on every kernel; where it is missing the link
has no added delay and the test says so in its output."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import save_tiny_model

pytestmark = pytest.mark.slow

TAG = f"pf{os.getpid() % 100000}"
NS = (f"{TAG}a", f"{TAG}b")
IFACE = (f"{TAG}va", f"{TAG}vb")
IP = ("10.77.0.1", "10.77.0.2")
PORT = 29500 + os.getpid() % 1000
START_BOUND_S = 240  # start-up of two stage processes on a busy 2-core machine


def _ip(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _setup() -> str | None:
    """Builds the two namespaces; returns a reason to skip, or None."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    r = _ip("netns", "add", NS[0])
    if r.returncode:
        return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
    steps = [("netns", "add", NS[1]),
             ("link", "add", IFACE[0], "type", "veth", "peer", "name", IFACE[1])]
    for ns, iface, ip in zip(NS, IFACE, IP):
        steps += [("link", "set", iface, "netns", ns),
                  ("-n", ns, "addr", "add", f"{ip}/24", "dev", iface),
                  ("-n", ns, "link", "set", iface, "up"), ("-n", ns, "link", "set", "lo", "up")]
    for step in steps:
        r = _ip(*step)
        if r.returncode:
            return f"`ip {' '.join(step)}` failed: {r.stderr.strip()}"
    return None


def _shape_link() -> str:
    """10 Gbit/s each way; 1 ms delay where netem exists. Returns what the link got."""
    got = []
    for ns, iface in zip(NS, IFACE):
        delay = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface,
                                "root", "netem", "delay", "1ms", "rate", "10gbit"],
                               capture_output=True, text=True)
        if delay.returncode == 0:
            got.append("netem 1ms 10gbit")
            continue
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root",
                        "tbf", "rate", "10gbit", "burst", "1mb", "latency", "10ms"], check=True)
        got.append(f"tbf 10gbit, no delay (netem: {delay.stderr.strip()})")
    return "; ".join(got)


@pytest.fixture(scope="module")
def netns():
    reason = _setup()
    if reason is not None:
        for ns in NS:
            _ip("netns", "del", ns)
        pytest.skip(reason)
    try:
        yield _shape_link()
    finally:
        for ns in NS:
            _ip("netns", "del", ns)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("mn"))


def generate(node: int | None, model: str, *extra: str, out: str | None = None
             ) -> subprocess.Popen:
    """`pipefill generate` inside namespace `node` (None: PP1 in the first namespace)."""
    ns, iface = (NS[0], IFACE[0]) if node is None else (NS[node], IFACE[node])
    argv = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={iface}", sys.executable,
            "-m", "pipefill.cli.main", "generate", "--model-path", model, "--dtype", "float32",
            "--input-len", "960", "--max-new-tokens", "16", "--chunked-prefill-size", "128",
            "--threads-per-stage", "1", *extra]
    if node is not None:
        argv += ["--pp-size", "2", "--nnodes", "2", "--node-rank", str(node),
                 "--dist-init-addr", f"{IP[0]}:{PORT}"]
    if out:
        argv += ["--output-json", out]
    # GLOO_SOCKET_IFNAME: inside a namespace the host name resolves to no address of it.
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, within_s: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("no answer within the bound: a hang") from None
    return proc.returncode, out


def test_pp2_across_two_namespaces_equals_pp1(netns, model, tmp_path):
    pp1_json, pp2_json = str(tmp_path / "pp1.json"), str(tmp_path / "pp2.json")
    code, log = finish(generate(None, model, out=pp1_json), START_BOUND_S)
    assert code == 0, log
    node1 = generate(1, model)
    code, log = finish(generate(0, model, out=pp2_json), START_BOUND_S)
    assert code == 0, log
    assert finish(node1, 60)[0] == 0
    pp1, pp2 = (json.load(open(p)) for p in (pp1_json, pp2_json))
    assert pp2["prompt_ids"] == pp1["prompt_ids"]
    assert pp2["output_ids"] == pp1["output_ids"]
    print(f"\nlink: {netns}\nTTFT 960 tokens, chunks of 128: PP1 "
          f"{pp1['metrics']['ttft_s'] * 1000:.1f} ms, PP2 across namespaces "
          f"{pp2['metrics']['ttft_s'] * 1000:.1f} ms")


@pytest.mark.parametrize("present", [0, 1])
def test_a_node_that_never_joins_is_a_sentence(netns, model, present):
    t0 = time.monotonic()
    code, log = finish(generate(present, model, "--dist-init-timeout", "10"),
                       10 + START_BOUND_S)
    assert code != 0
    assert "not every stage joined the rendezvous" in log and "--dist-init-timeout" in log, log
    print(f"\nnode {present} alone: error after {time.monotonic() - t0:.1f} s")
