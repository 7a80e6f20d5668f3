"""The router's PD fields on an OpenAI request body (sglang-router 0.3.2, PD mode): the same
body reaches the prefill and the decode server with bootstrap_host, bootstrap_port and
bootstrap_room (lists for a batch, which pipefill does not take: one prompt per request)."""
from __future__ import annotations

from pipefill.scheduler.plan import PDInfo

ROUTER_MODEL = "unknown"  # what the router puts in a chat request that named no model


def pd_info(extra: dict | None, mode: str) -> PDInfo | None:
    """The request's PD room, or None on a colocated server; ValueError with a sentence for a
    PD server's request that lacks or garbles the fields."""
    extra = extra or {}
    if mode == "null":
        return None
    room, host, port = (extra.get(k) for k in ("bootstrap_room", "bootstrap_host",
                                                "bootstrap_port"))
    if room is None:
        raise ValueError(f"this is a {mode} server of a PD pair: send requests through the PD "
                         "router (sglang-router --pd-disaggregation), which adds bootstrap_room")
    if any(isinstance(v, list) for v in (room, host, port)):
        raise ValueError("batched PD requests (lists of bootstrap rooms) are not supported: "
                         "send one prompt per request")
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**63:
        raise ValueError("bootstrap_room must be an integer in [0, 2^63)")
    if not isinstance(host, str) or not host:
        raise ValueError("bootstrap_host must be the prefill server's host")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError("bootstrap_port must be the prefill's bootstrap port: start the router "
                         "with --prefill URL BOOTSTRAP_PORT")
    return PDInfo(room, host, port)
