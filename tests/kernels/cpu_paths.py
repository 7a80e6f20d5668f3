"""Whether a kernel path's test runs, is skipped or fails. A path needing CPU flags this machine
lacks (/proc/cpuinfo, base/platform.cpu_flags) is skipped, naming them; a path whose flags it
has must run here (ARCHITECTURE.md, 'Kernels': every path a machine can run is tested on it),
so a build that failed, or a cpuid check at odds with the flags, fails the test instead of
hiding behind a skip."""
from __future__ import annotations

import pytest

from pipefill.base.platform import cpu_flags


def verdict(path: str, status: tuple[bool, str], needs: tuple[str, ...],
            flags: frozenset[str] | None = None) -> tuple[str, str]:
    """("run", "") where the path runs; ("skip", why) where the CPU (`flags`, default this
    one's) lacks some of `needs`; ("fail", why) where it has them all yet the path does not
    run (status: the kernel's (usable, why not))."""
    ok, why = status
    if ok:
        return "run", ""
    flags = cpu_flags() if flags is None else flags
    missing = [f for f in needs if f not in flags]
    if missing:
        return "skip", f"{path} cannot run here: the CPU lacks {', '.join(missing)} ({why})"
    return "fail", (f"{path} should run on this CPU (it has {', '.join(needs) or 'all it needs'})"
                    f" but does not: {why}")


def need(path: str, status: tuple[bool, str], needs: tuple[str, ...]) -> None:
    """Inside a test: returns where the path runs, skips or fails as verdict says."""
    kind, why = verdict(path, status, needs)
    if kind == "skip":
        pytest.skip(why)
    if kind == "fail":
        pytest.fail(why)


def should_run(status: tuple[bool, str], needs: tuple[str, ...]) -> bool:
    """For picking a path to test, or a mark made at collection: whether the path runs or
    ought to (this CPU has its flags). A test that picks a path which ought to run and does
    not fails when it calls the kernel."""
    return verdict("", status, needs)[0] != "skip"


def skip_without_flags(path: str, status: tuple[bool, str], needs: tuple[str, ...]):
    """A skipif mark: skips where this CPU lacks the path's flags, and only there."""
    kind, why = verdict(path, status, needs)
    return pytest.mark.skipif(kind == "skip", reason=why)
