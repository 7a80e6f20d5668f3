"""The --disaggregation-* flags: validated in ServerArgs, mapped to the transfer timings, and
`pipefill serve` refuses the PD roles with a sentence (exit 2) until they are wired in."""
from __future__ import annotations

import signal

import pytest

from pipefill.config import ServerArgs
from pipefill.disagg.transfer import Timing


def test_timing_from_the_flags():
    args = ServerArgs(disaggregation_waiting_timeout=7.5, disaggregation_bootstrap_timeout=3,
                      disaggregation_heartbeat_interval=0.5,
                      disaggregation_heartbeat_max_misses=4)
    assert Timing.from_args(args) == Timing(3, 7.5, 0.5, 4)


@pytest.mark.parametrize("field,value", [
    ("disaggregation_waiting_timeout", 0), ("disaggregation_bootstrap_timeout", -1),
    ("disaggregation_heartbeat_interval", 0), ("disaggregation_heartbeat_max_misses", 0),
    ("disaggregation_bootstrap_port", 70000)])
def test_bad_values_name_the_flag(field, value):
    with pytest.raises(ValueError, match="--" + field.replace("_", "-")):
        ServerArgs(**{field: value})


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_serve_refuses_a_role_that_is_not_served_yet(mode, capsys):
    from pipefill.cli.main import main
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["serve", "--disaggregation-mode", mode]) == 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert f"--disaggregation-mode {mode} is not served yet" in err and "Traceback" not in err
