"""The transfer plane wired into the stages (ARCHITECTURE.md, 'Prefill/decode
disaggregation'): what a prefill stage and a decode stage do around their micro-batch loops.
Each is the stage's PD role (pipefill.scheduler.role): the scheduler's half (admission,
release) comes from PrefillRole or DecodeRole, the loop's hooks are here.

Prefill, every stage: a KVSender registered with the bootstrap service; after each forward it
queues the whole pages the plan completed for each PD request (never blocking the loop); its
release callback reports (room, rank) to stage 0 (a later stage through the pipeline, see
runtime.loop.report_to_first; stage 0 to itself), and the scheduler keeps the request's pages
until every stage reported. Stage 0 also sends the final metadata (first token, logprobs, seed).

Decode, every stage: a KVReceiver writing its own layers into its own KV pool. Stage 0's loop
thread admits requests into pages, asks the prefill for their KV (and tells the later stages
to do the same for their layers, see DecodeStagePD), polls finished rooms, and frees pages the
receivers let go (callbacks run on the receiver's threads: they only queue, because PagePool
is not thread-safe). Received pages are treated as computed: the decode's prefix cache takes
them as it would its own pages.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from pipefill.disagg import messages as m
from pipefill.disagg.bootstrap import check_compatible, register_stage
from pipefill.disagg.connector import (BAD_ANSWER, Deadline, PeerError, PrefillConnector,
                                       as_peer_error, lookup)
from pipefill.disagg.decode_rooms import DecodePipelineRooms
from pipefill.disagg.transfer import StageTensors, Timing
from pipefill.disagg.transfer_receiver import KVReceiver
from pipefill.disagg.transfer_sender import KVSender
from pipefill.disagg.validate import check_final_meta, check_prefill_info, parse_bootstraps
from pipefill.base.platform import dtype_name
from pipefill.kv.storage_tier import page_dims
from pipefill.scheduler.role import DecodeRole, PrefillRole, kv_send_end

log = logging.getLogger(__name__)
# "pd-timeline" debug lines carry wall-clock stamps of a room's last moments (last chunk's
# forward end, each prefill stage's pages all sent and released, decode ready on every stage)
# for `pipefill bench pd-serving`, which compares them with the client's first token on the
# same machine.
TIMELINE = "pd-timeline room %d %s %.6f"

REMEMBERED_ROOMS = 4096
MAX_REASON = 2000  # characters of a prefill's failure reason passed on: a sentence, not a dump
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


class PrefillStagePD(PrefillRole):
    """A prefill stage's role. to_first: how a later stage reports to stage 0 (stage 0 reports
    to its own queue, taken at the next poll)."""

    def __init__(self, args, executor, rank: int, layer_start: int, cfg, to_first=None,
                 stage_kv: StageTensors | None = None):
        """stage_kv: a TP stage's ranks' KV (runtime/tp.py maps the peers'); None: this
        process's cache is the stage's."""
        super().__init__(num_stages=args.pp_size)
        self.rank, self.page_size = rank, args.page_size
        self._own_reports: queue.SimpleQueue = queue.SimpleQueue()  # stage 0
        self._to_first = to_first or self._own_reports.put
        self._lock = threading.Lock()
        self._opened, self._done = _Seen(), _Seen()
        disagg = args.disagg
        secret = disagg.secret()
        host = node_host(args.host)
        kv = stage_kv or StageTensors.of_cache(executor.cache, layer_start)
        self.sender = KVSender(kv, rank, release=self._released,
                               backend=disagg.transfer_backend, host=host,
                               timing=Timing.of(disagg), secret=secret)
        # The pages' head size: half a latent for MLA (KVSpec); the heads: the stage's.
        head_dim = page_dims(executor.cache)[1]
        reg = self.sender.registration(pp_size=args.pp_size, num_layers=cfg.num_layers,
                                       num_kv_heads=self.sender.kv.num_kv_heads,
                                       head_dim=head_dim,
                                       model_fingerprint=m.model_fingerprint(cfg),
                                       kv_latent=m.latent_layout(cfg))
        register_stage(m.Endpoint(host, disagg.bootstrap_port), reg, secret=secret)

    def after_forward(self, plan) -> None:
        for w in plan.seqs:
            if w.room is None:
                continue
            if self._opened.add(w.room):
                self.sender.open_room(w.room, sends_final=self.rank == 0)
            p0, p1 = w.kv_send_from // self.page_size, kv_send_end(w, self.page_size)
            is_last = w.sample is not None
            if is_last:
                log.debug(TIMELINE, w.room, f"stage{self.rank}-last-forward-end", time.time())
            window = (w.window_table if is_last and self.sender.kv.window is not None
                      else None)  # 'Window pages'
            if p1 > p0 or is_last:
                self.sender.send_pages(w.room, p0, w.page_table[p0:p1], is_last, window)

    def poll(self, scheduler) -> list:
        """Stage 0: its own sender's reports."""
        while not self._own_reports.empty():
            self.on_kv_done(scheduler, self._own_reports.get())
        return []

    def on_kv_done(self, scheduler, event) -> None:
        """Stage 0: one stage's sender is done with a room; its pages may go when all are."""
        self.stage_done(scheduler, event[0])

    def after_update(self, scheduler, outputs) -> None:
        """Stage 0: the first token of a PD request is the room's final metadata."""
        for out in outputs:
            held = self.held(out.rid)
            if held is None:
                continue
            r, room = held.request, held.room
            if out.finish_reason == "error" or not out.new_token_ids:
                self.sender.fail_room(room, out.error or "the prefill failed")
                continue
            top = out.top_logprobs[0] if out.top_logprobs else None
            logprob = out.token_logprobs[0] if out.token_logprobs else None
            self.sender.send_final(room, m.FinalMeta(
                room, 0, len(r.prompt_ids), out.new_token_ids[0], logprob,
                [tuple(t) for t in top] if top is not None else None,
                r.seed.to_bytes(4, "little")))

    def stats(self) -> dict:
        """Pages this stage's sender moved: of the global layers, and of the window layers."""
        return {"kv_pages_sent": self.sender.pages_sent,
                "kv_window_pages_sent": self.sender.window_pages_sent,
                "kv_bytes_sent": self.sender.bytes_sent}

    def _released(self, room: int, pages: list[int]) -> None:
        log.debug(TIMELINE, room, f"stage{self.rank}-released", time.time())
        with self._lock:  # called from the sender's threads
            if self._done.add(room):
                self._to_first((room, self.rank))


def _passed_on(status: int) -> bool:
    """Whether a failed room's status reaches the client as it is: a refusal of the request
    (4xx) or a prefill that answered badly or too slowly (502, 504); anything else is a fault
    of this server (500)."""
    return 400 <= status < 500 or status in (502, 504)


@dataclass
class _Asked:
    """A room whose KV this stage asks for once it is connected to the room's prefill."""
    room: int
    pages: list[int]
    num_prompt_tokens: int
    window_pages: list[int] = ()  # the window page of each of pages (-1: none)


class DecodeStagePD(DecodeRole):
    """Decode, every stage of the pipeline. Each stage receives its own layers' KV from the
    prefill stages that hold them, into the pages stage 0 chose. Stage 0 admits and tells the
    later stages through "pd" control messages down the pipe (in order with the plans, and
    sent at once, not with the next plan: a room waiting for its KV is in no plan): ("expect",
    ...) allocates the room's pages on that stage and asks its prefill stages for their KV,
    ("ready", pages) marks them written just before the first plan that reads them, ("drop",
    room) ends a room that failed elsewhere or was aborted. A later stage reports back through
    the pipeline the way prefill stages report kv_done (to_first): (room, rank) when it has
    all its layers, (room, -rank) once its room failed and its receiver let the pages go.
    Stage 0 declares a room ready only when every stage has all of its layers
    (decode_rooms.DecodePipelineRooms), and frees its pages only when no stage can write them.

    Looking a prefill up and connecting to its stages happens on a PrefillConnector's worker
    threads, never on the loop thread: a room for a prefill this stage is not connected to
    waits in `_awaiting_connect` until the connect ends, then is asked for or failed with the
    connect's status (502/504) and sentence."""

    def __init__(self, args, executor, cfg, info=None, to_first=None,
                 stage_kv: StageTensors | None = None):
        super().__init__()
        self.args, self.cfg, self.executor = args, cfg, executor
        self.disagg = disagg = args.disagg
        self.rank = info.rank if info is not None else 0
        self.secret = disagg.secret()
        self.kv = stage_kv or StageTensors.of_cache(executor.cache,
                                                    info.layers.start if info else 0)
        # The whole decode pipeline's layers: a prefill stage learns how many decode stages
        # will bootstrap each room from it.
        self.layer_ranges = [(r.start, r.stop) for r in args.layout.ranges]
        self._released_rooms: queue.SimpleQueue = queue.SimpleQueue()
        self.receiver = KVReceiver(self.kv, release=lambda room, pages:
                                   self._released_rooms.put(room),
                                   backend=disagg.transfer_backend,
                                   host=node_host(args.host), timing=Timing.of(disagg),
                                   secret=self.secret)
        self.pipeline = DecodePipelineRooms(args.pp_size)  # stage 0
        self._own: dict[int, object] = {}  # stage 0: room -> its own RoomResult, until ready
        self._reports: queue.SimpleQueue = queue.SimpleQueue()  # stage 0: later stages' kv_done
        self._down: list = []  # stage 0: "pd" ops for the later stages, sent before any plan
        self._down_page_ops = None
        self._to_first = to_first  # a later stage: reports to stage 0
        # prefill key -> rooms waiting on its connect; a later stage takes rooms out of it on
        # connect workers and its loop thread, under the lock
        self._lock = threading.RLock()
        self._awaiting_connect: dict[str, list[_Asked]] = {}
        self._connects: queue.SimpleQueue = queue.SimpleQueue()  # stage 0: (key, error) ended
        self.connector = PrefillConnector(
            self.connect, disagg.connect_timeout,
            self._connect_done if self.rank == 0 else self._connected_later)
        for host, port in sorted(parse_bootstraps(disagg.prefill_bootstrap) or ()):
            self._check_pairing(host, port)
        if self.rank > 0:
            threading.Thread(target=self._watch, name="pd-decode-watch", daemon=True).start()

    def _check_pairing(self, host: str, port: int) -> None:
        """--disaggregation-prefill-bootstrap: pairs with that prefill before serving (the
        loop does not run yet: waiting here blocks no request)."""
        key = f"{host}:{port}"
        deadline = Deadline(STARTUP_LOOKUP_TIMEOUT_S)
        try:
            self.connect(key, m.Endpoint(host, port), deadline, retry_unreachable=True)
        except Exception as e:  # noqa: BLE001 - every failure is the same sentence
            raise ValueError(f"this decode cannot pair with the prefill at "
                             f"--disaggregation-prefill-bootstrap {key}: "
                             f"{as_peer_error(e, key, deadline)}") from None
        finally:
            deadline.cancel()

    def on_kv_done(self, scheduler, event) -> None:
        """Stage 0, through the pipe: a later stage's (room, rank) or (room, -rank)."""
        self._reports.put(tuple(event))

    def take_down(self):
        """Stage 0: (ops, page_ops) for the later stages, or None."""
        if not self._down:
            return None
        down, self._down = (self._down, self._down_page_ops), []
        self._down_page_ops = None
        return down

    # ---- stage 0 ---------------------------------------------------------------------------

    def poll(self, scheduler) -> list:
        """On the loop thread: the outputs of rooms that ended, after new ones were asked
        for and aborted ones dropped."""
        outputs = []
        admitted = self.admit(scheduler)
        if admitted:  # replay the frees first: the new pages may be ones freed since the plan
            ops = scheduler.kv.drain_ops()
            self.executor.apply_page_ops(ops)  # on this stage's TP ranks too
            self._down_page_ops = ops  # the later stages replay them before the allocations
        for a in admitted:
            r, pd = a.request, a.pd
            self.executor.own_pages(r.rid, r.pages, r.window_pages)
            self._send_down(["expect", pd.room, r.rid, list(r.pages), pd.host, pd.port,
                             len(r.prompt_ids), list(r.window_pages)])
            self.pipeline.open(pd.room)
            asked = _Asked(pd.room, list(r.pages), len(r.prompt_ids), list(r.window_pages))
            error = self._ask(f"{pd.host}:{pd.port}", m.Endpoint(pd.host, pd.port), asked)
            if error is not None:
                self._fail_unasked(scheduler, pd.room, error, outputs)
        while not self._connects.empty():
            self._connect_ended(scheduler, *self._connects.get(), outputs)
        for key, error in self.connector.overdue():
            self._connect_ended(scheduler, key, error, outputs)
        for room in self.take_dropped():  # their requests are over: no output
            self._act(scheduler, room, self.pipeline.fail(room), outputs, "the client went away")
        for res in self.receiver.take_finished():
            self._finished(scheduler, res, outputs)
        while not self._released_rooms.empty():
            room = self._released_rooms.get()
            self._act(scheduler, room, self.pipeline.released(room, 0), outputs)
        while not self._reports.empty():
            room, rank = self._reports.get()
            if rank > 0:
                self._act(scheduler, room, self.pipeline.ready(room, rank), outputs)
            else:
                why = (f"decode stage {-rank} could not receive its layers' KV from the "
                       f"prefill server (its log says why)")
                self._act(scheduler, room, self.pipeline.fail(room), outputs, why)
                self._act(scheduler, room, self.pipeline.released(room, -rank), outputs)
        return [o for o in outputs if o is not None]

    def _connect_done(self, key: str, error: PeerError | None) -> None:
        """Stage 0, on a connect worker: the loop takes the outcome at its next poll."""
        self._connects.put((key, error))

    def _connect_ended(self, scheduler, key: str, error: PeerError | None,
                       outputs: list) -> None:
        """Stage 0: asks for the rooms that waited on the connect to `key`, or fails them."""
        for asked in self._take_connect_waiters(key):
            failed = error if error is not None else self._ask(key, None, asked)
            if failed is not None:
                self._fail_unasked(scheduler, asked.room, failed, outputs)

    def _fail_unasked(self, scheduler, room: int, error: PeerError, outputs: list) -> None:
        """Stage 0: a room this stage never asked for: its receiver has nothing to let go."""
        self._act(scheduler, room, self.pipeline.fail(room), outputs, str(error), error.status)
        self._act(scheduler, room, self.pipeline.released(room, 0), outputs)

    def _finished(self, scheduler, res, outputs: list) -> None:
        if not res.ok:
            a = self.rooms.get(res.room)
            prefill = "the prefill server" + \
                (f" at bootstrap {a.pd.host}:{a.pd.port}" if a is not None else "")
            if 400 <= res.status < 500:  # the prefill refused the request: the client's fault
                why = f"{prefill} refused this request: {res.reason[:MAX_REASON]}"
            else:
                why = f"the KV transfer from {prefill} failed: {res.reason[:MAX_REASON]}"
            self._act(scheduler, res.room, self.pipeline.fail(res.room), outputs, why,
                      res.status)
            return
        why = self._final_problem(self.rooms.get(res.room), res.final)
        if why is not None:
            # The pages are ours again (a success hands them over): nothing writes them.
            self._act(scheduler, res.room, self.pipeline.fail(res.room), outputs, why,
                      BAD_ANSWER)
            self._act(scheduler, res.room, self.pipeline.released(res.room, 0), outputs)
            return
        self._own[res.room] = res
        self._act(scheduler, res.room, self.pipeline.ready(res.room, 0), outputs)

    def _final_problem(self, a, final) -> str | None:
        """Why the room a's request cannot continue from the prefill's final metadata, or
        None."""
        if a is None or final is None:
            return "the prefill's final metadata does not match this request"
        try:
            check_final_meta(final, vocab_size=self.cfg.vocab_size,
                             num_prompt_tokens=len(a.request.prompt_ids),
                             logprobs=a.request.params.logprobs)
        except ValueError as e:
            return (f"the prefill server at bootstrap {a.pd.host}:{a.pd.port} sent a first "
                    f"token this request cannot continue from: {e}")
        return None

    def _act(self, scheduler, room: int, actions: set[str], outputs: list,
             why: str = "", status: int = 500) -> None:
        if "fail" in actions:
            self._own.pop(room, None)
            unasked = self._forget_connect_waiter(room)
            self._drop(room, why or "the request ended")
            out = self.kv_failed(scheduler, room, why or "the request ended")
            if out is not None and _passed_on(status):
                out.error_status = status
            outputs.append(out)
            if unasked:  # the room waited on a connect: this stage's receiver never had it
                self._act(scheduler, room, self.pipeline.released(room, 0), outputs)
        if "release" in actions:
            self.kv_released(scheduler, room)
        if "ready" in actions:
            res, a = self._own.pop(room), self.rooms.get(room)
            if a is None:
                return
            log.debug(TIMELINE, room, "decode-ready", time.time())
            self.executor.pages_written(a.request.pages, a.request.window_pages)
            self._send_down(["ready", list(a.request.pages), list(a.request.window_pages)])
            f = res.final
            seed = int.from_bytes(f.sampling_state, "little") if f.sampling_state else None
            outputs.append(self.kv_arrived(scheduler, room, f.first_token, f.logprob,
                                           f.top_logprobs, seed))

    def _drop(self, room: int, reason: str) -> None:
        """Every stage stops waiting for the room (a room already over is left alone)."""
        self.receiver.drop_room(room, reason)
        self._send_down(["drop", room, reason])

    def _send_down(self, op: list) -> None:
        if self.args.pp_size > 1:
            self._down.append(op)

    # ---- every stage: asking the prefill ------------------------------------------------------

    def _ask(self, key: str, endpoint: m.Endpoint | None, asked: _Asked) -> PeerError | None:
        """Asks the prefill at `key` for the room's KV now if this stage is connected to it;
        else the room waits for a connect (started here when endpoint is given). The error
        when the prefill cannot be asked."""
        if not self.receiver.connected(key):
            if endpoint is None:
                return PeerError(BAD_ANSWER, f"lost the connection to the prefill server at "
                                             f"bootstrap {key} while connecting to it")
            with self._lock:
                self._awaiting_connect.setdefault(key, []).append(asked)
            self.connector.start(key, endpoint)
            return None
        try:
            # Only stage 0 overlaps prefill stage 0, the one that sends the final metadata.
            self.receiver.expect_room(asked.room, key, asked.pages,
                                      num_prompt_tokens=asked.num_prompt_tokens,
                                      want_final=self.rank == 0,
                                      dst_window=asked.window_pages)
        except Exception as e:  # noqa: BLE001 - the request fails, not the stage
            log.warning("room %d: %s", asked.room, e)
            return PeerError(BAD_ANSWER, f"cannot take KV from the prefill server at "
                                         f"bootstrap {key}: {e}")
        return None

    def _take_connect_waiters(self, key: str) -> list[_Asked]:
        with self._lock:
            return self._awaiting_connect.pop(key, [])

    def _forget_connect_waiter(self, room: int) -> bool:
        """Takes the room out of the rooms waiting on a connect; whether it was there."""
        with self._lock:
            for key, rooms in self._awaiting_connect.items():
                for asked in rooms:
                    if asked.room == room:
                        rooms.remove(asked)
                        return True
        return False

    def connect(self, key: str, endpoint: m.Endpoint, deadline: Deadline,
                retry_unreachable: bool = False) -> None:
        """Looks the prefill up, checks its answer and the pairing, and connects this stage's
        receiver to the prefill stages it overlaps, all before the deadline."""
        info = lookup(endpoint, deadline, self.secret, retry_unreachable)
        stages = check_prefill_info(info, self.cfg.num_layers)
        info = m.PrefillInfo(stages)
        check_compatible(info, page_size=self.kv.page_size, kv_dtype=dtype_name(self.kv.dtype),
                         model_fingerprint=m.model_fingerprint(self.cfg),
                         backend=self.disagg.transfer_backend,
                         num_layers=self.cfg.num_layers, kv_layout=self.kv.layout,
                         kv_latent=m.latent_layout(self.cfg), kv_heads=self.kv.head_map,
                         window_layers=self._model_window_layers())
        self.receiver.connect(key, info, timeout_s=deadline.remaining(),
                              decode_layer_ranges=self.layer_ranges)

    def _model_window_layers(self) -> list[int]:
        """The model's layers whose KV lives in window pages here (every stage alike)."""
        if self.kv.window is None:
            return []
        return [i for i in range(self.cfg.num_layers) if self.cfg.window_of(i) is not None]

    # ---- later stages ------------------------------------------------------------------------

    def on_control(self, ops) -> None:
        """A later stage, on its loop thread (in pipe order, after the message's page ops)."""
        for op in ops:
            if op[0] == "expect":
                _, room, rid, pages, host, port, num_prompt_tokens, window = op
                self.executor.own_pages(rid, pages, window)
                asked = _Asked(room, pages, num_prompt_tokens, window)
                error = self._ask(f"{host}:{port}", m.Endpoint(host, port), asked)
                if error is not None:
                    self._unasked_later(asked.room, error)
            elif op[0] == "ready":
                self.executor.pages_written(op[1], op[2])
            elif op[0] == "drop":
                with self._lock:  # not while a connect worker asks for the room
                    if self._forget_connect_waiter(op[1]):
                        self._to_first((op[1], -self.rank))  # nothing was asked
                    else:
                        self.receiver.drop_room(op[1], op[2])

    def _connected_later(self, key: str, error: PeerError | None) -> None:
        """A later stage, on a connect worker: asks for the rooms that waited, or reports
        them failed."""
        with self._lock:  # a "drop" for one of the rooms waits until it was asked for
            for asked in self._take_connect_waiters(key):
                failed = error if error is not None else self._ask(key, None, asked)
                if failed is not None:
                    self._unasked_later(asked.room, failed)

    def _unasked_later(self, room: int, error: PeerError) -> None:
        log.warning("decode stage %d, room %d: %s", self.rank, room, error)
        self._to_first((room, -self.rank))  # nothing was asked: nothing writes

    def _watch(self) -> None:
        """A later stage's reports to stage 0: a room whose layers all arrived, and a failed
        room once its receiver let the pages go (its failure alone is only logged)."""
        while True:
            for res in self.receiver.wait_finished(
                    0.5, wake=lambda: not self._released_rooms.empty()):
                if res.ok:
                    self._to_first((res.room, self.rank))
                else:
                    log.info("decode stage %d, room %d failed: %s", self.rank, res.room,
                             res.reason)
            while not self._released_rooms.empty():
                self._to_first((self._released_rooms.get(), -self.rank))
