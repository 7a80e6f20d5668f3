"""The command line sits on top: no library module (bench, server, runtime, ...) imports
`pipefill.cli`, not even lazily inside a function (checked on the source of every module),
and the modules of the former cli <-> bench <-> server circle each import on their own in a
fresh interpreter."""
import ast
import concurrent.futures
import pathlib
import pkgutil
import subprocess
import sys

import pipefill

ROOT = pathlib.Path(pipefill.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages(pipefill.__path__, "pipefill."))


def imported_names(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_no_library_module_imports_the_cli():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.is_relative_to(ROOT / "cli"):
            continue
        bad = sorted(n for n in imported_names(path) if n.startswith("pipefill.cli"))
        if bad:
            offenders.append(f"{path.relative_to(ROOT.parent)}: {', '.join(bad)}")
    assert not offenders, "\n".join(offenders)


# Imports one module alone, then lists the pipefill.cli modules that came with it.
_PROBE = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
          "print(sorted(m for m in sys.modules if m.startswith('pipefill.cli')))")


def _probe(name: str) -> str | None:
    r = subprocess.run([sys.executable, "-c", _PROBE, name], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        return f"{name}: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    if not name.startswith("pipefill.cli") and r.stdout.strip() != "[]":
        return f"{name} imports {r.stdout.strip()}"
    return None


# The modules of the former circle (each imports torch or the server stack: a few seconds).
CIRCLE = ["pipefill.server.main", "pipefill.bench.prefill", "pipefill.bench.serving",
          "pipefill.cli.generate", "pipefill.cli.main"]


def test_bench_server_cli_modules_import_alone():
    circle = [m for m in CIRCLE if m in MODULES]
    assert circle == CIRCLE
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        failures = [f for f in pool.map(_probe, circle) if f]
    assert not failures, "\n".join(failures)


def test_the_cli_parser_builds():
    """The commands' parsers bring in bench and server modules: all of them build."""
    from pipefill.cli.main import build_parser
    parser = build_parser()
    for argv in (["serve"], ["generate", "--prompt", "x"], ["bench", "prefill"]):
        assert parser.parse_args(argv).run is not None
