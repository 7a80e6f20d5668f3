"""The two-node helpers of pipefill/bench/netdelay.py that `bench link`, `bench tp-vs-pp` and
the multi-node tests share: a killed run's namespaces are deleted on SIGTERM and SIGINT (and
by the next run where it was killed outright), without root through the cleanup and the pure
choice of stale names, with root on real namespaces."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pipefill.bench import netdelay
from pipefill.bench.netdelay import (NodePair, add_namespaces, delete_namespaces, pid_alive,
                                     stale_namespaces)

PREFIX = "pft"  # no bench uses it: a run of the lead's benches is never touched

# A process that holds `deleted_on_signals` (or namespaces) until a signal ends it; SIGINT
# raises KeyboardInterrupt as in a terminal, even where the test runner's parent ignores it.
# netdelay.py imports only the standard library (it runs alone as the forwarder): the child
# loads it by path, without pipefill's package (torch), to start in a fraction of a second.
CHILD = """
import importlib.util, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
spec = importlib.util.spec_from_file_location("netdelay", sys.argv[3])
netdelay = sys.modules["netdelay"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(netdelay)
if sys.argv[1] == "cleanup":
    block = netdelay.deleted_on_signals(lambda: open(sys.argv[2], "w").write("cleaned"))
else:
    block = netdelay.namespaces(netdelay.NodePair.of_this_process(sys.argv[2], "v", "10.83.0"))
with block:
    print("ready", flush=True)
    time.sleep(120)
"""


def held_until(signum: int, *args: str) -> tuple[int, int]:
    """Starts CHILD with args, sends it `signum` once it holds its block: (its pid, its exit
    status)."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, *args, netdelay.__file__],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        child.send_signal(signum)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.pid, child.returncode


def test_stale_namespaces_are_those_of_gone_runs_of_the_prefix():
    listed = ["ptv101a", "ptv101b", "ptv202a", "ptv202b", "pfl101a", "ptvxa", "ptv303c",
              "ptv404", "other"]
    alive = {202}.__contains__
    assert stale_namespaces(listed, "ptv", alive) == ["ptv101a", "ptv101b"]
    assert stale_namespaces(["pf101a", "pfl101a"], "pf", lambda pid: False) == ["pf101a"]
    assert stale_namespaces(listed, "", lambda pid: False) == []
    # A run's own names carry its whole pid: this process runs, so they are not stale.
    pair = NodePair.of_this_process("ptv", "v", "10.81.0")
    assert stale_namespaces(list(pair.ns), "ptv", pid_alive) == []
    assert stale_namespaces(list(pair.ns), "ptv", lambda pid: pid != os.getpid()) == \
        list(pair.ns)
    longest_pid = len(str(2**22))  # Linux's largest pid_max
    assert max(map(len, pair.iface)) - len(str(os.getpid())) + longest_pid <= 15  # IFNAMSIZ - 1


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 128 + signal.SIGTERM),
                                            (signal.SIGINT, -signal.SIGINT)])
def test_a_signal_runs_the_cleanup(tmp_path, signum, status):
    """SIGTERM, whose default would end the process without its finally blocks, and SIGINT
    both run the cleanup; the exit status still says the signal (143; SIGINT's, re-raised by
    Python after the KeyboardInterrupt)."""
    mark = tmp_path / "cleaned"
    _, code = held_until(signum, "cleanup", str(mark))
    assert mark.read_text() == "cleaned"
    assert code == status


def namespaces_here() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture
def root_namespaces():
    """Skips where network namespaces cannot be made (no root, no iproute2)."""
    probe = (f"{PREFIX}probe{os.getpid()}",)
    reason = add_namespaces(probe)
    delete_namespaces(probe)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_killed_run_leaves_no_namespaces_and_the_next_deletes_a_lost_one(root_namespaces,
                                                                         signum):
    """With root: a run's namespaces go when a signal ends it; those of a run killed outright
    (SIGKILL: nothing of it runs) are deleted by the next run of the same prefix, whose own go
    too; another prefix's are left alone."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    lost = (f"{PREFIX}{gone.stdout.strip()}a", f"{PREFIX}{gone.stdout.strip()}b")
    other = (f"{PREFIX}x{gone.stdout.strip()}a",)
    assert add_namespaces(lost + other) is None
    try:
        pid, _ = held_until(signum, "namespaces", PREFIX)
        left = namespaces_here()
        assert not (set(lost) | {f"{PREFIX}{pid}a", f"{PREFIX}{pid}b"}) & left
        assert set(other) <= left
    finally:
        delete_namespaces(lost + other)
