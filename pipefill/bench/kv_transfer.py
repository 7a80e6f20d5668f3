"""`pipefill bench kv-transfer`: GB/s of prefill->decode KV page transfer per transport.

Workload: the KV of one --input-len prompt of the default model's shape (30 layers, 3 KV heads,
head dim 64, 64-token pages), sent by a prefill stage (KVSender, a separate process pinned to
the first of --cores) in --chunk-size token chunks, the way prefill streams it, into
pre-allocated pages of a decode (KVReceiver, this process, pinned to the second core): page ids
shuffled on both sides (free-list order) and/or consecutive (--layout); mooncake into shuffled
pages through the decode's staging region and/or one write per page per layer
(--mooncake-staging). Time: from telling the sender to start until the decode's room is ready.
Every page is checked. With --auth on, both ends share a cluster secret: the connection is
authenticated and every frame, and with tcp every chunk's page bytes, carries an HMAC-SHA256
(Mooncake's one-sided writes are not covered); --auth off,on measures both.

Baselines, measured in the same run: `raw tcp`, the same number of bytes streamed between the
same two pinned processes over one loopback socket in 4 MiB sends into one reused buffer (the
socket's ceiling); with mooncake also `raw mooncake`, the same bytes written by the sender's
transfer engine into the receiver's registered K tensor in 1 MiB blocks; `local copy`, the
same pages gathered and scattered inside one process (index_select + index_copy_) on the
receiver's core.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time

import torch

from pipefill.base.platform import cpu_name

PATTERN_LAYER = 1000  # page p of layer l holds p + 1000 * l (K) and its negative (V)
SECRET_ENV = "PIPEFILL_BENCH_KV_SECRET"  # the cluster secret, hex, handed to the sender process


def add_parser(sub) -> None:
    p = sub.add_parser("kv-transfer", help="prefill->decode KV transfer GB/s per transport",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=8192, help="prompt tokens whose KV moves")
    p.add_argument("--chunk-size", type=int, default=2048, help="tokens per sent chunk")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--backends", default="tcp,mooncake")
    p.add_argument("--reps", type=int, default=3, help="repetitions; each runs every case once, in turn (the median and the spread are reported)")
    p.add_argument("--cores", default="0,1", help="sender core,receiver core")
    p.add_argument("--layout", choices=("shuffled", "consecutive", "both"), default="both",
                   help="page ids on both sides: shuffled (free-list order, the worst case: "
                        "every page its own run), consecutive (a fresh pool), or both")
    p.add_argument("--mooncake-staging", choices=("on", "off", "both"), default="both",
                   help="mooncake into shuffled pages: through the decode's staging region "
                        "(on), one write per page per layer (off: the previous data path), or "
                        "both in one run")
    p.add_argument("--auth", default="off,on",
                   help="off (no cluster secret), on (a cluster secret: authenticated "
                        "connections, HMAC over frames and tcp page bytes), or off,on")
    p.add_argument("--json", metavar="FILE", help="write every number to this JSON file")
    p.set_defaults(run=run)




def pattern_kv(layers, pages, page_size, heads, dim, dtype, fill: bool):
    from pipefill.disagg.transfer import KVTensors
    shape = (layers, pages * page_size, heads, dim)
    k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    if fill:
        value = (torch.arange(pages).repeat_interleave(page_size)[None] +
                 PATTERN_LAYER * torch.arange(layers)[:, None]).to(dtype)  # [layers, slots]
        k.copy_(value[:, :, None, None].expand(shape))
        v.copy_(-value[:, :, None, None].expand(shape))
    return KVTensors(k, v, page_size, 0)


def page_order(pages: int, seed: int, contiguous: bool) -> list[int]:
    order = list(range(pages))
    if not contiguous:
        random.Random(seed).shuffle(order)
    return order


def sender_main(a: argparse.Namespace) -> None:
    """The prefill stage: registers, then sends a room's pages for each 'ROOM' line on stdin."""
    from pipefill.disagg import messages as m
    from pipefill.disagg.bootstrap import BootstrapServer, register_stage
    from pipefill.disagg.transfer_sender import KVSender
    os.sched_setaffinity(0, {a.core})
    torch.set_num_threads(1)
    pages = -(-a.input_len // a.page_size)
    kv = pattern_kv(a.layers, pages, a.page_size, a.kv_heads, a.head_dim,
                    getattr(torch, a.dtype), fill=True)
    secret = _secret()
    sender = KVSender(kv, 0, release=lambda room, p: None, backend=a.backend, secret=secret)
    service = BootstrapServer(port=0, secret=secret)
    register_stage(service.endpoint, sender.registration(
        pp_size=1, num_layers=a.layers, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
        model_fingerprint="bench"), secret=secret)
    print(service.endpoint.port, flush=True)
    per_chunk = max(1, a.chunk_size // a.page_size)
    for line in sys.stdin:
        if line.startswith("raw"):
            _, port, nbytes = line.split()
            _raw_send(int(port), int(nbytes))
            continue
        if line.startswith("mooncake"):
            _, session, ptr, nbytes = line.split()
            _raw_mooncake(sender.data.engine, kv.k.data_ptr(), session, int(ptr), int(nbytes))
            print("done", flush=True)
            continue
        room = int(line)
        src = page_order(pages, room, a.contiguous)
        sender.open_room(room, sends_final=True)
        for first in range(0, pages, per_chunk):
            sender.send_pages(room, first, src[first:first + per_chunk],
                              is_last=first + per_chunk >= pages)
        sender.send_final(room, m.FinalMeta(room, 0, a.input_len, 0))


def _secret() -> bytes | None:
    """The sender's cluster secret, from the bench process (None: --auth off)."""
    secret = os.environ.get(SECRET_ENV)
    return bytes.fromhex(secret) if secret else None


def _raw_send(port: int, nbytes: int) -> None:
    block = memoryview(bytearray(4 << 20))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        while nbytes > 0:
            sock.sendall(block[:min(nbytes, len(block))])
            nbytes -= len(block)


def _raw_mooncake(engine, src: int, session: str, dst: int, nbytes: int) -> None:
    block = 1 << 20
    offsets = list(range(0, nbytes - block + 1, block))
    for i in range(0, len(offsets), 512):
        part = offsets[i:i + 512]
        ret = engine.batch_transfer_sync_write(session, [src + o for o in part],
                                               [dst + o for o in part], [block] * len(part))
        if ret < 0:
            raise RuntimeError(f"raw Mooncake write failed ({ret})")


def raw_mooncake_gbs(child, receiver, nbytes: int) -> float:
    """One-sided Mooncake writes of the same bytes in 1 MiB blocks, no transfer plane."""
    nbytes = min(nbytes, receiver.kv.k.numel() * receiver.kv.k.element_size()) >> 20 << 20
    t0 = time.perf_counter()
    child.stdin.write(f"mooncake {receiver.data.session} {receiver.kv.k.data_ptr()} "
                      f"{nbytes}\n")
    child.stdin.flush()
    if child.stdout.readline().strip() != "done":
        raise RuntimeError("the raw Mooncake sender failed")
    return nbytes / (time.perf_counter() - t0) / 1e9


def raw_tcp_gbs(child, nbytes: int) -> float:
    """Plain socket throughput between the same two processes: one recv_into buffer."""
    block = memoryview(bytearray(4 << 20))
    with socket.create_server(("127.0.0.1", 0)) as server:
        child.stdin.write(f"raw {server.getsockname()[1]} {nbytes}\n")
        child.stdin.flush()
        conn, _ = server.accept()
        with conn:
            t0, got = time.perf_counter(), 0
            while got < nbytes:
                k = conn.recv_into(block)
                if k == 0:
                    raise RuntimeError("the raw-tcp sender closed early")
                got += k
            return nbytes / (time.perf_counter() - t0) / 1e9


def local_copy_gbs(kv, src, dst) -> float:
    """Gather + scatter of the same pages inside one process: the copy floor."""
    out = pattern_kv(kv.num_layers, kv.num_pages, kv.page_size, kv.k.shape[2], kv.k.shape[3],
                     kv.dtype, fill=False)
    si, di = torch.tensor(src), torch.tensor(dst)
    t0 = time.perf_counter()
    for layer in range(kv.num_layers):
        for a, b in ((kv.k, out.k), (kv.v, out.v)):
            staged = kv.pages(a, layer).index_select(0, si)
            out.pages(b, layer).index_copy_(0, di, staged)
    return 2 * kv.num_layers * len(src) * kv.page_bytes / (time.perf_counter() - t0) / 1e9


def check_pages(kv, src, dst) -> None:
    for layer in range(kv.num_layers):
        want = (torch.tensor(src, dtype=torch.float32) + PATTERN_LAYER * layer).to(kv.dtype)
        got_k = kv.pages(kv.k, layer)[dst][:, 0]
        got_v = kv.pages(kv.v, layer)[dst][:, 0]
        if not (torch.equal(got_k, want) and torch.equal(got_v, -want)):
            raise RuntimeError(f"layer {layer}: received pages differ from the sent ones")


def bench_case(a, backend: str, dtype: str, cores: list[int], contiguous: bool,
               staging: bool = True, auth: bool = False, rep: int = 0) -> dict:
    """One timed transfer of the whole prompt's KV (and once each, the raw socket, raw
    Mooncake and local copy floors), in a fresh sender process."""
    from pipefill.disagg import messages as m
    from pipefill.disagg.bootstrap import lookup_prefill
    from pipefill.disagg.transfer_receiver import KVReceiver
    pages = -(-a.input_len // a.page_size)
    cmd = [sys.executable, "-m", "pipefill.bench.kv_transfer", "--role", "sender",
           "--backend", backend, "--dtype", dtype, "--core", str(cores[0]),
           *[f"--{k}={getattr(a, k.replace('-', '_'))}" for k in
             ("input-len", "chunk-size", "layers", "kv-heads", "head-dim", "page-size")],
           *(["--contiguous"] if contiguous else [])]
    secret = os.urandom(32) if auth else None
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    if secret:
        env[SECRET_ENV] = secret.hex()
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**env, "GLOG_minloglevel": "2"})
    try:
        port = int(child.stdout.readline())
        kv = pattern_kv(a.layers, pages, a.page_size, a.kv_heads, a.head_dim,
                        getattr(torch, dtype), fill=False)
        # A real decode stages rooms within a share of a much larger pool; here the pool is
        # one room, so the arena is sized for it (0: staging off, per-page writes).
        room_bytes = 2 * kv.k.numel() * kv.k.element_size()
        receiver = KVReceiver(kv, release=lambda room, p: None, backend=backend,
                              staging_bytes=room_bytes if staging else 0, secret=secret)
        receiver.connect("bench", lookup_prefill(m.Endpoint("127.0.0.1", port), 120,
                                                 secret=secret))
        room = 1000 + rep
        dst = page_order(pages, -room, contiguous)
        receiver.expect_room(room, "bench", dst, num_prompt_tokens=a.input_len)
        t0 = time.perf_counter()
        child.stdin.write(f"{room}\n")
        child.stdin.flush()
        res = receiver.wait_room(room, 600)
        seconds = time.perf_counter() - t0
        if res is None or not res.ok:
            raise RuntimeError(f"{backend}: room failed: {res}")
        src = page_order(pages, room, contiguous)
        check_pages(kv, src, dst)
        staged = backend == "mooncake" and receiver.data.staging_bytes > 0 and not contiguous
        nbytes = 2 * a.layers * pages * kv.page_bytes
        raw_mc = raw_mooncake_gbs(child, receiver, nbytes) if backend == "mooncake" else None
        receiver.close()
        return {"backend": backend, "dtype": dtype, "layout": "consecutive" if contiguous
                else "shuffled", "staged": staged, "auth": auth, "bytes": nbytes,
                "seconds": seconds, "gbs": nbytes / seconds / 1e9,
                "raw_tcp_gbs": raw_tcp_gbs(child, nbytes), "raw_mooncake_gbs": raw_mc,
                "local_copy_gbs": local_copy_gbs(kv, src, dst)}
    finally:
        child.kill()
        child.wait()


def auth_modes(text: str) -> list[bool]:
    modes = {"off": False, "on": True}
    out = [modes.get(x.strip()) for x in text.split(",")]
    if None in out or not out:
        raise ValueError(f"--auth {text!r}: off, on, or off,on")
    return out


def cases(a) -> list[tuple[str, str, bool, bool, bool]]:
    """(backend, dtype, consecutive, staging, auth) in run order: per dtype and layout, every
    backend; mooncake into shuffled pages with and/or without staging (--mooncake-staging);
    each without and/or with the cluster secret (--auth)."""
    layouts = {"shuffled": [False], "consecutive": [True], "both": [False, True]}[a.layout]
    stagings = {"on": [True], "off": [False], "both": [True, False]}[a.mooncake_staging]
    out = []
    for dtype in a.dtypes.split(","):
        for consecutive in layouts:
            for backend in a.backends.split(","):
                for staging in (stagings if backend == "mooncake" and not consecutive
                                else [True]):
                    out += [(backend, dtype, consecutive, staging, auth)
                            for auth in auth_modes(a.auth)]
    return out


def label(r: dict) -> str:
    name = r["backend"]
    if r["backend"] == "mooncake" and r["layout"] != "consecutive":
        name = "mooncake staged" if r["staged"] else "mooncake per-page"
    return name + " +auth" if r.get("auth") else name


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def spread(xs: list[float]) -> str:
    return f"{median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def case_key(r: dict) -> tuple[str, str, str]:
    return label(r), r["dtype"], r["layout"]


def paired_ratios(runs: dict, name: str, other: str, dtype: str, layout: str,
                  other_layout: str | None = None) -> list[float] | None:
    """Per repetition, this case's GB/s over the other's (both ran in that repetition)."""
    mine, theirs = runs.get((name, dtype, layout)), runs.get((other, dtype, other_layout or layout))
    if not mine or not theirs:
        return None
    return [x["gbs"] / y["gbs"] for x, y in zip(mine, theirs)]


def summary(runs: dict) -> list[str]:
    """Ratios inside this run, each the median of per-repetition ratios [min-max]: with
    against without the cluster secret, shuffled against consecutive pages, staged against
    per-page writes."""
    lines = []
    for name, dtype, layout in runs:
        plain = name.removesuffix(" +auth")
        ratios = paired_ratios(runs, name, plain, dtype, layout) if plain != name else None
        if ratios:
            lines.append(f"{name:17s} {dtype:9s} {layout:11s} = {spread(ratios)} x without "
                         f"the secret")
        if layout != "shuffled":
            continue
        auth = " +auth" if name.endswith(" +auth") else ""
        ratios = paired_ratios(runs, name, name.split()[0] + auth, dtype, layout,
                               "consecutive")
        if ratios:
            lines.append(f"{name:17s} {dtype:9s} shuffled = {spread(ratios)} x consecutive")
        ratios = paired_ratios(runs, name, "mooncake per-page", dtype, "shuffled")
        if name == "mooncake staged" and ratios:
            lines.append(f"{name:17s} {dtype:9s} shuffled = {spread(ratios)} x the per-page "
                         f"writes (before staging)")
    return lines


def report(a, key: tuple[str, str, str], rows: list[dict]) -> str:
    name, dtype, layout = key
    gbs = [r["gbs"] for r in rows]
    line = (f"{name:17s} {dtype:9s} {layout:11s} {rows[0]['bytes'] / 2**20:7.1f} MiB  "
            f"{spread(gbs)} GB/s; raw tcp {spread([r['raw_tcp_gbs'] for r in rows])}, "
            f"local copy {spread([r['local_copy_gbs'] for r in rows])}; one "
            f"{a.chunk_size}-token chunk "
            f"{median([r['seconds'] for r in rows]) * a.chunk_size / a.input_len * 1e3:.0f} ms")
    if rows[0]["raw_mooncake_gbs"]:
        line += (f"\n  (raw Mooncake writes, 1 MiB blocks: "
                 f"{spread([r['raw_mooncake_gbs'] for r in rows])} GB/s)")
    return line


def run(a: argparse.Namespace) -> int:
    cores = [int(c) for c in a.cores.split(",")]
    if len(cores) != 2:
        raise ValueError("--cores needs two core ids: sender,receiver")
    if a.reps < 1:
        raise ValueError("--reps must be at least 1")
    os.sched_setaffinity(0, {cores[1]})
    torch.set_num_threads(1)
    print(f"{cpu_name()}; sender on core {cores[0]}, receiver on core {cores[1]}; "
          f"{a.layout} page layout; {a.input_len} tokens x "
          f"{a.layers} layers x {a.kv_heads} KV heads x {a.head_dim}, "
          f"{a.page_size}-token pages, {a.chunk_size}-token chunks; {a.reps} repetitions, "
          "each running every case once in turn; median [min-max]")
    runs: dict[tuple[str, str, str], list[dict]] = {}
    for rep in range(a.reps):
        for backend, dtype, consecutive, staging, auth in cases(a):
            r = bench_case(a, backend, dtype, cores, consecutive, staging, auth, rep)
            runs.setdefault(case_key(r), []).append(r)
            print(f"  repetition {rep + 1}: {case_key(r)[0]} {dtype} {r['layout']} "
                  f"{r['gbs']:.2f} GB/s", flush=True)
    for key, rows in runs.items():
        print(report(a, key, rows))
    for line in summary(runs):
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_name(), "args": vars(a) | {"run": None},
                       "rows": [r for rows in runs.values() for r in rows]}, f, indent=1)
    return 0


def _sender_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--role")
    p.add_argument("--backend")
    p.add_argument("--dtype")
    p.add_argument("--core", type=int)
    p.add_argument("--contiguous", action="store_true")
    for k in ("input-len", "chunk-size", "layers", "kv-heads", "head-dim", "page-size"):
        p.add_argument(f"--{k}", type=int)
    return p.parse_args(argv)


if __name__ == "__main__":
    sender_main(_sender_args(sys.argv[1:]))
