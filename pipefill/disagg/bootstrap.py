"""The bootstrap service on the prefill node (--disaggregation-bootstrap-port): every prefill
stage registers (rank, layers, transfer endpoint, page size, KV dtype, model fingerprint); a
decode looks the stages up and refuses to pair on any mismatch, with a sentence naming the flag.

One request per connection, framed and typed like the rest of the control plane (channel.py).
With a cluster secret every connection is authenticated first (channel's handshake): a peer
without the secret can neither register nor look up.

Who may replace a registered stage: the first registration of a rank is taken as is; a later
one for the same rank (a restarted stage) replaces it only when
  - it names the same transfer endpoint (the same listener: nothing changes for the decodes), or
  - the registered endpoint no longer answers: the connection is refused, or (with a secret)
    its handshake does not complete within PROBE_TIMEOUT_S, so that stage is dead or hung.
While the old endpoint still answers, the registration is refused with `retry` set, and
register_stage tries again until its timeout (a restarted stage's old process may still be
exiting). So a peer, even one with the secret, cannot divert the decodes away from a live
stage; without a secret (insecure mode) a plain TCP connect is the only proof of life.
"""
from __future__ import annotations

import logging
import threading
import time

from pipefill.disagg import channel as ch
from pipefill.disagg.handshake import AuthenticationFailed
from pipefill.disagg.heads import check_pairing, head_map_of
from pipefill.disagg import messages as m
from pipefill.disagg.validate import check_tiling

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 2.0  # a registered endpoint that answers no faster is taken for gone
MAX_CONNECTIONS = 64  # one request each: a few stages and decodes at a time


class BootstrapServer:
    """Serves on a listener's threads; `close()` stops it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8998, secret: bytes | None = None,
                 max_connections: int = MAX_CONNECTIONS):
        self._secret = secret
        self._lock = threading.Lock()
        self.stages: dict[int, m.RegisterStage] = {}
        self._listener = ch.Listener(host, port, self._answer, secret=secret,
                                     name="the PD bootstrap service",
                                     send_timeout_s=REQUEST_TIMEOUT_S,
                                     max_connections=max_connections,
                                     max_handshakes=max_connections,
                                     handshake_timeout_s=REQUEST_TIMEOUT_S)
        self.endpoint = m.Endpoint(host, self._listener.port)

    def close(self) -> None:
        self._listener.close()

    def _answer(self, conn: ch.Channel) -> None:
        conn.sock.settimeout(REQUEST_TIMEOUT_S)  # a silent client cannot hold a thread
        msg = conn.recv()
        if isinstance(msg, m.RegisterStage):
            conn.send(self.register(msg))
        elif isinstance(msg, m.Lookup):
            conn.send(self.lookup())
        else:
            conn.drops.drop(f"{type(msg).__name__} is not a bootstrap request")

    def register(self, msg: m.RegisterStage) -> m.Ack:
        with self._lock:
            error = self._mismatch(msg)
            old = self.stages.get(msg.rank)
        if error:
            return m.Ack(False, error)
        if old is not None and old.endpoint != msg.endpoint and self._answers(old.endpoint):
            log.warning("refused a registration of prefill stage %d at %s: the stage is "
                        "registered at %s, which still answers", msg.rank, msg.endpoint,
                        old.endpoint)
            return m.Ack(False, f"stage {msg.rank} is registered at {old.endpoint}, which still "
                         "answers: a stage is replaced only once its old endpoint is gone",
                         retry=True)
        with self._lock:
            if self.stages.get(msg.rank) is not old:
                return m.Ack(False, f"stage {msg.rank} registered again meanwhile", retry=True)
            self.stages[msg.rank] = msg
        log.info("prefill stage %d registered: layers [%d, %d), transfer endpoint %s",
                 msg.rank, msg.layer_start, msg.layer_end, msg.endpoint)
        return m.Ack(True)

    def _mismatch(self, msg: m.RegisterStage) -> str:
        """Why msg cannot join the stages registered so far ("" when it can); under the lock."""
        for s in (s for r, s in self.stages.items() if r != msg.rank):
            if (s.pp_size, s.model_fingerprint, s.page_size, s.kv_dtype) != \
                    (msg.pp_size, msg.model_fingerprint, msg.page_size, msg.kv_dtype):
                return (f"stage {msg.rank} does not match stage {s.rank} "
                        "(pp size, model, page size or KV dtype differ)")
        if not 0 <= msg.rank < msg.pp_size:
            return f"rank {msg.rank} is outside [0, {msg.pp_size})"
        return ""

    def _answers(self, endpoint: m.Endpoint) -> bool:
        """Whether a stage still listens at endpoint (and, with a secret, proves it)."""
        try:
            ch.connect(endpoint, PROBE_TIMEOUT_S, self._secret,
                       name=f"registered stage {endpoint}").close()
            return True
        except OSError:  # refused, unreachable, or no (authentic) handshake in time
            return False

    def endpoints(self) -> list[m.Endpoint]:
        """The registered stages' transfer endpoints (a restarted stage's current one)."""
        with self._lock:
            return [s.endpoint for s in self.stages.values()]

    def lookup(self) -> m.PrefillInfo | m.NotReady:
        with self._lock:
            stages = sorted(self.stages.values(), key=lambda s: s.rank)
        if not stages or len(stages) < stages[0].pp_size:
            have = [s.rank for s in stages]
            return m.NotReady(f"prefill stages registered so far: {have}")
        return m.PrefillInfo(stages)


def _request(endpoint: m.Endpoint, msg: m.Message, secret: bytes | None) -> m.Message:
    conn = ch.connect(endpoint, REQUEST_TIMEOUT_S, secret, name=f"bootstrap {endpoint}",
                      send_timeout_s=REQUEST_TIMEOUT_S)
    try:
        conn.sock.settimeout(REQUEST_TIMEOUT_S)
        conn.send(msg)
        return conn.recv()
    finally:
        conn.close()


def register_stage(endpoint: m.Endpoint, msg: m.RegisterStage, timeout_s: float = 60.0,
                   secret: bytes | None = None) -> None:
    """Registers a prefill stage, retrying while the service is not up yet (or while the
    stage's previous process still answers at its old endpoint)."""
    deadline, delay = time.monotonic() + timeout_s, 0.1
    while True:
        try:
            ack = _request(endpoint, msg, secret)
            if not isinstance(ack, m.Ack) or not ack.retry:
                break
            last = ack.error
        except AuthenticationFailed as e:
            raise RuntimeError(f"the bootstrap service at {endpoint}: {e}") from None
        except (OSError, ch.ConnectionClosed) as e:
            last = str(e)
        if time.monotonic() + delay > deadline:
            raise RuntimeError(f"the bootstrap service at {endpoint} did not take stage "
                               f"{msg.rank} within {timeout_s:g} s: {last}") from None
        time.sleep(delay)
        delay = min(2 * delay, 2.0)
    if not isinstance(ack, m.Ack) or not ack.ok:
        raise RuntimeError(f"the bootstrap service at {endpoint} refused stage {msg.rank}: "
                           f"{getattr(ack, 'error', ack)}")


def lookup_prefill(endpoint: m.Endpoint, timeout_s: float = 60.0,
                   secret: bytes | None = None) -> m.PrefillInfo:
    """The prefill's stages once all of them registered; RuntimeError after timeout_s."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while True:
        try:
            reply = _request(endpoint, m.Lookup(), secret)
            if isinstance(reply, m.PrefillInfo):
                return reply
            last = getattr(reply, "reason", repr(reply))
        except AuthenticationFailed as e:
            raise RuntimeError(f"the prefill at bootstrap {endpoint}: {e}") from None
        except (OSError, ch.ConnectionClosed) as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the prefill at bootstrap {endpoint} is not ready after "
                               f"{timeout_s:g} s ({last})")
        time.sleep(0.2)


def check_compatible(info: m.PrefillInfo, *, page_size: int, kv_dtype: str,
                     model_fingerprint: str, backend: str, num_layers: int,
                     kv_layout: str = "token-major", kv_latent=(),
                     kv_heads: list[list[int]] | None = None,
                     window_layers: list[int] | None = None) -> None:
    """Raises ValueError naming the flag to change when this decode cannot take the prefill's
    KV; also checks that the prefill stages' layers tile [0, num_layers). kv_latent: this
    decode's m.latent_layout (a latent-attention model's pages), checked first, with its
    dtype: both sides must read a page's values alike. kv_heads: this decode stage's TP
    ranks' KV heads (disagg/heads.py; None: not checked), which every prefill stage's ranks
    must be able to give. window_layers: the model's layers whose KV this decode keeps in window
    pages (ARCHITECTURE.md, 'Window pages'; None: not checked); each prefill stage must keep
    the same of its own layers there."""
    s = info.stages[0]
    mine = list(kv_latent)
    if (s.kv_latent or mine) and (list(s.kv_latent), s.kv_dtype) != (mine, kv_dtype):
        raise ValueError(f"the prefill server's KV pages hold "
                         f"{m.describe_kv(list(s.kv_latent), s.kv_dtype)}, this decode's "
                         f"{m.describe_kv(mine, kv_dtype)}: a pair must agree on the latent "
                         "layout; start both with the same --model-path, --dtype and "
                         "--kv-cache-dtype")
    if s.model_fingerprint != model_fingerprint or s.num_layers != num_layers:
        raise ValueError("the prefill server runs a different model: start both with the same "
                         "--model-path")
    if s.page_size != page_size:
        raise ValueError(f"the prefill server uses --page-size {s.page_size}, this decode "
                         f"{page_size}: start both with the same --page-size")
    if s.kv_dtype != kv_dtype:
        raise ValueError(f"the prefill server's KV cache is {s.kv_dtype}, this decode's "
                         f"{kv_dtype}: start both with the same --dtype and "
                         "--kv-cache-dtype")
    if s.kv_layout != kv_layout:
        raise ValueError(f"the prefill server's KV pages are {s.kv_layout}, this decode's "
                         f"{kv_layout} (the AMX attention kernel packs them): start both with "
                         "the same --attention-backend")
    if s.backend != backend:
        raise ValueError(f"the prefill server uses --disaggregation-transfer-backend "
                         f"{s.backend}, this decode {backend}: use the same on both")
    if kv_heads is not None:
        mine_heads = len(set().union(*map(set, kv_heads)))
        for st in info.stages:
            try:
                check_pairing(head_map_of(st.kv_heads, st.num_kv_heads), kv_heads,
                              st.num_kv_heads, mine_heads)
            except ValueError as e:
                raise ValueError(f"the prefill server's stage {st.rank} cannot give this "
                                 f"decode's TP ranks their KV heads: {e}") from None
    if window_layers is not None:
        check_window_layers(info.stages, window_layers)
    check_tiling(info.stages, num_layers)


def check_window_layers(stages, window_layers: list[int]) -> None:
    """Both sides keep the same layers' KV in window pages, or none: a page crosses only for
    the layers both address alike."""
    for st in stages:
        mine = [i for i in window_layers if st.layer_start <= i < st.layer_end]
        if list(st.window_layers) != mine:
            def say(layers):
                return "in window pages freed outside the window" if layers else \
                    "for every token"
            raise ValueError(f"the prefill server's stage {st.rank} keeps the sliding-window "
                             f"layers' KV {say(st.window_layers)}, this decode {say(mine)}: "
                             "both must agree (the same model, and a pipefill that keeps "
                             "window pages on both); start both alike")
