"""`pipefill bench tp-vs-pp`: its arguments, its refusal without root, and the wire-byte
formulas it prints beside the measured bytes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from pipefill.bench.tp_vs_pp import formula_bytes, parse_rate
from pipefill.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("argv, said", [
    (["--reps", "0"], "--reps must be at least 1"),
    (["--input-len", "0"], "--input-len must be at least 1"),
    (["--rates", "fast"], "--rates: 'fast' is not a rate such as 500mbit or 10gbit"),
    (["--rates", "0gbit"], "is not a rate"),
    (["--rates", ","], "--rates needs at least one rate"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be at least 1"),
])
def test_bad_arguments_exit_2_with_a_sentence(capsys, argv, said):
    assert main(["bench", "tp-vs-pp", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def reachable_by_others(*paths: str) -> bool:
    """Every folder above each path searchable by any user (o+x), as the dropped user needs."""
    for path in paths:
        p = os.path.dirname(os.path.abspath(path))
        while True:
            if not os.stat(p).st_mode & 0o001:
                return False
            if p == "/":
                break
            p = os.path.dirname(p)
    return True


def test_a_user_who_is_not_root_is_told_so():
    argv = [sys.executable, "-m", "pipefill.cli.main", "bench", "tp-vs-pp", "--reps", "1"]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv to drop it")
        if not reachable_by_others(sys.executable, ROOT):
            pytest.skip("the checkout or its venv is not readable by other users (a private "
                        "temporary folder), so an unprivileged user cannot start pipefill")
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT}, cwd="/")
    assert r.returncode == 2
    assert "needs root" in r.stderr and "Traceback" not in r.stderr


def test_rates_in_tc_units():
    assert parse_rate("10gbit") == 1e10
    assert parse_rate(" 500Mbit") == 5e8
    assert parse_rate("1.5gbit") == 1.5e9


def test_formulas_for_the_default_model_at_8192_tokens():
    s, h, layers = 8192, 576, 30
    # TP2: each of the 2L - 1 whole sums (2 a layer, 1 for the embedding, less the last
    # layer's, which are a row's) sends every rank's S x H bf16 partial once (ring of 2).
    assert formula_bytes("TP2", s, h, layers, 2) == 2 * 59 * s * h * 2 == 1_113_587_712
    # One rank's share is the usual 4 S H L less one sum.
    assert formula_bytes("TP2", s, h, layers, 2) // 2 + s * h * 2 == 4 * s * h * layers
    # PP2: one boundary, hidden in bf16 and residual in float32.
    assert formula_bytes("PP2", s, h, layers, 2) == s * h * 6 == 28_311_552
    assert formula_bytes("PP2", s, h, layers, 4, stages=4) == 3 * s * h * 8
    with pytest.raises(ValueError, match="unknown layout"):
        formula_bytes("TP4", s, h, layers, 2)
