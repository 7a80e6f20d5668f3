"""A real `pipefill serve` against hostile clients over real sockets: bodies sent half-way and
headers sent a byte at a time are cut after their read timeouts (and the server lets go of the
bytes), connections beyond --max-connections and requests beyond --max-queued-requests are
refused with a sentence, a long prompt is tokenized while /health answers, a client that leaves
mid-body is one INFO line, and max_completion_tokens 0 is a 400."""
import json
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipefill.bench.memory import proc_status_bytes
from test_server import chat_model, start_server, stop_server  # noqa: F401 - a fixture

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

READ_TIMEOUT_S = 2  # headers and bodies; low so that the cuts come quickly
MAX_CONNECTIONS = 70
MAX_MODEL_LEN = 8192  # past the tiny model's 4,096: room for a ~1 MB text prompt to be read
WAIT_S = 30  # the most any test waits for the server to act (a bound on hanging, not a timing)


@pytest.fixture(scope="module")
def server(chat_model):  # noqa: F811
    """One stage, one running request and one queued at most; its log is read as it comes,
    and must hold no traceback at the end."""
    proc, url = start_server(
        chat_model, None, "--pp-size", "1", "--max-model-len", str(MAX_MODEL_LEN),
        "--header-read-timeout", str(READ_TIMEOUT_S), "--body-read-timeout",
        str(READ_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
        "--max-running-requests", "1", "--max-queued-requests", "1")
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    yield proc, url, log
    assert stop_server(proc) == 0
    reader.join(10)
    assert not [line for line in log if "Traceback" in line], "".join(log[-200:])


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes the connection; raises if it has not
    closed it by the deadline."""
    data = b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def metric(url: str, name: str, client=httpx) -> float | None:
    for family in text_string_to_metric_families(client.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def rss_mib(pid: int) -> float:
    return proc_status_bytes(pid, "VmRSS") / 2**20


def error_of(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert err["code"] == r.status_code and len(err["message"].split()) >= 6, err
    return err


def half_sent_bodies(pid: int, url: str, n: int = 60) -> tuple[list[bytes], float]:
    """n clients send 1.4 MB of a 2 MB body and stop; returns what each got before the server
    closed its connection, and the server's peak resident memory (MiB) meanwhile."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(address(url))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 2000000\r\n\r\n")
        sock.sendall(b'{"prompt": "' + b"a" * 1_400_000)
        socks.append(sock)
    peak = [rss_mib(pid)]
    sampling = threading.Event()

    def sample():
        while not sampling.is_set():
            peak.append(rss_mib(pid))
            time.sleep(0.05)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    deadline = time.monotonic() + WAIT_S
    try:
        return [read_until_closed(sock, deadline) for sock in socks], max(peak)
    finally:
        sampling.set()
        sampler.join()
        for sock in socks:
            sock.close()


def test_half_sent_bodies_are_cut_and_not_held(server):
    """60 clients stop half-way through their bodies: each gets a 408 after the body read
    timeout and its connection is closed. The bytes are let go: after a second such wave the
    server's resident memory has not piled up to two waves' worth (glibc may keep freed heap
    pages for reuse, so "let go" is measured as not piling up, not as falling back to the
    baseline; the bound is 1.5 waves, not 1, because reuse fragments: a CI run ended 1 MiB
    over one wave's 55 MiB, where bodies held per connection would have left 110)."""
    proc, url, _ = server
    baseline = rss_mib(proc.pid)
    answers, peak = half_sent_bodies(proc.pid, url)
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[0][:300]
    assert b"--body-read-timeout" in answers[0]
    held = peak - baseline
    assert held > 40, f"the bodies never showed in the server's memory (+{held:.0f} MiB)"
    answers, _ = half_sent_bodies(proc.pid, url)
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[0][:300]
    after = rss_mib(proc.pid) - baseline
    assert after < 1.5 * held, f"+{after:.0f} MiB after two waves of +{held:.0f} MiB each"
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_slow_or_missing_headers_are_cut(server):
    """A connection that sends nothing, one that sends its headers a byte every 0.2 s, and a
    kept-alive one whose next request trickles the same way are all closed by the server."""
    _, url, _ = server
    silent = socket.create_connection(address(url))
    trickling = socket.create_connection(address(url))
    kept = socket.create_connection(address(url))
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = b""
    while not first.endswith(b'{"status":"ok"}'):
        first += kept.recv(65536)
    assert first.startswith(b"HTTP/1.1 200 ")
    deadline = time.monotonic() + WAIT_S
    open_ = {"trickling": trickling, "kept": kept}
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 10_000
    for i in range(len(head)):
        for name, sock in list(open_.items()):
            try:
                sock.sendall(head[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                del open_[name]  # closed by the server
        if not open_:
            break
        assert time.monotonic() < deadline, f"still open: {sorted(open_)}"
        time.sleep(0.2)
    for sock in (trickling, kept):
        assert read_until_closed(sock, deadline) == b""
    assert read_until_closed(silent, deadline) == b""
    for sock in (silent, trickling, kept):
        sock.close()


def test_connections_beyond_the_limit_get_503(server):
    """With --max-connections open, one more connection's request gets a 503 with a sentence
    and Retry-After and is closed; once they close, requests are served again."""
    _, url, _ = server
    held = [socket.create_connection(address(url)) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = socket.create_connection(address(url))
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_until_closed(extra, time.monotonic() + WAIT_S)
        extra.close()
    finally:
        for sock in held:
            sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower(), head
    message = json.loads(body)["error"]["message"]
    assert "--max-connections" in message and len(message.split()) >= 6, message
    deadline = time.monotonic() + WAIT_S
    while httpx.get(url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "connections were not released"
        time.sleep(0.1)


def start_stream(url: str) -> httpx.Response:
    """A streamed chat request that runs for a long time, once its first event arrived (it
    holds its place from then on)."""
    client = httpx.Client(timeout=WAIT_S)
    r = client.send(client.build_request("POST", url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4000,
        "ignore_eos": True, "stream": True}), stream=True)
    assert r.status_code == 200
    r.lines = r.iter_lines()  # kept: a dropped iterator closes the response
    assert next(r.lines).startswith("data:")
    r.client = client
    return r


def test_a_full_queue_gets_429_with_retry_after(server):
    """--max-running-requests 1 and --max-queued-requests 1: a third request is refused with
    429, Retry-After and a sentence; when the two end, requests are accepted again."""
    _, url, _ = server
    streams = [start_stream(url), start_stream(url)]
    try:
        r = httpx.post(url + "/v1/completions", timeout=WAIT_S,
                       json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        err = error_of(r)
        assert "--max-queued-requests 1" in err["message"], err
        assert err["type"] == "rate_limit_error"
        assert metric(url, "pipefill_requests_held") == 2
    finally:
        for s in streams:
            s.close()
            s.client.close()
    deadline = time.monotonic() + WAIT_S
    while metric(url, "pipefill_requests_held") != 0:
        assert time.monotonic() < deadline, "the closed streams kept their places"
        time.sleep(0.1)
    r = httpx.post(url + "/v1/completions", timeout=WAIT_S,
                   json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert metric(url, "pipefill_requests_queue_full_total") >= 1


def test_a_long_prompt_is_tokenized_while_health_answers(server):
    """A ~1 MB text prompt (0.5-1 s of tokenizing) must not stop the event loop: some /health
    is answered between two /metrics answers that both show the prompt in the tokenizer."""
    _, url, _ = server
    prompt = "hello world, " * 75_000  # 225,000 tokens: a 400 once tokenized
    big: dict = {}

    def send_big():
        big["response"] = httpx.post(url + "/v1/completions", timeout=WAIT_S,
                                     json={"prompt": prompt, "max_tokens": 1})
    sender = threading.Thread(target=send_big)
    sender.start()
    witnessed = 0
    with httpx.Client(timeout=WAIT_S) as client:
        def tokenizing() -> bool:
            return metric(url, "pipefill_requests_tokenizing", client) == 1
        while sender.is_alive():
            if tokenizing():
                health = client.get(url + "/health")
                if health.status_code == 200 and tokenizing():
                    witnessed += 1
            time.sleep(0.02)  # leave the tokenizer thread the GIL for its Python part
    sender.join()
    assert big["response"].status_code == 400
    assert "exceeds --max-model-len" in big["response"].json()["error"]["message"]
    assert witnessed, "no /health was answered while the long prompt was being tokenized"


def test_a_client_leaving_mid_body_is_one_info_line(server):
    _, url, log = server
    sock = socket.create_connection(address(url))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1234)
    time.sleep(0.2)  # the server reads what came before the client leaves
    sock.close()
    deadline = time.monotonic() + WAIT_S
    while not [line for line in log if "after 1234 bytes" in line]:
        assert time.monotonic() < deadline, "".join(log[-50:])
        time.sleep(0.05)
    time.sleep(0.5)  # anything else it would log about this client comes now
    lines = [line for line in log if "after 1234 bytes" in line]
    assert len(lines) == 1 and " INFO " in lines[0], lines
    assert not [line for line in log if "Traceback" in line or " ERROR " in line], \
        "".join(log[-50:])
    assert httpx.get(url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("route, body, name", [
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 0, "max_tokens": 5},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
])
def test_zero_max_tokens_is_a_400(server, route, body, name):
    """As OpenAI answers it: zero tokens is a bad request, not "no limit"."""
    _, url, _ = server
    prompt = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in route else {
        "prompt": "Hi"}
    r = httpx.post(url + route, json={**prompt, **body}, timeout=WAIT_S)
    assert r.status_code == 400, r.text[:300]
    err = error_of(r)
    assert err["message"].startswith(f"{name} must be at least 1, got 0"), err
    assert err["param"] == name
