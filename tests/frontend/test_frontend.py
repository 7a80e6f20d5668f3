"""The front-end core (frontend.FrontEnd) without processes: a fake stage group records what
is sent, and reports are routed by hand, as Engine and the server's event loop do. A PD
prefill's core runs the real bootstrap service on a free port."""
import socket
from types import SimpleNamespace

import pytest

from pipefill.base.plan import NewRequest, PDInfo, RequestOutput, SamplingParams, room_in_use
from pipefill.base.platform import free_port
from pipefill.disagg.http_fields import FieldError
from pipefill.config import ServerArgs
from pipefill.frontend import FrontEnd


class FakeStages:
    def __init__(self):
        self.sent = []

    def send(self, kind, payload=None, block=True):
        self.sent.append((kind, payload, block))


def make_core(capacity: int = 64) -> FrontEnd:
    args = ServerArgs(max_model_len=32, page_size=16)
    core = FrontEnd(args, SimpleNamespace(config=SimpleNamespace(vocab_size=100)))
    core.stages, core.kv_capacity_tokens = FakeStages(), capacity
    return core


def submit(core, *rids):
    got = {rid: [] for rid in rids}
    core.submit([NewRequest(rid, [1, 2], SamplingParams()) for rid in rids],
                [got[rid].append for rid in rids])
    return got


def test_outputs_reach_their_request_in_order_and_a_finished_one_leaves():
    core = make_core()
    got = submit(core, "a", "b")
    assert core.stages.sent[0][0] == "add" and [r.rid for r in core.stages.sent[0][1]] == ["a", "b"]
    a1, b1 = RequestOutput("a", [5], False), RequestOutput("b", [6], True, "length")
    a2 = RequestOutput("a", [7], True, "stop")
    core.route(("outputs", [a1, b1]))
    core.route(("outputs", [a2, RequestOutput("b", [], True, "abort")]))  # b already finished
    core.route(("outputs", [RequestOutput("nobody", [1], True, "abort")]))
    assert got == {"a": [a1, a2], "b": [b1]}
    assert not core._sinks


def test_a_rejection_is_a_value_error_for_its_request_only():
    core = make_core()
    got = submit(core, "a", "b")
    core.route(("rejected", ("a", "the prompt is empty")))
    core.route(("rejected", ("gone", "whatever")))
    [error] = got["a"]
    assert isinstance(error, ValueError) and str(error) == "the prompt is empty"
    assert got["b"] == [] and list(core._sinks) == ["b"]


def test_load_abort_release_and_fail_all():
    core = make_core()
    got = submit(core, "a", "b", "c")
    core.route(("load", {"num_running": 2}))
    assert core.load == {"num_running": 2}
    core.abort("a")
    assert core.stages.sent[-1] == ("abort", "a", False)
    core.release("b")
    core.route(("outputs", [RequestOutput("a", [1], False), RequestOutput("b", [1], False)]))
    failure = RuntimeError("stage 1 exited")
    core.fail_all(failure)
    assert got == {"a": [], "b": [], "c": [failure]}


def test_request_ids_count_up_per_front_end():
    core = make_core()
    assert [core.new_rid("cmpl"), core.new_rid("chatcmpl")] == ["cmpl-0", "chatcmpl-1"]


def test_the_front_door_check_says_what_to_change():
    core = make_core(capacity=16)
    core.check_prompt([1, 2], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.check_prompt([100], SamplingParams())
    with pytest.raises(ValueError, match="exceeds --max-model-len"):
        core.check_prompt([1] * 30, SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="raise --max-total-tokens"):
        core.check_prompt([1] * 10, SamplingParams(max_new_tokens=10))


# ---- PD rooms and services ----------------------------------------------------------------------

class Told:
    """Stands in for the reject notifier's queue: what refuse_room passed on."""

    def __init__(self):
        self.told = []

    def tell(self, room, status, sentence):
        self.told.append((room, status, sentence))

    def close(self):
        pass


def pd_core(mode: str, **kw) -> FrontEnd:
    args = ServerArgs(max_model_len=32, page_size=16, disaggregation_mode=mode,
                      disaggregation_insecure=True, **kw)
    return FrontEnd(args, SimpleNamespace(config=SimpleNamespace(vocab_size=100)))


def test_a_colocated_front_end_takes_no_room_and_starts_no_service():
    core = make_core()
    assert core.bootstrap is None and core.rejects is None
    assert core.check_room(None) is None
    with pytest.raises(ValueError, match="--disaggregation-mode prefill|decode"):
        core.check_room(PDInfo(1, "127.0.0.1", 8998))
    params = SamplingParams(max_new_tokens=8, return_prompt_logprobs=True)
    assert core.pd_params(params, None) is params
    core.refuse_room(PDInfo(1, "127.0.0.1", 8998), 400, "no")  # nothing to tell


def test_a_prefill_front_end_serves_the_bootstrap_until_closed():
    port = free_port()
    core = pd_core("prefill", disaggregation_bootstrap_port=port)
    try:
        assert core.bootstrap.endpoint.port == port and core.bootstrap.endpoints() == []
        with pytest.raises(RuntimeError, match="choose another --disaggregation-bootstrap-port"):
            pd_core("prefill", disaggregation_bootstrap_port=port)
        with pytest.raises(ValueError, match="this is the prefill of a PD pair"):
            core.check_room(None)
        room = core.check_room(PDInfo(5, "127.0.0.1", port))
        assert room == PDInfo(5, "127.0.0.1", port)
        assert core.pd_params(SamplingParams(max_new_tokens=8), room).max_new_tokens == 1
        with pytest.raises(ValueError, match="not served by a PD pair"):
            core.pd_params(SamplingParams(return_prompt_logprobs=True), room)
        core.rejects.close()
        core.rejects = Told()
        core.refuse_room(room, 400, "too long")
        core.refuse_room(room, 400, room_in_use(5))  # that room's decodes serve another request
        core.refuse_room(None, 400, "no room")
        assert core.rejects.told == [(5, 400, "too long")]
    finally:
        core.close()
    assert core.bootstrap is None
    socket.create_server(("127.0.0.1", port)).close()  # the port is free again


def test_a_decode_front_end_checks_rooms_as_the_router_fields_are_checked():
    core = pd_core("decode", disaggregation_prefill_bootstrap="10.0.0.1:8998")
    assert core.bootstrap is None and core.rejects is None
    assert core.check_room(PDInfo(3, "10.0.0.1", 8998)) == PDInfo(3, "10.0.0.1", 8998)
    with pytest.raises(FieldError) as e:
        core.check_room(PDInfo(3, "10.0.0.2", 8998))
    assert e.value.status == 403
    with pytest.raises(ValueError, match="bootstrap_room must be an integer"):
        core.check_room(PDInfo(True, "10.0.0.1", 8998))
    params = SamplingParams(max_new_tokens=8)
    assert core.pd_params(params, PDInfo(3, "10.0.0.1", 8998)) is params
