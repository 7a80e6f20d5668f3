"""A user-space delay link between two network namespaces, for tests and benchmarks
(`pipefill bench link`) where `tc netem` is missing from the kernel.

Each namespace gets a point-to-point TUN device whose peer address is the other namespace's;
one forwarder process holds both TUN file descriptors and copies every IP packet from one
to the other after a fixed one-way delay, with a serialisation rate limit in front of it
(a packet leaves the "wire" len*8/rate after the previous one finished). The endpoints see
ordinary interfaces with ordinary addresses, so gloo, which connects peers directly by the
address of GLOO_SOCKET_IFNAME, works across it unchanged — a TCP relay would not.

The TUN devices are created in the forwarder's namespace (the root one) and then moved into
the node namespaces with `ip link set ... netns`: a TUN device keeps its open descriptor
across the move, so the forwarder needs no setns. The devices live as long as the forwarder:
stopping it takes the link down.

Run alone: `python -m pipefill.bench.netdelay TUN_A TUN_B --delay-ms 1 --rate-gbit 10` prints
"ready" once both devices exist, then forwards until killed."""
from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import json
import os
import re
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MTU = 65000  # large frames: the forwarder's cost is per packet, so fewer packets go faster
READ_SIZE = 65536


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


@dataclass
class Direction:
    """One way of the link: packets read from `src` wait in `queue` until due, then go to `dst`."""
    src: int
    dst: int
    queue: collections.deque
    busy_until: float = 0.0


def _take(d: Direction, now: float, delay_s: float, rate_bps: float) -> None:
    while True:
        try:
            pkt = os.read(d.src, READ_SIZE)
        except BlockingIOError:
            return
        d.busy_until = max(now, d.busy_until) + len(pkt) * 8 / rate_bps
        d.queue.append((d.busy_until + delay_s, pkt))


def _release(d: Direction, now: float) -> None:
    while d.queue and d.queue[0][0] <= now:
        try:
            os.write(d.dst, d.queue.popleft()[1])
        except OSError:  # the kernel refused it (queue full, device going down): a lost packet
            pass


def forward(fd_a: int, fd_b: int, delay_s: float, rate_bps: float) -> None:
    """Forwards both ways until killed. select() rather than epoll: its timeout has
    microsecond resolution, epoll's only millisecond, which would double a 1 ms delay."""
    dirs = [Direction(fd_a, fd_b, collections.deque()), Direction(fd_b, fd_a, collections.deque())]
    while True:
        now = time.monotonic()
        due = [d.queue[0][0] for d in dirs if d.queue]
        timeout = max(0.0, min(due) - now) if due else None
        readable, _, _ = select.select([fd_a, fd_b], [], [], timeout)
        now = time.monotonic()
        for d in dirs:
            if d.src in readable:
                _take(d, now, delay_s, rate_bps)
            _release(d, now)


@dataclass(frozen=True)
class NodePair:
    """Two network namespaces standing for two nodes, one interface and address each (the
    bench's TUN devices or veth ends): `pipefill bench link`, `pipefill bench tp-vs-pp` and
    the multi-node tests. `prefix`: what the names of every run of the same kind start with."""
    ns: tuple[str, str]
    iface: tuple[str, str]
    ip: tuple[str, str]
    prefix: str = ""

    @classmethod
    def of_this_process(cls, prefix: str, kind: str, subnet: str) -> NodePair:
        """Names that carry this process's whole id, so two runs at once do not collide and a
        run's leftovers name a process that can be asked whether it still runs (an interface
        name has at most 15 characters: a prefix of 3 leaves 5 to the pid's at most 7);
        addresses subnet.1 and subnet.2."""
        tag = f"{prefix}{os.getpid()}"
        return cls((f"{tag}a", f"{tag}b"), (f"{tag}{kind}a", f"{tag}{kind}b"),
                   (f"{subnet}.1", f"{subnet}.2"), prefix)


@contextlib.contextmanager
def namespaces(pair: NodePair):
    """The pair's namespaces for the with-block, deleted after it with what was moved into
    them (veth ends, TUN devices, qdiscs), also when SIGTERM or SIGINT ends the process; those
    that earlier runs of the same prefix left behind (killed outright) are deleted first. A
    ValueError with the reason where they cannot be created."""
    with deleted_on_signals(lambda: delete_namespaces(pair.ns)):
        remove_stale_namespaces(pair.prefix)
        reason = add_namespaces(pair.ns)
        if reason is not None:
            raise ValueError(f"cannot create network namespaces: {reason}")
        yield


@contextlib.contextmanager
def deleted_on_signals(cleanup):
    """Runs `cleanup` after the with-block however it ends: normally, by an exception, by
    SIGINT (Python's KeyboardInterrupt) or by SIGTERM, which here raises SystemExit(143) where
    it would end the process without a word. The cleanup itself runs with both signals
    ignored, so a second one does not cut it short. Signals are the main thread's: elsewhere
    only the exceptions are covered."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if main else None
    try:
        yield
    finally:
        if main:
            held = signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            cleanup()
        finally:
            if main:  # None: a handler not set from Python, left as it is
                for signum, handler in ((signal.SIGINT, held), (signal.SIGTERM, previous)):
                    if handler is not None:
                        signal.signal(signum, handler)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def stale_namespaces(listed: list[str], prefix: str, alive) -> list[str]:
    """The namespaces among `listed` (`ip netns list`'s names) that runs with this prefix
    left behind: named prefix + pid + a/b (NodePair.of_this_process) after a pid that
    `alive(pid)` says is gone. An empty prefix matches nothing."""
    if not prefix:
        return []
    name = re.compile(rf"{re.escape(prefix)}([0-9]+)[ab]")
    return [ns for ns in listed if (m := name.fullmatch(ns)) and not alive(int(m[1]))]


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one of another user counts). comm/shm.py has
    the same check; this file imports only the standard library, as it runs alone (the
    forwarder), so it keeps its own."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces(prefix: str) -> list[str]:
    """Deletes stale_namespaces of this prefix; the names deleted."""
    if shutil.which("ip") is None:
        return []
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    stale = stale_namespaces([line.split()[0] for line in out.splitlines() if line.strip()],
                             prefix, pid_alive)
    delete_namespaces(stale)
    return stale


def add_namespaces(names) -> str | None:
    """Creates network namespaces with their loopback up; a reason it cannot, or None. Needs
    root (CAP_SYS_ADMIN and CAP_NET_ADMIN)."""
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    for ns in names:
        for step in (("netns", "add", ns), ("-n", ns, "link", "set", "lo", "up")):
            r = subprocess.run(["ip", *step], capture_output=True, text=True)
            if r.returncode:
                return f"`ip {' '.join(step)}` is not permitted here: {r.stderr.strip()}"
    return None


def delete_namespaces(names) -> None:
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def add_veth(pair: NodePair) -> None:
    """A veth pair between the pair's namespaces (its interfaces), addresses /24, up."""
    _ip("link", "add", pair.iface[0], "type", "veth", "peer", "name", pair.iface[1])
    for ns, iface, ip in zip(pair.ns, pair.iface, pair.ip):
        _ip("link", "set", iface, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", iface)
        _ip("-n", ns, "link", "set", iface, "up")


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")


def in_namespace(ns: str, iface: str, argv: list[str]) -> list[str]:
    """argv run inside namespace `ns`, with gloo on `iface` (inside a namespace the host name
    resolves to no address of it)."""
    return ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={iface}", *argv]


def generate_argv(pair: NodePair, port: int, input_len: int, dtype: str, threads: int,
                  model_path: str | None, *extra: str) -> list[str]:
    """A one-token `pipefill generate` of `input_len` tokens over both nodes, node 0 the
    rendezvous (--node-rank is added per node), with room for the token (--max-model-len
    prompt + 1, so a prompt as long as the model's limit runs)."""
    argv = [sys.executable, "-m", "pipefill.cli.main", "generate", "--input-len", str(input_len),
            "--max-new-tokens", "1", "--max-model-len", str(input_len + 1), "--dtype", dtype,
            "--threads-per-stage", str(threads), *extra, "--nnodes", "2",
            "--dist-init-addr", f"{pair.ip[0]}:{port}"]
    return argv + (["--model-path", model_path] if model_path else [])


def start_on_node(pair: NodePair, node: int, argv: list[str]) -> subprocess.Popen:
    # Output into a file, not a pipe: the stage processes inherit it, and a full pipe would
    # block them while we wait for the other node.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(in_namespace(pair.ns[node], pair.iface[node], argv), stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


def finish_nodes(procs: list[subprocess.Popen], what: str, timeout_s: float) -> list[str]:
    """Each process's output once it ended; a RuntimeError with the end of a failed one's.
    Whatever still runs is killed either way."""
    outs = []
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
            p.log.seek(0)
            outs.append(p.log.read())
            if p.returncode:
                raise RuntimeError(f"{what} failed (exit {p.returncode}): {outs[-1][-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.log.close()
    return outs


def generate_across(pair: NodePair, argv: list[str], what: str, timeout_s: float) -> dict:
    """Runs generate_argv's command on both nodes: node 0's metrics (its --output-json)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        node1 = start_on_node(pair, 1, argv + ["--node-rank", "1"])
        node0 = start_on_node(pair, 0, argv + ["--node-rank", "0", "--output-json", out])
        finish_nodes([node0, node1], what, timeout_s)
        with open(out) as f:
            return json.load(f)["metrics"]


@dataclass
class DelayLink:
    """A running forwarder between namespaces `ns[0]` and `ns[1]` with addresses `ip`."""
    ns: tuple[str, str]
    names: tuple[str, str]
    ip: tuple[str, str]
    delay_ms: float
    rate_gbit: float
    proc: subprocess.Popen | None = None

    def start(self) -> DelayLink:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *self.names, "--delay-ms", str(self.delay_ms),
             "--rate-gbit", str(self.rate_gbit)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.stop()
            raise RuntimeError(f"the delay forwarder did not start: {line} "
                               f"{self.proc.stderr.read().strip()}")
        for i, j in ((0, 1), (1, 0)):
            for step in (("link", "set", self.names[i], "netns", self.ns[i]),
                         ("-n", self.ns[i], "addr", "add", self.ip[i], "peer", self.ip[j],
                          "dev", self.names[i]),
                         ("-n", self.ns[i], "link", "set", self.names[i], "mtu", str(MTU), "up")):
                r = subprocess.run(["ip", *step], capture_output=True, text=True)
                if r.returncode:
                    self.stop()
                    raise RuntimeError(f"`ip {' '.join(step)}` failed: {r.stderr.strip()}")
        return self

    def stop(self) -> None:
        """Ends the forwarder; its TUN devices disappear with it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> DelayLink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _serve(ip: str, port: int) -> None:
    """Probe server: per connection, b"e" then echo each byte, or b"s" then sink N bytes
    (an 8-byte length first) and answer one byte."""
    srv = socket.create_server((ip, port))
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            if conn.recv(1) == b"e":
                while (b := conn.recv(1)):
                    conn.sendall(b)
            else:
                left = struct.unpack("!Q", conn.recv(8, socket.MSG_WAITALL))[0]
                while left > 0:
                    left -= len(conn.recv(min(left, 1 << 20)))
                conn.sendall(b"k")


def _probe(ip: str, port: int, nbytes: int) -> None:
    """Prints the median TCP round trip (ms) of 50 one-byte ping-pongs, and the goodput
    (Gbit/s) of one `nbytes` transfer, as JSON."""
    with socket.create_connection((ip, port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(b"e")
        rtts = []
        for _ in range(50):
            t0 = time.perf_counter()
            c.sendall(b"x")
            c.recv(1)
            rtts.append((time.perf_counter() - t0) * 1000)
    with socket.create_connection((ip, port)) as c:
        block = bytes(1 << 20)
        t0 = time.perf_counter()
        c.sendall(b"s" + struct.pack("!Q", nbytes))
        for _ in range(nbytes >> 20):
            c.sendall(block)
        c.recv(1)
        gbit = nbytes * 8 / (time.perf_counter() - t0) / 1e9
    print(f'{{"rtt_ms": {statistics.median(rtts):.3f}, "gbit_s": {gbit:.3f}}}', flush=True)


def measure(ns: tuple[str, str], ip_b: str, port: int, nbytes: int = 256 << 20) -> dict:
    """RTT and goodput from namespace ns[0] to a probe server at ip_b in ns[1]."""
    srv = subprocess.Popen(["ip", "netns", "exec", ns[1], sys.executable, __file__, "--serve",
                            ip_b, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        srv.stdout.readline()
        out = subprocess.run(["ip", "netns", "exec", ns[0], sys.executable, __file__, "--probe",
                              ip_b, str(port), str(nbytes)],
                             capture_output=True, text=True, timeout=120)
        if out.returncode:
            raise RuntimeError(f"the link probe failed: {out.stderr.strip()}")
        return json.loads(out.stdout)
    finally:
        srv.kill()
        srv.wait()


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        return _serve(sys.argv[2], int(sys.argv[3]))
    if sys.argv[1:2] == ["--probe"]:
        return _probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tun_a")
    p.add_argument("tun_b")
    p.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay")
    p.add_argument("--rate-gbit", type=float, default=10.0, help="rate limit each way")
    a = p.parse_args()
    fd_a, fd_b = open_tun(a.tun_a), open_tun(a.tun_b)
    print("ready", flush=True)
    forward(fd_a, fd_b, a.delay_ms / 1000, a.rate_gbit * 1e9)


if __name__ == "__main__":
    main()
