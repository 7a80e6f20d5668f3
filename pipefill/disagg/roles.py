"""The transfer plane wired into the stages (DESIGN.md section 7): what a prefill stage and a
decode stage 0 do around their micro-batch loops.

Prefill, every stage: a KVSender registered with the bootstrap service; after each forward it
queues the whole pages the plan completed for each PD request (never blocking the loop); its
release callback reports ("kv_done", (room, rank)) on a socket of its own (ZMQ sockets are not
thread-safe), the front end forwards it to stage 0, and the scheduler keeps the request's pages
until every stage reported. Stage 0 also sends the final metadata (first token, logprobs, seed).

Decode, stage 0 (decode PP 1): a KVReceiver writing into stage 0's own KV pool; the loop thread
admits requests into pages, asks the prefill for their KV, polls finished rooms, and frees
pages the receiver let go (its callbacks run on its threads: they only queue, because PagePool
is not thread-safe). Received pages are treated as computed: the decode's prefix cache takes
them as it would its own pages.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
from collections import OrderedDict

from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import check_compatible, lookup_prefill, register_stage
from pipefill.disagg.transfer import KVTensors, Timing
from pipefill.runtime.platform import dtype_name
from pipefill.scheduler.scheduler import kv_send_end

log = logging.getLogger(__name__)

REMEMBERED_ROOMS = 4096
LOOKUP_TIMEOUT_S = 5.0  # the decode loop waits this long at most for an unready prefill
STARTUP_LOOKUP_TIMEOUT_S = 120.0  # --disaggregation-prefill-bootstrap: the prefill may load


def node_host(host: str) -> str:
    """The address peers reach this node at: the serving host, or this node's IP for a
    wildcard."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _secret(args) -> bytes | None:
    from pipefill.runtime.wire import read_cluster_secret
    return read_cluster_secret(args.cluster_secret, args.cluster_secret_file)


class _Seen:
    """A bounded set of room ids."""

    def __init__(self):
        self._d: OrderedDict[int, None] = OrderedDict()

    def add(self, room: int) -> bool:
        """True if the room was new."""
        if room in self._d:
            return False
        self._d[room] = None
        while len(self._d) > REMEMBERED_ROOMS:
            self._d.popitem(last=False)
        return True


class PrefillStagePD:
    def __init__(self, args, executor, rank: int, layer_start: int, cfg, report):
        from pipefill.disagg.transfer_sender import KVSender
        self.rank, self.page_size, self._report = rank, args.page_size, report
        self._lock = threading.Lock()
        self._opened, self._done = _Seen(), _Seen()
        secret = _secret(args)
        host = node_host(args.host)
        self.sender = KVSender(KVTensors.from_cache(executor.cache, layer_start), rank,
                               release=self._released, backend=args.disaggregation_transfer_backend,
                               host=host, timing=Timing.from_args(args), secret=secret)
        reg = self.sender.registration(pp_size=args.pp_size, num_layers=cfg.num_layers,
                                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                       model_fingerprint=m.model_fingerprint(cfg))
        register_stage(m.Endpoint(host, args.disaggregation_bootstrap_port), reg,
                       secret=secret)

    def after_forward(self, plan) -> None:
        for w in plan.seqs:
            if w.room is None:
                continue
            if self._opened.add(w.room):
                self.sender.open_room(w.room, sends_final=self.rank == 0)
            p0, p1 = w.kv_send_from // self.page_size, kv_send_end(w, self.page_size)
            is_last = w.sample is not None
            if p1 > p0 or is_last:
                self.sender.send_pages(w.room, p0, w.page_table[p0:p1], is_last)

    def poll(self, scheduler) -> list:
        return []

    def after_update(self, scheduler, outputs) -> None:
        """Stage 0: the first token of a PD request is the room's final metadata."""
        for out in outputs:
            r = scheduler.running.get(out.rid)
            if r is None or r.pd is None:
                continue
            if out.finish_reason == "error" or not out.new_token_ids:
                self.sender.fail_room(r.pd.room, out.error or "the prefill failed")
                continue
            top = out.top_logprobs[0] if out.top_logprobs else None
            logprob = out.token_logprobs[0] if out.token_logprobs else None
            self.sender.send_final(r.pd.room, m.FinalMeta(
                r.pd.room, 0, len(r.prompt_ids), out.new_token_ids[0], logprob,
                [tuple(t) for t in top] if top is not None else None,
                r.seed.to_bytes(4, "little")))

    def _released(self, room: int, pages: list[int]) -> None:
        with self._lock:  # called from the sender's threads
            if self._done.add(room):
                self._report("kv_done", (room, self.rank))


class DecodeStagePD:
    def __init__(self, args, executor, cfg):
        from pipefill.disagg.transfer_receiver import KVReceiver
        self.args, self.cfg, self.executor = args, cfg, executor
        self.secret = _secret(args)
        self.kv = KVTensors.from_cache(executor.cache, 0)
        self._released_rooms: queue.SimpleQueue = queue.SimpleQueue()
        self.receiver = KVReceiver(self.kv, release=lambda room, pages:
                                   self._released_rooms.put(room),
                                   backend=args.disaggregation_transfer_backend,
                                   host=node_host(args.host), timing=Timing.from_args(args),
                                   secret=self.secret)
        if args.disaggregation_prefill_bootstrap:  # check the pairing at start-up
            host, _, port = args.disaggregation_prefill_bootstrap.rpartition(":")
            key = f"{host}:{port}"
            try:
                self.connect(key, m.Endpoint(host, int(port)), STARTUP_LOOKUP_TIMEOUT_S)
            except ValueError as e:
                raise ValueError(f"this decode cannot pair with the prefill at "
                                 f"--disaggregation-prefill-bootstrap {key}: {e}") from None

    def after_forward(self, plan) -> None:
        pass

    def after_update(self, scheduler, outputs) -> None:
        pass

    def poll(self, scheduler) -> list:
        """On the loop thread: the outputs of rooms that ended, after new ones were asked
        for and aborted ones dropped."""
        outputs = []
        admitted = scheduler.admit_kv()
        if admitted:  # replay the frees first: the new pages may be ones freed since the plan
            ops = scheduler.kv.drain_ops()
            self.executor.apply_page_ops(ops)
            self.executor.finish_page_ops(ops)
        for r in admitted:
            self.executor.owners.allocate(r.rid, r.pages)
            error = self._expect(r)
            if error is not None:
                scheduler.kv_released(r.pd.room)
                outputs.append(scheduler.kv_failed(r.pd.room, error))
        for room in scheduler.dropped_rooms:
            self.receiver.drop_room(room, "the client went away")
        scheduler.dropped_rooms.clear()
        for res in self.receiver.take_finished():
            out = self._finished(scheduler, res)
            if out is not None:
                outputs.append(out)
        while not self._released_rooms.empty():
            scheduler.kv_released(self._released_rooms.get())
        return [o for o in outputs if o is not None]

    def _finished(self, scheduler, res):
        if not res.ok:
            return scheduler.kv_failed(res.room, f"the KV transfer from the prefill server "
                                                 f"failed: {res.reason}")
        r = scheduler.rooms.get(res.room)
        f = res.final
        if r is None or f is None or f.num_prompt_tokens != len(r.prompt_ids):
            scheduler.kv_released(res.room)
            return scheduler.kv_failed(res.room, "the prefill's final metadata does not match "
                                                 "this request")
        self.executor.owners.mark_written(r.pages)
        seed = int.from_bytes(f.sampling_state, "little") if f.sampling_state else None
        return scheduler.kv_arrived(res.room, f.first_token, f.logprob, f.top_logprobs, seed)

    def _expect(self, r) -> str | None:
        """Asks the prefill for r's KV; a sentence when that cannot be done."""
        key = f"{r.pd.host}:{r.pd.port}"
        try:
            if not self.receiver.connected(key):
                self.connect(key, m.Endpoint(r.pd.host, r.pd.port))
            self.receiver.expect_room(r.pd.room, key, list(r.pages),
                                      num_prompt_tokens=len(r.prompt_ids))
        except (RuntimeError, ValueError, OSError) as e:
            log.warning("room %d: %s", r.pd.room, e)
            return f"cannot take KV from the prefill server at bootstrap {key}: {e}"
        return None

    def connect(self, key: str, endpoint: m.Endpoint, timeout_s: float = LOOKUP_TIMEOUT_S):
        info = lookup_prefill(endpoint, timeout_s, self.secret)
        check_compatible(info, page_size=self.kv.page_size, kv_dtype=dtype_name(self.kv.dtype),
                         model_fingerprint=m.model_fingerprint(self.cfg),
                         backend=self.args.disaggregation_transfer_backend,
                         num_layers=self.cfg.num_layers, kv_layout=self.kv.layout)
        self.receiver.connect(key, info)
