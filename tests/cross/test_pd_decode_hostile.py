"""A PD decode that one HTTP request cannot stop. A request names its prefill's bootstrap
(bootstrap_host, bootstrap_port); whatever answers there, the decode's stages keep serving:
the lookup and the connects run off the stage loop under one deadline for the whole exchange,
every answer is checked, and a bad one costs that request a 502 (bad answer) or 504 (too slow)
with a sentence naming the bootstrap.

Fast: the checks of the answers and of the request fields, the deadline against a trickling
peer and a connect stuck past it, the scheduler's refusal of a room id already live; over real
sockets and threads in this process.
Slow: a real decode server (and a real prefill for the normal request) against fake
bootstraps on real sockets: an empty stage list, a port above 65535, a 64 MiB frame trickled
a byte a second, a connection closed at once, and a prefill stage that sends a first token
outside the vocabulary."""
from __future__ import annotations

import concurrent.futures
import socket
import struct
import threading
import time

import httpx
import msgspec
import psutil
import pytest

from pipefill.chunking.policy import ChunkPolicy
from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import lookup_prefill
from pipefill.disagg.connector import (TOO_SLOW, Deadline, PeerError, PrefillConnector,
                                       as_peer_error, lookup)
from pipefill.disagg.http_fields import FieldError, pd_info
from pipefill.disagg.validate import (check_final_meta, check_prefill_info,
                                      parse_bootstraps)
from pipefill.kv.pool import PagePool
from pipefill.base.plan import NewRequest, PDInfo, SamplingParams, is_room_in_use
from pipefill.scheduler.role import DecodeRole, PrefillRole
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig

from conftest import save_tiny_model
from test_pd_router import (free_port, metric, spawn_server, stop, wait_healthy,
                            wait_pages_free)

LAYERS = 4
VOCAB = 512
EP = m.Endpoint("127.0.0.1", 9000)


def stage(rank: int, pp: int = 2, layers=((0, 2), (2, 4)), endpoint=EP, **kw):
    ls, le = layers[rank]
    fields = dict(page_size=16, kv_dtype="float32", num_kv_heads=2, head_dim=16,
                  model_fingerprint="fp", backend="tcp")
    fields.update(kw)
    return m.RegisterStage(rank, pp, ls, le, LAYERS, endpoint, fields["page_size"],
                           fields["kv_dtype"], fields["num_kv_heads"], fields["head_dim"],
                           fields["model_fingerprint"], fields["backend"])


# ------------------------------------------------------------------ PrefillInfo

def test_a_whole_prefill_answer_passes_sorted_by_rank():
    stages = check_prefill_info(m.PrefillInfo([stage(1), stage(0)]), LAYERS)
    assert [s.rank for s in stages] == [0, 1]


@pytest.mark.parametrize("stages,needle", [
    ([], "lists no prefill stage"),
    ([stage(0), stage(0)], "are not 0..1 once each"),
    ([stage(1), stage(2, layers=((0, 2), (2, 4), (4, 4)))], "are not 0..1 once each"),
    ([stage(0, pp=1, layers=((0, 4),), endpoint=m.Endpoint("127.0.0.1", 70000))],
     "stage 0's port must be a TCP port"),
    ([stage(0, pp=1, layers=((0, 4),), endpoint=m.Endpoint("127.0.0.1", 0))],
     "stage 0's port must be a TCP port"),
    ([stage(0, pp=1, layers=((0, 4),), endpoint=m.Endpoint("evil host\n", 9000))],
     "is not a host name or address"),
    ([stage(0, pp=1, layers=((0, 4),), endpoint=m.Endpoint("", 9000))],
     "must be a non-empty host name"),
    ([stage(0, pp=3), stage(1, pp=3)], "says the prefill has 3 stages, the answer lists 2"),
    ([stage(0, layers=((0, 2), (3, 4))), stage(1, layers=((0, 2), (3, 4)))],
     "do not tile the model"),
    ([stage(0, pp=1, layers=((0, 3),))], "cover 3 of the model's 4 layers"),
    ([stage(0), stage(1, page_size=32)], "stage 1's page_size 32 differs from stage 0's 16"),
    ([stage(0, pp=1, layers=((0, 4),), head_dim=0)], "head_dim is 0, not positive"),
])
def test_a_broken_prefill_answer_is_refused_with_a_sentence(stages, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        check_prefill_info(m.PrefillInfo(stages), LAYERS)


# ------------------------------------------------------------------ FinalMeta

def final(token=5, logprob=None, top=None, n=7, state=b"\x01\x00\x00\x00"):
    return m.FinalMeta(1, 2, n, token, logprob, top, state)


def test_a_usable_first_token_passes():
    check_final_meta(final(), vocab_size=VOCAB, num_prompt_tokens=7, logprobs=None)
    check_final_meta(final(logprob=-0.5, top=[(5, -0.5), (9, -1.5)]), vocab_size=VOCAB,
                     num_prompt_tokens=7, logprobs=2)
    check_final_meta(final(logprob=-0.5, top=[]), vocab_size=VOCAB, num_prompt_tokens=7,
                     logprobs=0)


@pytest.mark.parametrize("meta,logprobs,needle", [
    (final(token=VOCAB), None, f"first token {VOCAB} is outside the vocabulary"),
    (final(token=-1), None, "first token -1 is outside the vocabulary"),
    (final(n=8), None, "for a 8-token prompt, this request's has 7"),
    (final(logprob=-0.1), None, "logprobs this request did not ask for"),
    (final(), 2, "the first token's logprob is None"),
    (final(logprob=float("nan"), top=[]), 0, "logprob is nan"),
    (final(logprob=3.0, top=[]), 0, "logprob is 3.0, not a log-probability"),
    (final(logprob=-0.1, top=[(5, -0.1)]), 2, "sent 1 top logprobs, this request asked for 2"),
    (final(logprob=-0.1, top=[(VOCAB + 3, -0.1)]), 1, "top-logprob token 515 is outside"),
    (final(state=bytes(64)), None, "sampling state is 64 bytes"),
])
def test_an_unusable_first_token_is_refused_with_a_sentence(meta, logprobs, needle):
    with pytest.raises(ValueError, match=needle):
        check_final_meta(meta, vocab_size=VOCAB, num_prompt_tokens=7, logprobs=logprobs)


# ------------------------------------------------------------------ the request's fields

def body(host="127.0.0.1", port=8998, room=3):
    return {"bootstrap_room": room, "bootstrap_host": host, "bootstrap_port": port}


@pytest.mark.parametrize("fields,needle", [
    (body(port=70000), "bootstrap_port .* must be a TCP port"),
    (body(port="8998"), "bootstrap_port .* must be a TCP port"),
    (body(port=True), "bootstrap_port .* must be a TCP port"),
    (body(host=5), "bootstrap_host .* must be a non-empty host name"),
    (body(host="a b"), "is not a host name or address"),
    (body(host="h" * 300), "is not a host name or address"),
])
def test_bad_bootstrap_fields_are_a_400_sentence(fields, needle):
    with pytest.raises(FieldError, match=needle) as e:
        pd_info(fields, "decode")
    assert e.value.status == 400


def test_the_prefill_bootstrap_flag_is_an_allow_list():
    flag = "127.0.0.1:8998, Prefill-B:9000"
    assert parse_bootstraps(flag) == {("127.0.0.1", 8998), ("prefill-b", 9000)}
    assert pd_info(body(), "decode", flag) == PDInfo(3, "127.0.0.1", 8998)
    assert pd_info(body(host="prefill-b", port=9000), "decode", flag).port == 9000
    with pytest.raises(FieldError, match="bootstrap 10.0.0.9:8998 is not a prefill this "
                                         "decode pairs with") as e:
        pd_info(body(host="10.0.0.9"), "decode", flag)
    assert e.value.status == 403
    assert pd_info(body(host="10.0.0.9"), "decode", None).host == "10.0.0.9"  # no flag: any
    assert pd_info(body(host="10.0.0.9"), "prefill", flag).host == "10.0.0.9"  # decode only
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        parse_bootstraps("127.0.0.1:8998,nope")


# ------------------------------------------------------------------ a room id already live

def scheduler(role: str) -> Scheduler:
    return Scheduler(SchedulerConfig(16, 64, 8, 1024, (2,), vocab_size=VOCAB), PagePool(64),
                     ChunkPolicy(32), role=PrefillRole(1) if role == "prefill" else DecodeRole())


def pd_request(rid: str, room: int) -> NewRequest:
    return NewRequest(rid, list(range(10, 30)), SamplingParams(max_new_tokens=4),
                      PDInfo(room, "127.0.0.1", 8998))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_room_in_use_is_refused_and_the_first_request_keeps_it(role):
    s = scheduler(role)
    s.add(pd_request("first", 7))
    if role == "decode":
        assert [a.request.rid for a in s.role.admit(s)] == ["first"]
        s.add(pd_request("waiting", 8))  # not admitted yet: its room is live all the same
        with pytest.raises(ValueError, match="bootstrap_room 8 is already in use"):
            s.add(pd_request("again", 8))
    with pytest.raises(ValueError, match="bootstrap_room 7 is already in use") as e:
        s.add(pd_request("second", 7))
    assert is_room_in_use(str(e.value))
    assert s.role.rooms[7].request.rid == "first"
    s.add(pd_request("other", 9))  # another room is taken as usual


# ------------------------------------------------------------------ fake bootstraps

def frame(msg: m.Message) -> bytes:
    body = m.encode(msg)
    return struct.pack("!I", len(body)) + body


def read_msg(sock: socket.socket) -> m.Message | None:
    head = _read(sock, 4)
    if head is None:
        return None
    data = _read(sock, struct.unpack("!I", head)[0])
    return None if data is None else m.decode(data)


def _read(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            return None
        buf += got
    return buf


class FakePeer:
    """A TCP listener on a thread of its own that hands every connection to `answer(sock)`."""

    def __init__(self, answer):
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self.answer(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def answers(info: m.PrefillInfo):
    def answer(sock):
        read_msg(sock)  # the Lookup
        sock.sendall(frame(info))
    return answer


def trickle(sock: socket.socket, period_s: float = 1.0) -> None:
    """Declares a 64 MiB frame, then sends one byte of it per period until the peer leaves."""
    read_msg(sock)
    sock.sendall(struct.pack("!I", 64 << 20))
    while True:
        time.sleep(period_s)
        sock.sendall(b"\x00")


def close_at_once(sock: socket.socket) -> None:
    pass  # FakePeer closes it


def test_a_trickling_bootstrap_hits_the_deadline_of_the_whole_lookup():
    """A byte every 0.2 s keeps any per-read timeout happy; the deadline of 1 s is for the
    whole exchange."""
    peer = FakePeer(lambda sock: trickle(sock, 0.2))
    try:
        deadline, t0 = Deadline(1.0), time.monotonic()
        with pytest.raises(Exception) as e:
            lookup(m.Endpoint("127.0.0.1", peer.port), deadline, None)
        took = time.monotonic() - t0
        error = as_peer_error(e.value, f"127.0.0.1:{peer.port}", deadline)
        assert error.status == TOO_SLOW and 0.9 < took < 3, (took, error)
        assert f"bootstrap 127.0.0.1:{peer.port} did not finish answering within 1 s" in \
            str(error)
    finally:
        peer.close()


def test_a_bootstrap_that_closes_at_once_is_a_bad_answer_not_a_wait():
    peer = FakePeer(close_at_once)
    try:
        deadline, t0 = Deadline(5.0), time.monotonic()
        with pytest.raises(Exception) as e:
            lookup(m.Endpoint("127.0.0.1", peer.port), deadline, None)
        error = as_peer_error(e.value, f"127.0.0.1:{peer.port}", deadline)
        assert isinstance(error, PeerError) and error.status == 502
        assert time.monotonic() - t0 < 2 and "cannot reach the prefill server" in str(error)
    finally:
        deadline.cancel()
        peer.close()


def test_a_connect_stuck_past_its_deadline_is_overdue_for_its_requests():
    """A worker stuck where no socket of the deadline's can be closed (a name lookup, a
    handshake): the loop need not wait for it to fail the requests with a 504."""
    release, done = threading.Event(), []
    connector = PrefillConnector(lambda key, endpoint, deadline: release.wait(10), 0.3,
                                 lambda key, error: done.append((key, error)))
    connector.start("stuck:1", m.Endpoint("stuck", 1))
    connector.start("stuck:1", m.Endpoint("stuck", 1))  # one connect per bootstrap at a time
    assert connector.overdue() == []
    time.sleep(0.5)
    [(key, error)] = connector.overdue()
    assert key == "stuck:1" and error.status == TOO_SLOW
    assert "bootstrap stuck:1 did not finish answering within 0.3 s" in str(error)
    release.set()
    deadline = time.monotonic() + 5
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [k for k, _ in done] == ["stuck:1"] and connector.overdue() == []


# ------------------------------------------------------------------ a real decode server

PROMPT = [11, 12, 13, 14, 15]
CONNECT_TIMEOUT_S = 3.0


def lying_stage(real: m.RegisterStage):
    """A prefill stage that takes the room, sends zeroed pages for it and a first token outside
    the vocabulary."""
    def answer(sock):
        hello = read_msg(sock)
        while not isinstance(msg := read_msg(sock), m.RoomBootstrap):
            if msg is None:
                return
        n, layers = len(msg.dst_pages), real.layer_end - real.layer_start
        nbytes = 2 * layers * n * hello.page_bytes
        sock.sendall(frame(m.KVChunk(msg.room, msg.nonce, real.rank, 0, 0, n, real.layer_start,
                                     real.layer_end, nbytes, True)) + bytes(nbytes))
        sock.sendall(frame(m.FinalMeta(msg.room, msg.nonce, len(PROMPT), VOCAB + 7)))
        while read_msg(sock) is not None:  # heartbeats, the drop
            pass
    return answer


def failing_stage(real: m.RegisterStage):
    """A prefill stage that fails the room with an odd status and a 100,000-character reason."""
    def answer(sock):
        read_msg(sock)  # the hello
        while not isinstance(msg := read_msg(sock), m.RoomBootstrap):
            if msg is None:
                return
        sock.sendall(frame(m.RoomFailed(msg.room, msg.nonce, real.rank, "x" * 100_000, 200)))
        while read_msg(sock) is not None:
            pass
    return answer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A real prefill (PP 1) and a real PD decode (PP 1) on the tiny model, both insecure."""
    model = save_tiny_model("llama", tmp_path_factory.mktemp("hostile"))
    bport = free_port()
    insecure = ("--disaggregation-insecure", "--max-stage-restarts", "3")
    procs, urls = {}, {}
    procs["prefill"], urls["prefill"] = spawn_server(
        model, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
        str(bport), *insecure)
    procs["decode"], urls["decode"] = spawn_server(
        model, "--disaggregation-mode", "decode", "--disaggregation-connect-timeout",
        str(CONNECT_TIMEOUT_S), *insecure)
    try:
        for name in procs:
            wait_healthy(procs[name], urls[name])
        yield procs, urls, bport, model
    finally:
        stop(*procs.values())


def post(url: str, port, room: int, timeout: float = 60, host="127.0.0.1") -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
        "bootstrap_room": room, "bootstrap_host": host, "bootstrap_port": port})


def stage_pids(proc) -> set[int]:
    return {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}


def served_normally(urls: dict, bport: int, room: int) -> httpx.Response:
    """The router's way: the same body to the prefill and the decode at once."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fp = pool.submit(post, urls["prefill"], bport, room)
        fd = pool.submit(post, urls["decode"], bport, room)
        assert fp.result().status_code == 200, fp.result().text
        return fd.result()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fake_bootstraps_fail_their_requests_and_the_decode_serves_on(pair):
    procs, urls, bport, _ = pair
    first = served_normally(urls, bport, room=100)
    assert first.status_code == 200, first.text
    pids = stage_pids(procs["decode"])
    real = lookup_prefill(m.Endpoint("127.0.0.1", bport), 10)
    liar = FakePeer(lying_stage(real.stages[0]))
    failer = FakePeer(failing_stage(real.stages[0]))
    failing = msgspec.structs.replace(real.stages[0],
                                      endpoint=m.Endpoint("127.0.0.1", failer.port))
    wide = msgspec.structs.replace(real.stages[0], endpoint=m.Endpoint("127.0.0.1", 70000))
    lying = msgspec.structs.replace(real.stages[0],
                                    endpoint=m.Endpoint("127.0.0.1", liar.port))
    fakes = {"no stages": (FakePeer(answers(m.PrefillInfo([]))), 502, "lists no prefill stage"),
             "port 70000": (FakePeer(answers(m.PrefillInfo([wide]))), 502,
                            "stage 0's port must be a TCP port"),
             "trickle": (FakePeer(trickle), 504,
                         f"did not finish answering within {CONNECT_TIMEOUT_S:g} s"),
             "closes at once": (FakePeer(close_at_once), 502, "cannot reach"),
             "token outside the vocabulary": (FakePeer(answers(m.PrefillInfo([lying]))), 502,
                                              f"first token {VOCAB + 7} is outside the "
                                              "vocabulary"),
             "a 100,000-character failure": (FakePeer(answers(m.PrefillInfo([failing]))), 500,
                                             "failed: prefill stage 0 failed: xxx")}
    try:
        for room, (name, (peer, status, needle)) in enumerate(fakes.items(), start=200):
            t0 = time.monotonic()
            r = post(urls["decode"], peer.port, room, timeout=30)
            took = time.monotonic() - t0
            print(f"fake bootstrap '{name}': HTTP {r.status_code} after {took:.2f} s")
            assert r.status_code == status, (name, r.text)
            assert f"bootstrap 127.0.0.1:{peer.port}" in r.text and needle in r.text, r.text
            assert len(r.text) < 5000, f"{name}: a {len(r.text)}-character answer"
            assert took < CONNECT_TIMEOUT_S + 2, f"{name}: the request took {took:.1f} s"
        # Fields the decode cannot use are refused at the door.
        for port, host in ((70000, "127.0.0.1"), ("8998", "127.0.0.1"), (bport, "a b")):
            r = post(urls["decode"], port, 250, host=host)
            assert r.status_code == 400 and "bootstrap_" in r.text, r.text
        # The same stages serve on: nothing restarted, nothing was held.
        wait_pages_free(urls["decode"], 10)
        assert httpx.get(urls["decode"] + "/health", timeout=5).json()["status"] == "ok"
        assert metric(urls["decode"], "pipefill_stage_restarts_total") == 0
        assert stage_pids(procs["decode"]) == pids
        again = served_normally(urls, bport, room=300)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    finally:
        for peer, _, _ in fakes.values():
            peer.close()
        liar.close()
        failer.close()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_repeated_room_is_refused_on_both_sides_and_the_first_is_served(pair):
    """The prefill holds room 400's pages for its decode; a second request with room 400 gets
    a 400 there and at the decode (where the first waits for its KV from a silent bootstrap),
    and neither first request is touched."""
    procs, urls, bport, _ = pair
    held = post(urls["prefill"], bport, room=400)  # the prefill's side alone: it waits
    assert held.status_code == 200, held.text
    again = post(urls["prefill"], bport, room=400)
    assert again.status_code == 400 and "bootstrap_room 400 is already in use" in again.text
    served = post(urls["decode"], bport, room=400)  # the decode takes the first one's KV
    assert served.status_code == 200, served.text
    silent = FakePeer(lambda sock: time.sleep(CONNECT_TIMEOUT_S + 5))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(post, urls["decode"], silent.port, 401)
            time.sleep(1.0)  # admitted: its connect waits for the silent bootstrap
            dup = post(urls["decode"], silent.port, 401)
            assert dup.status_code == 400 and "bootstrap_room 401 is already in use" in dup.text
            first = waiting.result()
        assert first.status_code == 504 and "did not finish answering" in first.text, first.text
    finally:
        silent.close()
    assert metric(urls["decode"], "pipefill_stage_restarts_total") == 0


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_prefill_bootstrap_flag_refuses_other_bootstraps(pair):
    """A decode started with --disaggregation-prefill-bootstrap pairs with that prefill and
    takes no request naming another bootstrap (a 403 before anything is looked up)."""
    _, urls, bport, model = pair
    decode, url = spawn_server(model, "--disaggregation-mode", "decode",
                               "--disaggregation-insecure", "--disaggregation-prefill-bootstrap",
                               f"127.0.0.1:{bport}")
    other = FakePeer(close_at_once)
    try:
        wait_healthy(decode, url)
        r = post(url, other.port, 500)
        assert r.status_code == 403, r.text
        assert f"bootstrap 127.0.0.1:{other.port} is not a prefill this decode pairs with " \
               f"(--disaggregation-prefill-bootstrap 127.0.0.1:{bport})" in r.text
        assert not other.conns, "the decode looked the refused bootstrap up"
        served = served_normally({"prefill": urls["prefill"], "decode": url}, bport, room=501)
        assert served.status_code == 200, served.text
    finally:
        other.close()
        stop(decode)

