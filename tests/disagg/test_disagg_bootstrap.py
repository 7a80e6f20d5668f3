"""The bootstrap service: prefill stages register, a decode looks them up and refuses a prefill
it cannot take with a sentence naming the flag. Fast: in one process over real sockets; slow:
the service, two prefill stages and the decode as four processes."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import (BootstrapServer, check_compatible, lookup_prefill,
                                       register_stage)

EP = m.Endpoint("127.0.0.1", 1)


def stage(rank, *, pp=2, layers=((0, 15), (15, 30)), page=64, dtype="bfloat16", fp="smol",
          backend="tcp", latent=()):
    ls, le = layers[rank]
    return m.RegisterStage(rank, pp, ls, le, 30, EP, page, dtype, 3, 64, fp, backend,
                           "token-major", list(latent))


MINE = dict(page_size=64, kv_dtype="bfloat16", model_fingerprint="smol", backend="tcp",
            num_layers=30)


def test_lookup_waits_for_every_stage_and_checks_agreement():
    service = BootstrapServer(port=0)
    try:
        assert isinstance(service.lookup(), m.NotReady)
        register_stage(service.endpoint, stage(1))
        assert "[1]" in service.lookup().reason
        with pytest.raises(RuntimeError, match="not ready after"):
            lookup_prefill(service.endpoint, timeout_s=0.3)
        with pytest.raises(RuntimeError, match="refused stage 0"):  # a different model
            register_stage(service.endpoint, stage(0, fp="other"))
        # Garbage on the port is dropped; the service keeps answering.
        with socket.create_connection((service.endpoint.host, service.endpoint.port)) as s:
            s.sendall(b"\x00\x00\x00\x05hello")
        register_stage(service.endpoint, stage(0))
        info = lookup_prefill(service.endpoint, timeout_s=5)
        assert [s.rank for s in info.stages] == [0, 1]
        check_compatible(info, **MINE)
    finally:
        service.close()


@pytest.mark.parametrize("field,value,flag", [
    ("page_size", 16, "--page-size"), ("kv_dtype", "float32", "--dtype"),
    ("model_fingerprint", "llama", "--model-path"), ("num_layers", 32, "--model-path"),
    ("backend", "mooncake", "--disaggregation-transfer-backend"),
    ("kv_layout", "amx-packed", "--attention-backend")])
def test_mismatch_is_a_sentence_naming_the_flag(field, value, flag):
    info = m.PrefillInfo([stage(0), stage(1)])
    with pytest.raises(ValueError, match=flag):
        check_compatible(info, **{**MINE, field: value})


V3_LATENT = [576, 512, 64]  # DeepSeek-V3: kv_lora_rank + qk_rope_head_dim


@pytest.mark.parametrize("latent,dtype", [([544, 512, 32], "bfloat16"), ([], "bfloat16"),
                                          (V3_LATENT, "float32")])
def test_a_latent_layout_mismatch_is_refused_with_a_sentence(latent, dtype):
    """A pair of latent-attention servers agrees on the latent's width, its split into
    kv_lora_rank and rope, and its dtype; a latent prefill and a per-head decode do not
    pair either. Checked before the model's fingerprint, so the sentence says why."""
    info = m.PrefillInfo([stage(0, latent=V3_LATENT), stage(1, latent=V3_LATENT)])
    check_compatible(info, **MINE, kv_latent=V3_LATENT)
    with pytest.raises(ValueError, match="must agree on the latent layout") as e:
        check_compatible(info, **{**MINE, "kv_dtype": dtype, "model_fingerprint": "other"},
                         kv_latent=latent)
    assert "a latent of 576 bfloat16 values a token (kv_lora_rank 512 + rope 64)" in str(e.value)
    per_head = m.PrefillInfo([stage(0), stage(1)])
    with pytest.raises(ValueError, match="per-head keys and values in bfloat16, this decode's "
                                         "a latent of 576"):
        check_compatible(per_head, **MINE, kv_latent=V3_LATENT)


def test_a_broken_latent_registration_is_refused():
    from pipefill.disagg.validate import check_prefill_info
    for bad in ([576, 512], [576, 500, 64], [0, 0, 0]):
        with pytest.raises(ValueError, match="is not \\[latent_dim, kv_lora_rank, rope\\]"):
            check_prefill_info(m.PrefillInfo([stage(0, latent=bad), stage(1, latent=bad)]), 30)
    with pytest.raises(ValueError, match="kv_latent .* differs from stage 0's"):
        check_prefill_info(m.PrefillInfo([stage(0, latent=V3_LATENT), stage(1)]), 30)
    assert m.latent_layout(None) == []


def test_stages_must_tile_the_layers():
    gap = m.PrefillInfo([stage(0, layers=((0, 14), (15, 30))),
                         stage(1, layers=((0, 14), (15, 30)))])
    with pytest.raises(ValueError, match="do not tile"):
        check_compatible(gap, **MINE)


# ------------------------------------------------------------ separate processes

CHILD = r"""
import json, sys
from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import (BootstrapServer, check_compatible, lookup_prefill,
                                       register_stage)
role = sys.argv[1]
if role == "service":
    service = BootstrapServer(port=0)
    print(service.endpoint.port, flush=True)
    sys.stdin.read()
    sys.exit(0)
port = int(sys.argv[2])
ep = m.Endpoint("127.0.0.1", port)
if role == "stage":
    rank = int(sys.argv[3])
    layers = [(0, 15), (15, 30)][rank]
    register_stage(ep, m.RegisterStage(rank, 2, *layers, 30, m.Endpoint("127.0.0.1", 5000 + rank),
                                       64, "bfloat16", 3, 64, "smol", "tcp"))
    sys.exit(0)
page_size = int(sys.argv[3])
info = lookup_prefill(ep, timeout_s=60)
try:
    check_compatible(info, page_size=page_size, kv_dtype="bfloat16", model_fingerprint="smol",
                     backend="tcp", num_layers=30)
except ValueError as e:
    print(f"decode: error: {e}", file=sys.stderr)
    sys.exit(2)
print(json.dumps([[s.rank, s.layer_start, s.layer_end, s.endpoint.port] for s in info.stages]))
"""


def child(*args, **kw):
    return subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
def test_service_two_stages_and_decodes_as_processes():
    service = child("service", stdin=subprocess.PIPE)
    try:
        port = int(service.stdout.readline())
        # Decodes start first: they wait until both stages registered.
        good, bad = child("decode", port, 64), child("decode", port, 16)
        stages = [child("stage", port, r) for r in (0, 1)]
        assert [p.wait(120) for p in stages] == [0, 0]
        out, err = good.communicate(timeout=120)
        assert good.returncode == 0, err
        assert json.loads(out) == [[0, 0, 15, 5000], [1, 15, 30, 5001]]
        out, err = bad.communicate(timeout=120)
        assert bad.returncode == 2
        assert "--page-size 64, this decode 16" in err and "Traceback" not in err
    finally:
        service.kill()
        service.wait()
