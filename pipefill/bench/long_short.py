"""`pipefill bench long-short`: short prompts that arrive while a long one prefills, under each
--schedule-policy, against their time to first token alone.

Each repetition runs, in this order: the long prompt alone, each short prompt alone, then for
each policy one mixed case: the long prompt is sent, and --delay seconds later every short
prompt at once (under `priority` the shorts carry priority 1, the long prompt 0). Every policy
gets its own `pipefill serve` (a subprocess on a free port, started and stopped inside the
repetition, warmed up with one short request); the alone cases run on the first of them
(alone, nothing is scheduled differently). The policies' order turns by one each repetition,
so no policy always comes first after the alone cases.

Prompts are random token ids sent as lists of ints to /v1/completions, so their lengths are
exact; every request gets prompts of its own (no prefix-cache hit anywhere). TTFT is measured
by the client, from sending a request to its first streamed token (max_tokens 1).

Printed: the CPU, one row per case and policy with the TTFT median [min-max] over the
repetitions and the ratio to alone (the median [min-max] of the per-repetition ratios of the
mixed TTFT to that repetition's alone TTFT), and PASS/FAIL against the bars: a short prompt at
most 3x its TTFT alone, the long prompt at most 1.15x (the server's default policy is marked).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile

from pipefill.base.platform import cpu_name, free_port
from pipefill.bench.pd_serving import _flag_value
from pipefill.bench.serving import one_request
from pipefill.config.args import ServerArgs
from pipefill.disagg import launch
from pipefill.scheduler.prefill_order import POLICIES

SHORT_BAR, LONG_BAR = 3.0, 1.15  # most TTFT mixed / TTFT alone a short and the long prompt
MAX_MODEL_LEN_MARGIN = 64        # --max-model-len auto: the long prompt, its token and room
SET_HERE = ("--port", "--host", "--schedule-policy", "--max-model-len", "--dtype")


def add_parser(sub) -> None:
    p = sub.add_parser("long-short", help="TTFT of short prompts sent while a long one "
                       "prefills, per --schedule-policy, against alone",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long-len", type=int, default=32768, help="tokens of the long prompt")
    p.add_argument("--short-lens", default="1024,4096",
                   help="tokens of the short prompts, comma-separated (all sent together)")
    p.add_argument("--delay", type=float, default=5.0,
                   help="seconds from sending the long prompt to sending the short ones")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every case")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="schedule policies to compare, comma-separated")
    p.add_argument("--max-model-len", default="auto",
                   help=f"for every server; auto: --long-len + {MAX_MODEL_LEN_MARGIN}")
    p.add_argument("--dtype", default="auto", help="for every server (see `pipefill serve`)")
    p.add_argument("--serve-args", default="",
                   help="more `pipefill serve` flags for every server, one quoted string "
                        "(e.g. '--model-path DIR --pp-size 2')")
    p.add_argument("--vocab-size", type=int, default=49152,
                   help="token ids are drawn from [100, vocab-size)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds for each server to be healthy")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per request")
    p.add_argument("--log-dir", help="server logs (default: a temporary folder)")
    p.add_argument("--json", metavar="FILE", help="write every measurement and the table here")
    p.set_defaults(run=run)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The checked arguments."""
    long_len: int
    short_lens: tuple[int, ...]
    policies: tuple[str, ...]
    serve_flags: tuple[str, ...]  # everything but --port and --schedule-policy


def check_args(a) -> Plan:
    try:
        shorts = tuple(int(x) for x in a.short_lens.split(","))
    except ValueError:
        raise ValueError(f"--short-lens {a.short_lens!r}: comma-separated integers") from None
    policies = tuple(x.strip() for x in a.policies.split(",") if x.strip())
    if not policies or set(policies) - set(POLICIES) or len(set(policies)) < len(policies):
        raise ValueError(f"--policies {a.policies!r}: some of {', '.join(POLICIES)}, "
                         "each once")
    if a.long_len < 1 or min(shorts) < 1 or a.reps < 1 or a.delay < 0:
        raise ValueError("--long-len, --short-lens and --reps must be >= 1, --delay >= 0")
    if a.max_model_len != "auto" and not a.max_model_len.isdigit():
        raise ValueError(f"--max-model-len {a.max_model_len!r}: a number of tokens or auto")
    try:
        extra = shlex.split(a.serve_args)
    except ValueError as e:
        raise ValueError(f"--serve-args {a.serve_args!r}: {e}") from None
    for flag in SET_HERE:
        if flag in extra or _flag_value(extra, flag) is not None:
            raise ValueError(f"{flag} is set by long-short itself (its own flag, or per "
                             "policy); leave it out of --serve-args")
    mml = (a.long_len + MAX_MODEL_LEN_MARGIN if a.max_model_len == "auto"
           else int(a.max_model_len))
    if mml <= max(a.long_len, *shorts):
        raise ValueError(f"--max-model-len {mml} leaves no room for a token after the "
                         f"{max(a.long_len, *shorts)}-token prompt")
    flags = ("--max-model-len", str(mml), "--dtype", a.dtype, *extra)
    return Plan(a.long_len, shorts, policies, flags)


# ---------------------------------------------------------------- one server per policy

class Server:
    """`pipefill serve` with one schedule policy, its log in log_dir."""

    def __init__(self, plan: Plan, policy: str, log_dir: str, tag: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "pipefill.cli.main", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port), "--schedule-policy", policy, *plan.serve_flags]
        self.log = os.path.join(log_dir, f"{tag}-{policy}.log")
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, timeout_s: float) -> None:
        with open(self.log, "w") as f:
            self.procs["server"] = subprocess.Popen(
                self.cmd, stdout=f, stderr=subprocess.STDOUT, preexec_fn=launch.die_with_parent)
        try:
            launch.wait_ready(self.procs, [self.url + "/health"], timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        launch.stop(self.procs)


# ---------------------------------------------------------------- the cases

@dataclasses.dataclass
class Measurement:
    rep: int
    case: str        # "long" or "short"
    length: int
    policy: str      # "alone", or the policy of the mixed case
    ttft_s: float | None
    error: str | None = None


class Client:
    """Sends prompts of fresh random token ids and measures their TTFT (serving.one_request)."""

    def __init__(self, a, seed: int):
        self.rng = random.Random(seed)
        self.vocab, self.timeout = a.vocab_size, a.timeout

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(n)]

    async def ttft(self, http, url: str, n: int, priority: int | None = None
                   ) -> tuple[float | None, str | None]:
        extra = {"priority": priority} if priority is not None else None
        res = await one_request(http, url + "/v1/completions", {}, None, self.prompt(n),
                                1, self.timeout, n, extra=extra)
        if res.ok:
            return res.ttft_s, None
        return None, res.error or "no token came back"


async def alone_cases(client: Client, url: str, plan: Plan, rep: int) -> list[Measurement]:
    import httpx
    out = []
    async with httpx.AsyncClient(timeout=client.timeout) as http:
        for case, n in [("long", plan.long_len)] + [("short", s) for s in plan.short_lens]:
            ttft, err = await client.ttft(http, url, n)
            out.append(Measurement(rep, case, n, "alone", ttft, err))
    return out


async def mixed_case(client: Client, url: str, plan: Plan, rep: int, policy: str,
                     delay: float) -> list[Measurement]:
    """The long prompt, then after `delay` s every short prompt at once."""
    import httpx
    high, low = (1, 0) if policy == "priority" else (None, None)
    async with httpx.AsyncClient(timeout=client.timeout,
                                 limits=httpx.Limits(max_connections=None)) as http:
        long_task = asyncio.create_task(client.ttft(http, url, plan.long_len, low))
        await asyncio.sleep(delay)
        shorts = [asyncio.create_task(client.ttft(http, url, n, high))
                  for n in plan.short_lens]
        results = await asyncio.gather(long_task, *shorts)
    cases = [("long", plan.long_len)] + [("short", n) for n in plan.short_lens]
    return [Measurement(rep, case, n, policy, ttft, err)
            for (case, n), (ttft, err) in zip(cases, results)]


async def warm_up(client: Client, url: str, plan: Plan) -> None:
    """One short request: the first one on a fresh server pays one-time costs."""
    import httpx
    async with httpx.AsyncClient(timeout=client.timeout) as http:
        await client.ttft(http, url, min(plan.short_lens))


def repetition(a, plan: Plan, rep: int, log_dir: str) -> list[Measurement]:
    turn = rep % len(plan.policies)
    order = plan.policies[turn:] + plan.policies[:turn]
    client = Client(a, a.seed * 1000 + rep)
    out: list[Measurement] = []
    for i, policy in enumerate(order):
        server = Server(plan, policy, log_dir, f"rep{rep}")
        print(f"long-short: repetition {rep + 1}/{a.reps}, {policy}: "
              f"{shlex.join(server.cmd)}", flush=True)
        server.start(a.startup_timeout)
        try:
            asyncio.run(warm_up(client, server.url, plan))
            got = asyncio.run(alone_cases(client, server.url, plan, rep)) if i == 0 else []
            got += asyncio.run(mixed_case(client, server.url, plan, rep, policy, a.delay))
        finally:
            server.stop()
        for m in got:
            print(f"  {m.case} {m.length} {m.policy}: " + (
                f"TTFT {m.ttft_s:.3f} s" if m.ttft_s is not None else f"failed: {m.error}"),
                flush=True)
        out += got
    return out


# ---------------------------------------------------------------- the table

def spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def table(runs: list[Measurement], plan: Plan) -> list[dict]:
    """One row per (case, length, policy): TTFT and ratio to alone over the repetitions."""
    alone = {(m.rep, m.case, m.length): m.ttft_s for m in runs if m.policy == "alone"}
    rows = []
    cases = [("long", plan.long_len)] + [("short", n) for n in plan.short_lens]
    for case, n in cases:
        for policy in ("alone",) + plan.policies:
            ms = [m for m in runs if (m.case, m.length, m.policy) == (case, n, policy)]
            ttfts = [m.ttft_s for m in ms if m.ttft_s is not None]
            ratios = [m.ttft_s / alone[m.rep, case, n] for m in ms
                      if m.ttft_s is not None and alone.get((m.rep, case, n))]
            rows.append({"case": case, "length": n, "policy": policy,
                         "ok": len(ttfts), "failed": len(ms) - len(ttfts),
                         "ttft_s": spread(ttfts),
                         "ratio_to_alone": spread(ratios) if policy != "alone" else None})
    return rows


def bars(rows: list[dict]) -> list[dict]:
    """PASS/FAIL of every policy's median ratio against its bar."""
    out = []
    for row in rows:
        if row["policy"] == "alone":
            continue
        bar = LONG_BAR if row["case"] == "long" else SHORT_BAR
        ratio = row["ratio_to_alone"]["median"] if row["ratio_to_alone"] else None
        out.append({"policy": row["policy"], "case": row["case"], "length": row["length"],
                    "ratio": ratio, "bar": bar,
                    "pass": ratio is not None and ratio <= bar})
    return out


def _cell(s: dict | None, spec: str) -> str:
    if s is None:
        return "-"
    return f"{s['median']:{spec}} [{s['min']:{spec}}-{s['max']:{spec}}]"


def print_report(rows: list[dict], checks: list[dict], default: str, a) -> None:
    print(f"\n{cpu_name()}; {a.reps} repetitions; shorts sent {a.delay:g} s after the long "
          f"prompt; median [min-max]")
    print(f"{'case':<14}{'policy':<10}{'TTFT s':>30}{'ratio to alone':>28}")
    for r in rows:
        name = f"{r['case']} {r['length']}"
        policy = r["policy"] + ("*" if r["policy"] == default else "")
        fails = f"  ({r['failed']} failed)" if r["failed"] else ""
        print(f"{name:<14}{policy:<10}{_cell(r['ttft_s'], '.3f'):>30}"
              f"{_cell(r['ratio_to_alone'], '.2f'):>28}{fails}")
    print(f"* the server's default policy ({default})")
    for c in checks:
        mark = "PASS" if c["pass"] else "FAIL"
        ratio = f"{c['ratio']:.2f}" if c["ratio"] is not None else "-"
        default_note = " (default)" if c["policy"] == default else ""
        print(f"{mark} {c['policy']}{default_note}: {c['case']} {c['length']} TTFT "
              f"{ratio}x alone (bar {c['bar']:g}x)")


def run(a: argparse.Namespace) -> int:
    plan = check_args(a)
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="long-short-")
    os.makedirs(log_dir, exist_ok=True)
    print(f"long-short: {cpu_name()}; server logs in {log_dir}", flush=True)
    runs: list[Measurement] = []
    for rep in range(a.reps):
        runs += repetition(a, plan, rep, log_dir)
    rows = table(runs, plan)
    default = ServerArgs.__dataclass_fields__["schedule_policy"].default
    checks = bars(rows)
    print_report(rows, checks, default, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_name(), "default_policy": default,
                       "args": {k: v for k, v in vars(a).items() if k != "run"},
                       "serve_flags": list(plan.serve_flags), "table": rows, "bars": checks,
                       "runs": [dataclasses.asdict(m) for m in runs]}, f, indent=1)
    return 0 if all(m.ttft_s is not None for m in runs) else 1
