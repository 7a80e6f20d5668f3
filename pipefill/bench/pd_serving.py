"""`pipefill bench pd-serving`: PD disaggregation against colocated serving, in one sitting.

Starts and stops every server itself, pinned with taskset to --cores (two cores A,B):
  pd   prefill (PP1, 1 thread) on A and decode (1 thread) on B, behind the real sglang-router
       (PD mode); the benchmark goes through the router
  pp1  one colocated server, PP1 with 2 threads on A,B
  pp2  one colocated server, PP2 with one stage (1 thread) on each of A and B
(the colocated servers are measured directly, without a router). Each runs every workload of
--output-lens: --num-prompts text prompts (`bench serving --prompt-mode text`; the router takes
no token-id prompts) of --input-len tokens +- --range-ratio (output lengths vary by the same
ratio, as in `bench serving`), at most --max-concurrency in flight, all sent at once; the same
prompts for every configuration (fresh servers: no prefix-cache hits across them). One table:
TTFT mean/p99, TPOT mean, ITL p50/p99 per configuration and workload, and ITL p99 of PD over
each colocated one.

With --timeline-len N (pd only): after the workloads, one N-token prompt through the router,
and the moments of its end, from the servers' `pd-timeline` debug lines (same machine clock):
the end of the last chunk's forward, each prefill stage's pages all sent, the decode taking the
ready room, and the client's first token; against the transfer time of one chunk's KV pages
(`bench kv-transfer` with the prefill's page size, dtype and shape, on the same two cores,
right after the servers stopped). The goal: last forward -> first token within one chunk's
transfer (the rest of the transfer overlapped with the prefill).

The client and the router run unpinned; server logs go to --log-dir.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

from pipefill.disagg.launch import deployment_secret, stop
from pipefill.base.platform import cpu_name, free_port
from pipefill.base.wire import read_cluster_secret

CONFIGS = ("pd", "pp1", "pp2")
SET_HERE = ("--pp-size", "--port", "--host", "--threads-per-stage", "--disaggregation-mode",
            "--disaggregation-bootstrap-port", "--log-level")


def add_parser(sub) -> None:
    p = sub.add_parser("pd-serving", help="PD disaggregation vs colocated PP1/PP2: serving "
                       "benchmark through the router, and the KV transfer's tail",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="pd,pp1,pp2", help="any of pd, pp1, pp2")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per workload")
    p.add_argument("--input-len", type=int, default=5120, help="mean prompt tokens")
    p.add_argument("--range-ratio", type=float, default=0.6,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (0.6: 2,048-8,192)")
    p.add_argument("--output-lens", default="64,256",
                   help="mean output tokens, one workload each")
    p.add_argument("--max-concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--cores", default="0,1", help="the two cores: A,B")
    p.add_argument("--timeline-len", type=int, default=8192,
                   help="prompt tokens of the last-chunk -> first-token measurement (0: skip)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="for every server (default: the longest prompt + output, + 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds for each configuration's servers to be healthy")
    p.add_argument("--log-dir", help="server logs (default: a temporary folder)")
    p.add_argument("--json", metavar="FILE", help="write every summary here")
    p.add_argument("server_args", nargs=argparse.REMAINDER,
                   help="After --: flags for every `pipefill serve` (e.g. --model-path DIR).")
    p.set_defaults(run=run)


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def check_args(a) -> tuple[list[str], list[int], list[str], list[int]]:
    """(configs, cores, extra server flags, output lengths) or a ValueError naming the flag."""
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        raise ValueError(f"--configs {a.configs!r}: choose from {', '.join(CONFIGS)}")
    try:
        cores = [int(c) for c in a.cores.split(",")]
        outs = [int(x) for x in a.output_lens.split(",")]
    except ValueError:
        raise ValueError("--cores and --output-lens take comma-separated integers") from None
    if len(cores) != 2 or len(set(cores)) != 2:
        raise ValueError("--cores needs two different core ids: A,B")
    if not set(cores) <= os.sched_getaffinity(0):
        raise ValueError(f"--cores {a.cores}: not all of them are usable here")
    if min(outs) < 1 or a.num_prompts < 1 or a.input_len < 1 or a.max_concurrency < 1:
        raise ValueError("--num-prompts, --input-len, --output-lens and --max-concurrency "
                         "must be >= 1")
    if not 0 <= a.range_ratio < 1 or a.timeline_len < 0:
        raise ValueError("--range-ratio must be in [0, 1) and --timeline-len >= 0")
    extra = [x for x in a.server_args if x != "--"]
    for flag in SET_HERE:
        if _flag_value(extra, flag) is not None or flag in extra:
            raise ValueError(f"{flag} is set by pd-serving itself for each configuration")
    return configs, cores, extra, outs


def max_model_len(a, outs: list[int]) -> int:
    longest_in = max(int(a.input_len * (1 + a.range_ratio)), a.timeline_len)
    return longest_in + int(max(outs) * (1 + a.range_ratio)) + 64


# ---------------------------------------------------------------- starting the servers

def _serve(port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pipefill.cli.main", "serve", "--host", "127.0.0.1",
            "--port", str(port), *extra]


def _pinned(cores: list[int], cmd: list[str]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores)), *cmd]


def commands(config: str, cores: list[int], extra: list[str]) -> tuple[dict, list[str], str,
                                                                       int | None]:
    """({name: command}, health URLs, the URL to benchmark, the bootstrap port or None)."""
    from pipefill.disagg.launch import pd_commands
    if config == "pd":
        bport = free_port()
        prefill, decode, router, url = pd_commands("127.0.0.1", free_port(), 0, 0, 1, bport,
                                                   extra + ["--threads-per-stage", "1"])
        ports = [cmd[cmd.index("--port") + 1] for cmd in (prefill, decode)]
        health = [f"http://127.0.0.1:{p}/health" for p in ports] + [url + "/readiness"]
        cmds = {"prefill": _pinned(cores[:1], prefill), "decode": _pinned(cores[1:], decode),
                "router": router}
        return cmds, health, url, bport
    port = free_port()
    pp, threads = {"pp1": ("1", "2"), "pp2": ("2", "1")}[config]
    cmd = _pinned(cores, _serve(port, ["--pp-size", pp, "--threads-per-stage", threads,
                                       *extra]))
    url = f"http://127.0.0.1:{port}"
    return {config: cmd}, [url + "/health"], url, None


def start(config, cores, extra, log_dir, timeout_s):
    """Starts a configuration's processes, logs to log_dir/<config>-<name>.log; waits.
    (processes, logs, URL, bootstrap port, the served model's name)"""
    import httpx

    from pipefill.disagg import launch
    cmds, health, url, bport = commands(config, cores, extra)
    procs, logs = {}, {}
    try:
        for name, cmd in cmds.items():
            logs[name] = os.path.join(log_dir, f"{config}-{name}.log")
            print(f"pd-serving: {config} {name}: {shlex.join(cmd)}", flush=True)
            with open(logs[name], "w") as f:
                procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                               preexec_fn=launch.die_with_parent)
        launch.wait_ready(procs, health, timeout_s)
        # The decode's (pd) or the server's own model name: the router's /v1/models answers
        # "unknown", which PD servers take on chat requests only.
        server = health[1 if config == "pd" else 0].removesuffix("/health")
        model = httpx.get(server + "/v1/models", timeout=30).json()["data"][0]["id"]
    except BaseException:
        launch.stop(procs)
        raise
    return procs, logs, url, bport, model


# ---------------------------------------------------------------- the workloads

def serving_ns(a, url: str, model: str, out_len: int, label: str, tokenizer: str | None):
    return argparse.Namespace(
        base_url=url, model=model, api_key=None, num_prompts=a.num_prompts,
        random_input_len=a.input_len, random_output_len=out_len,
        random_range_ratio=a.range_ratio, request_rate="inf", max_concurrency=a.max_concurrency,
        vocab_size=49152, seed=a.seed, timeout=3600, label=label, json=None,
        prompt_mode="text", tokenizer=tokenizer)


def run_workloads(a, config, url, model, outs, tokenizer) -> list[dict]:
    from pipefill.bench import serving
    rows = []
    for out_len in outs:
        label = f"{config} output {out_len}"
        results, duration = asyncio.run(serving.run_benchmark(
            serving_ns(a, url, model, out_len, label, tokenizer)))
        summary = serving.summarize(results, duration)
        serving.print_summary(summary, label)
        rows.append({"config": config, "output_len": out_len, "summary": summary})
    return rows


def _ms(stat: dict, key: str) -> str:
    v = stat.get(key)
    return f"{1000 * v:9.1f}" if v is not None else f"{'-':>9}"


def print_table(rows: list[dict], configs: list[str], outs: list[int]) -> None:
    print(f"\n{cpu_name()}")
    print(f"{'config':<8}{'output':>7}{'done':>6}{'TTFT mean':>11}{'TTFT p99':>10}"
          f"{'TPOT':>10}{'ITL p50':>10}{'ITL p99':>10}   (ms)")
    by = {(r["config"], r["output_len"]): r["summary"] for r in rows}
    for out_len in outs:
        for c in configs:
            s = by.get((c, out_len))
            if s is None:
                continue
            print(f"{c:<8}{out_len:>7}{s['completed']:>6}  {_ms(s['ttft_s'], 'mean')}"
                  f"{_ms(s['ttft_s'], 'p99')} {_ms(s['tpot_s'], 'mean')} "
                  f"{_ms(s['itl_s'], 'p50')} {_ms(s['itl_s'], 'p99')}")
        pd = by.get(("pd", out_len))
        for c in configs:
            other = by.get((c, out_len))
            if c == "pd" or pd is None or other is None:
                continue
            x, y = pd["itl_s"]["p99"], other["itl_s"]["p99"]
            if x is not None and y:
                print(f"  output {out_len}: ITL p99 PD / {c} = {x / y:.2f}   "
                      f"TTFT mean PD / {c} = {pd['ttft_s']['mean'] / other['ttft_s']['mean']:.2f}")


# ---------------------------------------------------------------- last chunk -> first token

STAMP = re.compile(r"pd-timeline room (\d+) (\S+) ([\d.]+)")


def read_stamps(paths, since: float) -> dict[int, dict[str, float]]:
    """{room: {event: wall time}} of the pd-timeline lines stamped at or after `since`."""
    rooms: dict[int, dict[str, float]] = {}
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                m = STAMP.search(line)
                if m and float(m.group(3)) >= since:
                    rooms.setdefault(int(m.group(1)), {})[m.group(2)] = float(m.group(3))
    return rooms


def one_request_first_token(url: str, model: str, prompt: str,
                            timeout: float = 600) -> tuple[float, float]:
    """(sent, first token received), wall clock, streaming through `url`."""
    import httpx
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": True}
    sent = time.time()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the timeline request got HTTP {r.status_code}: "
                               f"{r.read()[:200]!r}")
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data:") and '"text"' in line and line.strip() != "data: [DONE]":
                first = time.time()
                for _ in lines:  # the rest of the answer
                    pass
                return sent, first
    raise RuntimeError("the timeline request streamed no token")


def timeline(a, url: str, model: str, logs: dict, tokenizer) -> dict:
    import random

    from pipefill.bench.serving import text_prompts
    prompt = text_prompts(tokenizer).make(a.timeline_len, random.Random(a.seed + 1))
    sent, first = one_request_first_token(url, model, prompt)
    time.sleep(1.0)  # the stages' log lines of the room's end
    rooms = read_stamps([logs["prefill"], logs["decode"]], sent)
    if len(rooms) != 1:
        raise RuntimeError(f"expected the pd-timeline lines of one room in {logs}, found "
                           f"{len(rooms)} (the servers run with --log-level debug)")
    ev = next(iter(rooms.values()))
    ends = {k: v for k, v in ev.items() if k.endswith("-last-forward-end")}
    if not ends or "decode-ready" not in ev:
        raise RuntimeError(f"incomplete pd-timeline of the room: {sorted(ev)}")
    last = max(ends.values())
    return {"input_len": a.timeline_len, "sent": sent, "first_token": first,
            "events_s_after_last_forward": {k: v - last for k, v in sorted(
                ev.items(), key=lambda kv: kv[1])},
            "first_token_s_after_last_forward": first - last, "ttft_s": first - sent}


def prefill_shape(bport: int, flags: list[str]):
    """The prefill's first stage as registered with its bootstrap service (shape, dtype);
    flags: the prefill's, for its cluster secret."""
    from pipefill.disagg import messages as m
    from pipefill.disagg.bootstrap import lookup_prefill
    secret = read_cluster_secret(_flag_value(flags, "--cluster-secret"),
                                 _flag_value(flags, "--cluster-secret-file"))
    return lookup_prefill(m.Endpoint("127.0.0.1", bport), 30, secret=secret).stages[0]


def chunk_transfer(a, st, cores: list[int], chunk: int) -> dict:
    """One `chunk`-token chunk's pages over tcp: `bench kv-transfer` with the prefill's own
    shape (st: its RegisterStage), contiguous and shuffled pages, best of 3."""
    from pipefill.bench import kv_transfer
    out = {"page_size": st.page_size, "kv_dtype": st.kv_dtype, "chunk_tokens": chunk}
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cores[1]})
        for contiguous in (True, False):
            ns = argparse.Namespace(input_len=a.timeline_len, chunk_size=chunk,
                                    layers=st.num_layers, kv_heads=st.num_kv_heads,
                                    head_dim=st.head_dim, page_size=st.page_size, reps=3)
            r = kv_transfer.bench_case(ns, "tcp", st.kv_dtype, cores, contiguous)
            out["contiguous" if contiguous else "shuffled"] = {
                "gbs": r["gbs"], "whole_prompt_s": r["best_s"],
                "chunk_s": r["best_s"] * min(chunk, a.timeline_len) / a.timeline_len}
    finally:
        os.sched_setaffinity(0, before)
    return out


def print_timeline(t: dict, xfer: dict) -> None:
    print(f"\n{t['input_len']}-token prompt through PD (client TTFT {t['ttft_s']:.3f} s); "
          "after the end of the last chunk's forward:")
    for k, v in t["events_s_after_last_forward"].items():
        print(f"  {k:<32}{1000 * v:9.1f} ms")
    print(f"  {'client first token':<32}{1000 * t['first_token_s_after_last_forward']:9.1f} ms")
    for kind in ("contiguous", "shuffled"):
        x = xfer[kind]
        print(f"one {xfer['chunk_tokens']}-token chunk's KV over tcp ({kind} pages, "
              f"{xfer['kv_dtype']}, {xfer['page_size']}-token pages): {1000 * x['chunk_s']:.1f}"
              f" ms ({x['gbs']:.2f} GB/s); last forward -> first token = "
              f"{t['first_token_s_after_last_forward'] / x['chunk_s']:.2f} x that")


# ---------------------------------------------------------------- the sitting

def run(a: argparse.Namespace) -> int:
    configs, cores, extra, outs = check_args(a)
    with deployment_secret(extra) as secret_flags:  # the PD servers' cluster secret
        return run_configs(a, configs, cores, extra, outs, secret_flags)


def run_configs(a, configs, cores, extra, outs, secret_flags) -> int:
    if _flag_value(extra, "--max-model-len") is None:
        extra += ["--max-model-len", str(a.max_model_len or max_model_len(a, outs))]
    tokenizer = _flag_value(extra, "--model-path")
    chunk = _flag_value(extra, "--chunked-prefill-size") or "2048"
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="pd-serving-")
    os.makedirs(log_dir, exist_ok=True)
    print(f"{cpu_name()}; cores {cores}; server logs in {log_dir}", flush=True)
    rows, tl = [], None
    for config in configs:
        flags = extra + (["--log-level", "debug"] if config == "pd" and a.timeline_len else [])
        flags += secret_flags if config == "pd" else []
        procs, logs, url, bport, model = start(config, cores, flags, log_dir,
                                               a.startup_timeout)
        try:
            rows += run_workloads(a, config, url, model, outs, tokenizer)
            if config == "pd" and a.timeline_len:
                tl, shape = timeline(a, url, model, logs, tokenizer), prefill_shape(bport, flags)
        finally:
            stop(procs)
        if tl is not None and "chunk_transfer" not in tl:  # measured with the servers gone
            tl["chunk_transfer"] = chunk_transfer(a, shape, cores, int(chunk)) \
                if chunk.isdigit() else None
    print_table(rows, configs, outs)
    if tl is not None:
        if tl["chunk_transfer"]:
            print_timeline(tl, tl["chunk_transfer"])
        else:
            print(f"timeline (no fixed --chunked-prefill-size to compare with): {tl}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_name(), "args": {k: v for k, v in vars(a).items()
                                                   if k != "run"},
                       "rows": rows, "timeline": tl}, f, indent=1)
    return 0 if all(r["summary"]["completed"] == a.num_prompts for r in rows) else 1
