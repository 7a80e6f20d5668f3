"""The --disaggregation-* flags: validated in ServerArgs, mapped to the transfer timings, and
`pipefill serve` refuses a PD role across nodes (not served yet) with a sentence (exit 2)."""
from __future__ import annotations

import signal

import pytest

from pipefill.config import ServerArgs
from pipefill.disagg.transfer import Timing


def test_timing_from_the_flags():
    args = ServerArgs(disaggregation_waiting_timeout=7.5, disaggregation_bootstrap_timeout=3,
                      disaggregation_heartbeat_interval=0.5,
                      disaggregation_heartbeat_max_misses=4)
    assert Timing.of(args.disagg) == Timing(3, 7.5, 0.5, 4)


@pytest.mark.parametrize("field,value", [
    ("disaggregation_waiting_timeout", 0), ("disaggregation_bootstrap_timeout", -1),
    ("disaggregation_heartbeat_interval", 0), ("disaggregation_heartbeat_max_misses", 0),
    ("disaggregation_bootstrap_port", 70000)])
def test_bad_values_name_the_flag(field, value):
    with pytest.raises(ValueError, match="--" + field.replace("_", "-")):
        ServerArgs(**{field: value})


def test_serve_refuses_a_multi_node_decode_with_a_sentence(capsys):
    """A decode pipeline on one node is served (tests/disagg/test_pd_decode_pp.py); across nodes not."""
    from pipefill.cli.main import main
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["serve", "--disaggregation-mode", "decode", "--pp-size", "2", "--nnodes",
                     "2", "--node-rank", "0", "--dist-init-addr", "127.0.0.1:5000",
                     "--disaggregation-insecure"]) == 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert "--disaggregation-mode decode runs on one node" in err and "Traceback" not in err
