"""The contracts on one page: what a request asks for, what a micro-batch carries between stages,
and what comes back. Everything here is plain data (picklable, no tensors, no torch)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS tokens
    return_prompt_logprobs: bool = False
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and the top k

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        # NaN passes every comparison and would reach the sampler; Infinity is no temperature.
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")


@dataclass(frozen=True)
class PDInfo:
    """PD disaggregation: the router's room for this attempt and the prefill's bootstrap."""
    room: int
    host: str
    port: int


ROOM_IN_USE = "is already in use on this server"


def room_in_use(room: int) -> str:
    """The sentence for a request whose bootstrap_room is live on this server already."""
    return (f"bootstrap_room {room} {ROOM_IN_USE} (another request holds it): every request "
            "needs a room id of its own")


def is_room_in_use(message: str) -> bool:
    """Whether a refusal's sentence is room_in_use's: that refusal must not reach the room's
    decodes, which serve the request that holds the room."""
    return ROOM_IN_USE in message


@dataclass(frozen=True)
class NewRequest:
    """Engine/server -> stage 0."""
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    pd: PDInfo | None = None  # set on a prefill or decode server behind the PD router
    priority: int = 0  # the request's `priority` (--schedule-policy priority: larger first)


@dataclass(frozen=True)
class SampleSpec:
    """How the last stage picks the next token of one sequence."""
    temperature: float
    top_p: float
    top_k: int
    seed: int
    step: int  # tokens generated so far: with `seed` it fixes the random draw
    logprobs: int | None  # None: no logprob; k: the sampled token's and the top k


@dataclass
class SeqWork:
    """One request's share of a micro-batch: compute tokens [start, end)."""
    rid: str
    start: int  # = tokens already in the KV cache (L)
    end: int
    input_ids: list[int]  # tokens [start, end)
    page_table: list[int]  # pages covering [0, end)
    sample: SampleSpec | None = None  # set when this micro-batch yields the next token
    # Prompt logprobs: ids of the tokens at positions start+1 .. (the prompt part of this chunk).
    logprob_targets: list[int] | None = None
    new_pages: list[int] = field(default_factory=list)  # pages allocated to rid in this step
    # PD prefill: the room this request's KV goes to, and the first token not sent yet (a
    # page boundary; 0 on the first chunk, so pages served by the prefix cache go too).
    room: int | None = None
    kv_send_from: int = 0
    # A model whose sliding-window layers keep pages of their own (ARCHITECTURE.md, 'Window
    # pages'): those layers' page of each page of page_table, -1 where it was freed, and the
    # window pages allocated to rid in this step.
    window_table: list[int] | None = None
    new_window_pages: list[int] = field(default_factory=list)

    def write_pages(self, page_size: int) -> list[int]:
        """Pages this micro-batch writes (tokens [start, end)); the earlier ones are read."""
        if self.end <= self.start:
            return []
        return self.page_table[self.start // page_size:(self.end - 1) // page_size + 1]

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class CopyKind(enum.Enum):
    """Which copy between cache tiers a CacheOp is; the wire carries the value, and a value
    that is not one of these fails to decode."""
    STORE = "store"  # pool page -> host slot (L1 -> L2), before the plan's frees
    LOAD = "load"  # host slot -> pool page, after the frees
    SAVE = "save"  # pool page -> storage (L3) after the forward (write_through)
    SAVE_EVICTED = "save_evicted"  # pool page -> storage before the frees (write_back)
    # a tree page's window part -> storage before the frees (write_through: the tree takes a
    # window page after the page itself, when a request lets go of it; 'Window pages')
    SAVE_WINDOW = "save_window"
    # storage -> pool page, after the frees (a page any stage fails to fetch is reported back
    # and never used)
    FETCH = "fetch"


@dataclass(frozen=True)
class CacheOp:
    """A copy between tiers that every stage performs on its own layers, in plan order."""
    kind: CopyKind
    page: int
    slot: int  # host slot (STORE, LOAD); -1 for storage copies
    key: str = ""  # storage copies: the page's chained key (hex), without the stage's suffix
    # Copies of a model whose window layers keep pages of their own: the window page the
    # slot's or stored page's window part comes from (STORE, SAVE_*) or goes to (LOAD, FETCH);
    # -1: none. SAVE_WINDOW saves only that part (its `page` is the pool page, unread).
    window_page: int = -1


@dataclass
class PageOps:
    """Page bookkeeping stage 0 did since the previous plan, replayed by every stage so that
    each can check ownership on its own (pipefill.kv.pool.PageOwners)."""
    freed: list[int] = field(default_factory=list)  # back on the free list (before allocs)
    cached: list[int] = field(default_factory=list)  # now the prefix cache's (after the forward)
    cache_ops: list[CacheOp] = field(default_factory=list)  # copies between tiers
    # The window layers' pool (ARCHITECTURE.md, 'Window pages'): pages the prefix cache took
    # (applied first: their requests are done with them), then pages back on its free list.
    window_cached: list[int] = field(default_factory=list)
    window_freed: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    """A micro-batch: stage 0 decides it, every stage executes it as is."""
    step_id: int
    seqs: list[SeqWork]
    page_ops: PageOps = field(default_factory=PageOps)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def yields_tokens(self) -> bool:
        return any(s.sample is not None or s.logprob_targets for s in self.seqs)


@dataclass
class PipeMessage:
    """Stage s -> s+1, sent with the micro-batch's activations (none for a control message)."""
    plan: StepPlan | None
    stage_seconds: list[float] = field(default_factory=list)  # forward time of stages passed
    # ("stop",), ("trace",), ("stats",): every stage handles it in order; ("pd", ops): PD
    # decode room operations from stage 0; ("kv_done", [(room, rank), ...]): a later stage's
    # KV transfer reports on their way to stage 0 (the last stage sends them back as a
    # StepResult of REPORT_STEP)
    control: tuple | None = None
    page_ops: PageOps | None = None  # with a control message: page frees since the last plan
    # Pool pages whose storage fetch failed on a stage passed (unreadable or damaged since
    # stage 0 verified them): stage 0 recomputes those tokens instead of using the pages.
    failed_fetches: list[int] = field(default_factory=list)


@dataclass
class SeqResult:
    rid: str
    token: int | None = None
    token_logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list[float] | None = None
    error: str | None = None  # sampling/logprobs failed for this sequence: fail it, not the stage


REPORT_STEP = -1  # the step_id of a StepResult that answers no plan: it carries kv_done only


@dataclass
class StepResult:
    """Last stage -> stage 0 for one micro-batch (or, with REPORT_STEP, for none)."""
    step_id: int
    seqs: list[SeqResult] = field(default_factory=list)
    stage_seconds: list[float] = field(default_factory=list)  # forward time per stage
    failed_fetches: list[int] = field(default_factory=list)  # on any stage (PipeMessage's)
    # PD: (room, rank) reports of later stages' KV transfers for stage 0's role: a prefill
    # stage's sender let the room's pages go; a decode stage has all its layers (rank) or its
    # receiver let a failed room's pages go (-rank)
    kv_done: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """Stage 0 -> engine/server: what a request gained in one step."""
    rid: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS), "length", "abort", "error"
    error: str | None = None
    # With "error": the HTTP status to answer when it is not a fault (PD decode: 4xx when the
    # prefill refused the request); None: a fault (500).
    error_status: int | None = None
    prompt_logprobs: list[float] | None = None
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token, when asked
    chunk_sizes: list[int] | None = None  # with the first token
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (with the first token)
    num_prompt_tokens: int = 0
