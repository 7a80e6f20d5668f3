"""What every front end (the Python Engine, the HTTP server) shares: prepare() resolves the
arguments against the model and rejects impossible settings with a sentence before the stages
start; FrontEnd then starts the stages, checks each prompt once, sends the requests and routes
the stages' reports back to each request. On a PD role it also runs the role's services: a
prefill's bootstrap service and the notifier that tells decodes about refused rooms."""
from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable

import torch

from pipefill.config import DisaggMode, Disaggregation, ServerArgs, resolve
from pipefill.disagg.bootstrap import BootstrapServer
from pipefill.disagg.http_fields import check_room
from pipefill.disagg.rejects import RejectNotifier
from pipefill.kernels.prefill_gemm import choose_prefill_gemm
from pipefill.model.attention import choose_backend, resolve_kv_dtype
from pipefill.model.loader import (WeightSource, keeps_blocks, resolve_model_path,
                                   resolve_weight_dtype)
from pipefill.model.tensor_parallel import check_tensor_parallel, has_unequal_groups
from pipefill.model.tokenizer import read_chat_template
from pipefill.base.plan import NewRequest, PDInfo, RequestOutput, SamplingParams, is_room_in_use
from pipefill.base.platform import cpu_vendor, resolve_dtype, usable_cpu_flags
from pipefill.runtime.launch import StageGroup
from pipefill.runtime.trace import write_trace
from pipefill.scheduler.scheduler import check_prompt

log = logging.getLogger(__name__)

CUDA_NEVER_RUN = ("--device cuda: one stage on one GPU has run once (an H200: float32 results "
                  "within 3e-6 of HF transformers), but NCCL between stages (one GPU per stage) "
                  "and between the TP ranks of a stage (--tp-size, one GPU per rank) has never "
                  "run on a GPU; expect failures there, and use --device cpu for a tested "
                  "server")
PROMPT_LOGPROBS_UNDER_PD = ("prompt logprobs (echo with logprobs, return_prompt_logprobs) are "
                            "not served by a PD pair: the decode server never sees the prompt's "
                            "logits")


def prepare(args: ServerArgs) -> tuple[ServerArgs, WeightSource]:
    """Resolves model-dependent defaults and rejects impossible settings up front."""
    if args.device == "cuda":
        log.warning(CUDA_NEVER_RUN)
    if args.disagg.enabled and args.nnodes > 1:
        raise ValueError(f"--disaggregation-mode {args.disagg.mode.value} runs on one node "
                         "(--nnodes 1) for now")
    source = WeightSource(resolve_model_path(args.model_path))
    keeps_blocks(args.weight_dtype, source, args.device)  # gguf needs a GGUF file, fp8 an FP8 one
    check_tp_settings(args, source)
    args.layout.check_gpus(torch.cuda.device_count())  # this node's; each node checks its own
    if args.chat_template is not None:  # an unreadable file is refused before stages start
        read_chat_template(args.chat_template)
    # Also checks the layer partition against the model, balanced by the layers' costs.
    args = resolve(args, source.config, source.family.layer_costs(source.config))
    if args.attention_backend not in ("auto", "sdpa"):  # a named kernel must fit, or a sentence
        dtype = resolve_dtype(args.dtype)
        choose_backend(args.attention_backend, dtype, source.config.head_dim, args.page_size,
                       torch.device(args.device), resolve_kv_dtype(args.kv_cache_dtype, dtype),
                       usable_cpu_flags(args.hide_cpu_flags), source.config.has_windows,
                       latent=source.config.mla is not None,
                       unequal_groups=has_unequal_groups(source.config, args.tp_size))
    if args.prefill_gemm == "onednn":  # likewise
        dtype = resolve_dtype(args.dtype, usable_cpu_flags(args.hide_cpu_flags))
        choose_prefill_gemm("onednn", dtype, resolve_weight_dtype(args.weight_dtype, dtype),
                            torch.device(args.device), cpu_vendor())
    return args, source


def check_tp_settings(args: ServerArgs, source: WeightSource) -> None:
    """What --tp-size cannot run yet, refused with a sentence (ARCHITECTURE.md, 'Tensor
    parallelism inside a stage')."""
    if args.layout.tp_size == 1:  # the layout checks the flag itself (at least 1)
        return
    check_tensor_parallel(source.config, source.family, args.tp_size, args.tp_moe_split)
    if args.weight_dtype == "fp8":
        raise ValueError(f"--tp-size {args.tp_size} does not keep --weight-dtype fp8 blocks "
                         "yet: use --weight-dtype auto")
    if args.hicache_storage_backend:
        raise ValueError(f"--tp-size {args.tp_size} does not run with a storage tier "
                         "(--hicache-storage-backend) yet")
    if args.device == "cuda":
        check_cuda_tp(args)


def check_cuda_tp(args: ServerArgs) -> None:
    """What the CUDA path of --tp-size (NCCL between a stage's ranks) does not do, refused with
    a sentence; the rest of check_tp_settings holds on CUDA too (GGUF blocks stay on CPU
    stages: loader.keeps_blocks)."""
    if args.pp_size > 1 and args.tp_stage_transport == "per_rank":
        raise ValueError(f"--tp-stage-transport per_rank runs on --device cpu only: on CUDA "
                         f"the TP peers' own links between stages are not written; use "
                         f"--tp-stage-transport leader with --tp-size {args.tp_size}")
    if args.disagg.enabled:
        raise ValueError(f"--disaggregation-mode {args.disagg.mode.value} with --tp-size "
                         f"{args.tp_size} runs on --device cpu only: the leader maps its "
                         "peers' KV pools from files in host memory")


def start_bootstrap(host: str, disagg: Disaggregation) -> BootstrapServer:
    """A prefill's bootstrap service, up before its stages register with it."""
    try:
        return BootstrapServer(host, disagg.bootstrap_port, disagg.secret())
    except OSError as e:
        raise RuntimeError(f"the bootstrap service cannot listen on {host}:"
                           f"{disagg.bootstrap_port} ({e}): choose another "
                           "--disaggregation-bootstrap-port") from None


# A request's sink: takes each of its outputs in order, or the exception that ends it (stage 0
# rejected it, or the stages failed). Engine's sinks are plain callbacks that may raise into
# its collecting loop; the server's put into the asyncio queue its request's task reads.
Sink = Callable[[RequestOutput | Exception], None]


class FrontEnd:
    """The front end's one handle on the stages, shared by the Python Engine and the HTTP
    server's AsyncEngine: it starts the stage group, checks each prompt at the front door,
    numbers requests, sends them, and routes what the stages report to each request's sink.

    It runs no thread of its own for the stages: Engine calls recv() and route() from its
    calling thread; the server reads in its supervisor thread and routes on its event loop, so
    that the sinks are only ever touched from one thread (ARCHITECTURE.md, 'A request's path').

    A PD prefill's bootstrap service and reject notifier start here, before any stage
    registers, and stop in close(): a restarted stage group registers with the same service
    (ARCHITECTURE.md, 'Prefill/decode disaggregation')."""

    def __init__(self, args: ServerArgs, source: WeightSource):
        self.args = args
        self.source = source
        self.stages: StageGroup | None = None  # None before start and after close
        self.kv_capacity_tokens = 0
        self.chunking: dict = {}  # C0, mode, fitted cost model when profiled
        self.load: dict = {}  # stage 0's latest load report
        self._sinks: dict[str, Sink] = {}
        self._ids = itertools.count()
        self.bootstrap = start_bootstrap(args.serving.host, args.disagg) \
            if args.disagg.mode is DisaggMode.PREFILL else None
        self.rejects = RejectNotifier(self.bootstrap.endpoints, args.disagg.secret()) \
            if self.bootstrap is not None else None

    # ---- the stage group ---------------------------------------------------------------------

    def launch(self) -> StageGroup:
        """Starts the stage processes (they load in the background); wait_ready() follows.
        A group started again after a failure gets fresh addresses and ports."""
        self.stages = StageGroup(self.args, self.source.path)
        return self.stages

    def wait_ready(self, cancelled=lambda: False) -> dict:
        """Blocks until the stages serve; StageFailure if they fail or cancelled() turns true."""
        info = self.stages.wait_ready(cancelled=cancelled)
        self.kv_capacity_tokens = info["num_pages"] * self.args.page_size
        self.chunking = info["chunking"]
        return info

    def close(self, grace_s: float = 5.0) -> None:
        """Stops the stages, then the PD services (for good: launch() cannot follow)."""
        if self.stages is not None:
            self.stages.close(grace_s=grace_s)
            self.stages = None
        if self.rejects is not None:
            self.rejects.close()
            self.rejects = None
        if self.bootstrap is not None:
            self.bootstrap.close()
            self.bootstrap = None

    def recv(self, timeout_ms: int = 100) -> tuple | None:
        """The stages' next report, or None; StageFailure once a stage is dead."""
        return self.stages.recv(timeout_ms)

    def check_progress(self) -> None:
        """The stall watchdog: StageFailure for a stage that has work but makes no progress
        for --stage-stall-timeout seconds (runtime/heartbeat.py)."""
        self.stages.check_progress(requests_in_flight=bool(self._sinks))

    # ---- requests ----------------------------------------------------------------------------

    def new_rid(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """The front door: ValueError with a sentence for a request the stages can never run
        (stage 0 checks again, for its own sake, and answers "rejected")."""
        check_prompt(ids, params, self.source.config.vocab_size, self.args.max_model_len,
                     self.kv_capacity_tokens)

    # ---- PD rooms ----------------------------------------------------------------------------

    def check_room(self, pd: PDInfo | None) -> PDInfo | None:
        """A request's PD room, checked as the router's fields are (http_fields.check_room):
        a PD role needs one per request, a colocated front end takes none. ValueError with a
        sentence (a FieldError with status 403 for a decode's bootstrap outside
        --disaggregation-prefill-bootstrap)."""
        disagg = self.args.disagg
        if not disagg.enabled:
            if pd is not None:
                raise ValueError("a PD room is for a prefill or decode role: start with "
                                 "--disaggregation-mode prefill|decode")
            return None
        if pd is None:
            raise ValueError(f"this is the {disagg.mode.value} of a PD pair: every request "
                             "needs its room (PDInfo(bootstrap_room, bootstrap_host, "
                             "bootstrap_port), the same on the prefill and the decode)")
        return check_room(pd.room, pd.host, pd.port, disagg.mode.value,
                          disagg.prefill_bootstrap)

    def pd_params(self, params: SamplingParams, pd: PDInfo | None) -> SamplingParams:
        """A PD request's sampling: no prompt logprobs (ValueError); a prefill computes one
        token, which goes to the decode with the KV. Checked against the request's own
        max_new_tokens first (check_prompt), as the decode will run it."""
        if pd is not None and params.return_prompt_logprobs:
            raise ValueError(PROMPT_LOGPROBS_UNDER_PD)
        if self.args.disagg.mode is DisaggMode.PREFILL:
            return dataclasses.replace(params, max_new_tokens=1)
        return params

    def refuse_room(self, pd: PDInfo | None, status: int, sentence: str) -> None:
        """A prefill refused the request of room pd: its decodes answer the same status and
        sentence at once, instead of waiting for the KV until --disaggregation-waiting-timeout
        (and then answering 5xx, which a router retries). Nothing elsewhere, and nothing for
        a room in use: that room's decodes serve the request that holds it."""
        if self.rejects is None or pd is None or is_room_in_use(sentence):
            return
        self.rejects.tell(pd.room, status, sentence)

    def submit(self, requests: list[NewRequest], sinks: list[Sink]) -> None:
        """Sends the requests to stage 0 in one message; each one's reports go to its sink
        until it finishes or is released. StageFailure if the stages are gone."""
        for req, sink in zip(requests, sinks, strict=True):
            self._sinks[req.rid] = sink
        self.stages.send("add", requests)

    def release(self, rid: str) -> None:
        """Nothing more of this request goes to its sink (its caller went away)."""
        self._sinks.pop(rid, None)

    def abort(self, rid: str) -> None:
        """Releases the request and tells stage 0 to drop it (and free its pages); the
        message is dropped if stage 0 cannot take it at once (a stage that is gone)."""
        self.release(rid)
        if self.stages is not None:
            self.stages.send("abort", rid, block=False)

    def route(self, msg: tuple) -> None:
        """Delivers one report of the stages: outputs and rejections to their requests' sinks
        (a request that finished leaves the table), stage 0's load to self.load."""
        kind, payload = msg
        if kind == "outputs":
            for out in payload:
                sink = self._sinks.get(out.rid)
                if out.finished:
                    self._sinks.pop(out.rid, None)
                if sink is not None:
                    sink(out)
        elif kind == "rejected":
            rid, message = payload
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink(ValueError(message))
        elif kind == "load":
            self.load = payload

    def fail_all(self, error: Exception) -> None:
        """Ends every request in flight with error (their callers abort them on the way out)."""
        for sink in list(self._sinks.values()):
            sink(error)

    # ---- control messages --------------------------------------------------------------------

    def stats(self) -> dict:
        """Stage 0's page pool with its integrity check (free + used == total), and under
        "stages" every stage's own report."""
        reports = self.stages.gather("stats", "stage_stats")
        return {**reports[0], "stages": [reports[r] for r in sorted(reports)]}

    def collect_trace(self, timeout_s: float = 600.0) -> list[dict]:
        """Every stage's spans since the last call (Chrome-trace events), by rank."""
        replies = self.stages.gather("trace", "trace", timeout_s=timeout_s)
        return [e for rank in sorted(replies) for e in replies[rank]]

    def write_trace(self, name: str, events: list[dict]) -> dict:
        """<trace_dir>/<name>.json and .png from events; returns the bubble statistics."""
        return write_trace(self.args.trace_dir, name, events, self.args.pp_size)
