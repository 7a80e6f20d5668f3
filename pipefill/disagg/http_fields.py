"""The router's PD fields on an OpenAI request body (sglang-router 0.3.2, PD mode): the same
body reaches the prefill and the decode server with bootstrap_host, bootstrap_port and
bootstrap_room (lists for a batch, which pipefill does not take: one prompt per request)."""
from __future__ import annotations

from pipefill.disagg.validate import check_allowed, check_host, check_port, parse_bootstraps
from pipefill.base.plan import PDInfo

ROUTER_MODEL = "unknown"  # what the router puts in a chat request that named no model


class FieldError(ValueError):
    """A request's PD fields this server does not take: `status` is the HTTP answer (400, or
    403 for a bootstrap outside --disaggregation-prefill-bootstrap)."""

    def __init__(self, sentence: str, status: int = 400):
        super().__init__(sentence)
        self.status = status


def pd_info(extra: dict | None, mode: str, prefill_bootstrap: str | None = None
            ) -> PDInfo | None:
    """The request's PD room, or None on a colocated server; FieldError with a sentence for a
    PD server's request that lacks or garbles the fields, or (decode) names a bootstrap
    outside prefill_bootstrap (--disaggregation-prefill-bootstrap, when given)."""
    extra = extra or {}
    if mode == "null":
        return None
    room, host, port = (extra.get(k) for k in ("bootstrap_room", "bootstrap_host",
                                                "bootstrap_port"))
    if room is None:
        raise FieldError(f"this is a {mode} server of a PD pair: send requests through the PD "
                         "router (sglang-router --pd-disaggregation), which adds bootstrap_room")
    if any(isinstance(v, list) for v in (room, host, port)):
        raise FieldError("batched PD requests (lists of bootstrap rooms) are not supported: "
                         "send one prompt per request")
    return check_room(room, host, port, mode, prefill_bootstrap)


def check_room(room, host, port, mode: str, prefill_bootstrap: str | None = None) -> PDInfo:
    """One PD room (the router's fields, or the Python Engine's PDInfo) of a `mode` server:
    FieldError with a sentence for a room id, host or port it cannot use, or (decode) a
    bootstrap outside prefill_bootstrap."""
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**63:
        raise FieldError("bootstrap_room must be an integer in [0, 2^63)")
    try:
        check_host(host, "bootstrap_host (the prefill server's host)")
        check_port(port, "bootstrap_port (the prefill's bootstrap port: start the router with "
                         "--prefill URL BOOTSTRAP_PORT)")
    except ValueError as e:
        raise FieldError(str(e)) from None
    if mode == "decode":
        try:
            check_allowed(host, port, parse_bootstraps(prefill_bootstrap))
        except ValueError as e:
            raise FieldError(str(e), 403) from None
    return PDInfo(room, host, port)
