"""Real multi-node (slow): two Linux network namespaces, one `pipefill generate` per namespace,
PP2 across them: the same tokens as PP1, and the TTFT of each printed, over two links:
- a veth pair at 10 Gbit/s (`tc tbf`), no added delay;
- a 1 ms one-way delay link (pipefill/bench/netdelay.py: TUN devices and a user-space forwarder,
  because `tc netem` is missing on some kernels), whose measured round trip and goodput are
  printed beside the TTFT.
A node that never joins fails with a sentence within --dist-init-timeout, on either side.
Skipped where namespaces (or TUN devices, for the delay link) are not permitted."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from conftest import save_tiny_model
from pipefill.bench.netdelay import (DelayLink, NodePair, add_veth, in_namespace, measure,
                                     namespaces)

pytestmark = pytest.mark.slow

VETH = NodePair.of_this_process("pf", "v", "10.77.0")  # the veth pair's ends
TUN = NodePair.of_this_process("pf", "t", "10.78.0")  # the delay link's, in the same namespaces
NS = VETH.ns
PORT = 29500 + os.getpid() % 1000
START_BOUND_S = 240  # start-up of two stage processes on a busy 2-core machine


def _shape_link() -> str:
    """10 Gbit/s each way on the veth pair. Returns what the link got."""
    for ns, iface in zip(VETH.ns, VETH.iface):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root",
                        "tbf", "rate", "10gbit", "burst", "1mb", "latency", "10ms"], check=True)
    return "veth, tbf 10gbit, no added delay"


@pytest.fixture(scope="module")
def netns():
    """The two namespaces joined by the veth pair (netdelay's helpers, as the benches build
    them); skipped where they cannot be made."""
    if shutil.which("tc") is None:
        pytest.skip("iproute2 (ip, tc) is not installed")
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(namespaces(VETH))
            add_veth(VETH)
        except (ValueError, RuntimeError) as e:
            pytest.skip(str(e))
        yield _shape_link()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("mn"))


@dataclass(frozen=True)
class Workload:
    model: str
    extra: tuple[str, ...]  # later flags override generate()'s defaults
    label: str


@pytest.fixture(scope="module", params=["tiny", "default"])
def workload(request) -> Workload:
    """The tiny model (960 tokens, chunks of 128), and the default model at 2,048 tokens in
    chunks of 256, where a few ms of link delay meet seconds of compute."""
    if request.param == "tiny":
        return Workload(request.getfixturevalue("model"), (), "tiny, 960 tokens, chunks of 128")
    return Workload("default", ("--input-len", "2048", "--chunked-prefill-size", "256"),
                    "default model, 2048 tokens, chunks of 256")


@pytest.fixture(scope="module", params=[0.0, 1.0], ids=["0ms", "1ms"])
def delay_link(netns, request):
    """The TUN link between the same namespaces, 10 Gbit/s, 0 ms (the forwarder's own cost,
    the baseline) or 1 ms one-way delay; yields the delay with what the link measured."""
    try:
        link = DelayLink(NS, TUN.iface, TUN.ip, delay_ms=request.param, rate_gbit=10.0).start()
    except (OSError, RuntimeError) as e:
        pytest.skip(f"no TUN delay link here: {e}")
    try:
        yield {"delay_ms": request.param, **measure(NS, TUN.ip[1], PORT + 7)}
    finally:
        link.stop()


def generate(node: int | None, model: str, *extra: str, out: str | None = None,
             link: NodePair = VETH) -> subprocess.Popen:
    """`pipefill generate` inside namespace `node` (None: PP1 in the first namespace), PP2
    over `link` (its interfaces and addresses)."""
    ifaces, ips = link.iface, link.ip
    ns, iface = (NS[0], ifaces[0]) if node is None else (NS[node], ifaces[node])
    argv = [sys.executable, "-m", "pipefill.cli.main", "generate", "--model-path", model,
            "--dtype", "float32", "--input-len", "960", "--max-new-tokens", "16",
            "--chunked-prefill-size", "128", "--threads-per-stage", "1", *extra]
    if node is not None:
        argv += ["--pp-size", "2", "--nnodes", "2", "--node-rank", str(node),
                 "--dist-init-addr", f"{ips[0]}:{PORT}"]
    if out:
        argv += ["--output-json", out]
    return subprocess.Popen(in_namespace(ns, iface, argv), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, within_s: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("no answer within the bound: a hang") from None
    return proc.returncode, out


@pytest.fixture(scope="module")
def pp1(netns, workload, tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("pp1") / "pp1.json")
    code, log = finish(generate(None, workload.model, *workload.extra, out=out), START_BOUND_S)
    assert code == 0, log
    return json.load(open(out))


def run_pp2(w: Workload, out: str, link: NodePair = VETH) -> dict:
    node1 = generate(1, w.model, *w.extra, link=link)
    code, log = finish(generate(0, w.model, *w.extra, out=out, link=link), START_BOUND_S)
    assert code == 0, log
    assert finish(node1, 60)[0] == 0
    return json.load(open(out))


def _ttft_ms(result: dict) -> float:
    return result["metrics"]["ttft_s"] * 1000


def test_pp2_across_two_namespaces_equals_pp1(netns, workload, pp1, tmp_path):
    pp2 = run_pp2(workload, str(tmp_path / "pp2.json"))
    assert pp2["prompt_ids"] == pp1["prompt_ids"]
    assert pp2["output_ids"] == pp1["output_ids"]
    print(f"\nlink: {netns}\nTTFT {workload.label}: PP1 {_ttft_ms(pp1):.1f} ms, "
          f"PP2 across namespaces {_ttft_ms(pp2):.1f} ms")


def test_pp2_over_the_delay_link_equals_pp1(delay_link, workload, pp1, tmp_path):
    pp2 = run_pp2(workload, str(tmp_path / "pp2d.json"), link=TUN)
    assert pp2["prompt_ids"] == pp1["prompt_ids"]
    assert pp2["output_ids"] == pp1["output_ids"]
    # The link really delays: a round trip cannot be shorter than two one-way delays.
    assert delay_link["rtt_ms"] >= 2 * delay_link["delay_ms"], delay_link
    print(f"\nlink: TUN forwarder, {delay_link['delay_ms']:g} ms each way, 10gbit limit; "
          f"measured RTT {delay_link['rtt_ms']:.2f} ms, goodput {delay_link['gbit_s']:.1f} "
          f"Gbit/s\nTTFT {workload.label}: PP1 {_ttft_ms(pp1):.1f} ms, PP2 over it "
          f"{_ttft_ms(pp2):.1f} ms")


@pytest.mark.parametrize("present", [0, 1])
def test_a_node_that_never_joins_is_a_sentence(netns, model, present):
    t0 = time.monotonic()
    code, log = finish(generate(present, model, "--dist-init-timeout", "10"),
                       10 + START_BOUND_S)
    assert code != 0
    assert "not every stage joined the rendezvous" in log and "--dist-init-timeout" in log, log
    print(f"\nnode {present} alone: error after {time.monotonic() - t0:.1f} s")
