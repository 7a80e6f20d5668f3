"""The scheduler: requests and page-pool state in, a StepPlan out; results back through update().

Pure Python: no torch.distributed, no device code. Stage 0 owns the only instance.

A request is a list of tokens (prompt, then outputs); a micro-batch computes a span
[start, end) of it. Prefill chunks of one request go into consecutive micro-batches without
waiting for each other; a span that ends at the last known token yields the next token, and the
request then waits for that token before it can be scheduled again.

With the prefix cache, admission matches the request's tokens against the radix tree: the
matched whole pages are reused (the request starts at L = cached tokens) and only the rest is
chunked. Admission promises the uncached pages plus a small decode headroom, not the worst
case; when decode runs out of pages, the most recently admitted request is preempted: its
pages stay in the tree as a cached prefix and it resumes from there, with the same output
(greedy is deterministic; sampling draws per (seed, step)).

Under PD disaggregation the scheduler asks its role (pipefill.scheduler.role) where a new request
waits, whether an admitted one may be scheduled, and whether its pages may go back; a request
whose prompt KV comes from another server enters through admit_for_kv and continue_after_prompt.
"""
from __future__ import annotations

import itertools
import zlib
from collections import deque
from dataclasses import dataclass, field

from pipefill.chunking.policy import ChunkPolicy
from pipefill.kv.pool import PagePool
from pipefill.kv.manager import KVManager
from pipefill.base.plan import (NewRequest, RequestOutput, SampleSpec, SamplingParams, SeqWork,
                                StepPlan, StepResult)
from pipefill.kv.radix import Node, RadixCache
from pipefill.kv.window import WindowPages
from pipefill.scheduler.prefill_order import PrefillOrder
from pipefill.scheduler.role import NullRole

# Pages an admission keeps free beyond the uncached prompt, for the first decode tokens.
DECODE_HEADROOM_PAGES = 1


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_prefill_tokens: int
    max_running_requests: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0
    vocab_size: int | None = None  # checked again here: a bad id must not reach the embedding


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    num_scheduled: int = 0  # tokens whose KV is written or being written by a micro-batch
    pages: list[int] = field(default_factory=list)
    pages_reserved: int = 0  # pages promised at admission, not yet allocated
    # A windowed model's window table: the window layers' page of each of `pages`, -1 where
    # it was freed (kv/window.py).
    window_pages: list[int] = field(default_factory=list)
    lock_node: Node | None = None  # deepest prefix-cache node this request holds
    num_inserted: int = 0  # whole pages of this request already in the prefix cache
    cached_tokens: int = 0  # prompt tokens reused from the cache at first admission
    admitted_at: int = 0  # admission order: preemption takes the newest
    priority: int = 0  # --schedule-policy priority: larger goes first
    # Its prefix on its way from the storage tier (kv.manager.StorageFetch): admitted after.
    storage_fetch: object = None
    storage_tried: bool = False  # the last admission attempt fetched: the next one does not
    preempt_pending: bool = False  # preempt once its micro-batches in flight are back
    num_inflight: int = 0  # micro-batches that contain this request
    awaiting_token: bool = False
    done: bool = False  # finished or aborted: schedule nothing more, free pages when idle
    chunk_sizes: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens_upto(self, n: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[:n]

    @property
    def in_prefill(self) -> bool:
        """Computing known tokens: the prompt, or a preempted request's outputs on resume."""
        return self.num_scheduled < max(len(self.prompt_ids), self.num_tokens - 1)

    @property
    def ready(self) -> bool:
        return not self.done and not self.awaiting_token and not self.preempt_pending and \
            self.num_scheduled < self.num_tokens


def check_prompt(ids: list[int], params: SamplingParams, vocab_size: int | None,
                 max_model_len: int, kv_capacity_tokens: int) -> None:
    """Raises ValueError with a sentence for a request the engine can never run."""
    params.validate()
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size] if vocab_size is not None else []
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    total = len(ids) + params.max_new_tokens
    if total > max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens "
                         f"({params.max_new_tokens}) = {total} exceeds --max-model-len "
                         f"({max_model_len})")
    if total > kv_capacity_tokens:
        raise ValueError(f"prompt + max_new_tokens ({total}) exceeds the KV cache "
                         f"({kv_capacity_tokens} tokens); raise --max-total-tokens")


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: PagePool, chunk_policy: ChunkPolicy,
                 cache: RadixCache | None = None, role=None,
                 order: PrefillOrder | None = None, window: WindowPages | None = None):
        self.cfg = cfg
        self.pool = pool
        # window: the sliding-window layers' own pages (ARCHITECTURE.md, 'Window pages').
        self.kv = KVManager(pool, cfg.page_size, cache, window)
        # The chunking room's policy: next_chunk(L) is the size of the chunk after L tokens.
        self.chunk_policy = chunk_policy
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self._step_ids = itertools.count()
        self._admissions = itertools.count()
        # PD disaggregation (pipefill.scheduler.role): where a request waits, whether it may
        # be scheduled, and whether its pages may go back are the role's to say.
        self.role = role or NullRole()
        # --schedule-policy: which prompts in prefill take the next chunks (prefill_order.py).
        self.order = order or PrefillOrder()

    # ---- requests in -------------------------------------------------------------------------

    def check_request(self, req: NewRequest) -> None:
        """Raises ValueError with a sentence for a request this engine can never run."""
        check_prompt(req.prompt_ids, req.params, self.cfg.vocab_size, self.cfg.max_model_len,
                     self.pool.num_pages * self.cfg.page_size)

    def add(self, req: NewRequest) -> None:
        self.check_request(req)
        seed = req.params.seed
        if seed is None:  # stable across processes, unlike hash()
            seed = zlib.crc32(f"{self.cfg.seed}:{req.rid}".encode())
        r = Request(req.rid, list(req.prompt_ids), req.params, seed & 0x7FFFFFFF,
                    priority=req.priority)
        if self.role.add(r, req.pd):  # False: the role keeps it (its KV comes from elsewhere)
            self.waiting.append(r)

    def abort(self, rid: str) -> RequestOutput | None:
        if self.role.refuses_abort(rid):
            return None  # PD prefill: its decode waits for this KV, the prefill runs to its end
        r = next((r for r in self.waiting if r.rid == rid), None)
        if r is not None:
            self.waiting.remove(r)
            self.kv.cancel_fetch(r)
        if r is not None or self.role.take_waiting(rid) is not None:
            return RequestOutput(rid, [], True, "abort")
        r = self.running.get(rid)
        if r is None:
            return None
        self.role.aborted(r)
        r.done = True
        self._maybe_release(r)
        return RequestOutput(rid, [], True, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(self._ready(r) for r in self.running.values())

    def _ready(self, r: Request) -> bool:
        return r.ready and not self.role.waits_for_kv(r)

    @property
    def num_inflight_requests(self) -> int:
        return sum(1 for r in self.running.values() if r.num_inflight)

    def long_prefills(self) -> list[tuple[str, int, int]]:
        """(rid, prompt tokens computed or on their way, prompt tokens) of every admitted
        prompt in prefill that is longer than one chunk: what progress is reported of."""
        c0 = self.chunk_policy.next_chunk(0)
        return [(r.rid, min(r.num_scheduled, len(r.prompt_ids)), len(r.prompt_ids))
                for r in self.running.values()
                if r.in_prefill and not r.done and len(r.prompt_ids) > c0]

    # ---- planning ----------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Decode tokens first (running requests keep streaming behind long prefills), then
        one chunk of a prompt longer than a chunk, the first in the schedule policy's order
        (fcfs: the one in progress, so prompts finish one after the other instead of all
        late), then waiting prompts: whole short ones that fit always, which may pass long
        ones waiting, and a long one when no long chunk is in the step yet and the policy
        lets it start beside those in prefill.

        One long chunk per step, however large the budget: a step's time is what a prompt
        arriving during it waits, and what each prompt taking turns waits per turn; two long
        chunks in one step would double both and make every long prompt finish late
        (ARCHITECTURE.md, 'The chunking room', the schedule policy)."""
        first_chunk = self.chunk_policy.next_chunk(0)
        budget = max(self.cfg.max_prefill_tokens, first_chunk)  # a first chunk always fits
        seqs: list[SeqWork] = []
        for r in list(self.running.values()):
            if self._ready(r) and not r.in_prefill and budget > 0 and self._make_room(r):
                seqs.append(self._work(r, r.num_scheduled + 1))
                budget -= 1
        num_decodes = len(seqs)
        partial = [r for r in self.running.values()
                   if r.in_prefill and not r.done and not self.role.waits_for_kv(r)]
        pages_short = False  # a waiting prompt did not fit: later ones wait too (arrival order)
        long_chunk_taken = False  # one chunk of a prompt longer than a chunk per step
        for r in self.order.prefill_order(partial, list(self.waiting)):
            if budget <= 0:
                break
            # A chunk beside another prompt's waits for a step with room for all of it: cut
            # short to fit, it would change that prompt's sequence of chunk sizes.
            shared = len(seqs) > num_decodes
            if r.rid in self.running:
                if not long_chunk_taken and self._ready(r) and \
                        not (shared and self._chunk_tokens(r) > budget):
                    seqs.append(self._prefill_chunk(r, budget))
                    budget -= seqs[-1].num_tokens
                    long_chunk_taken = True
                continue
            if pages_short:
                continue
            uncached = r.num_tokens - self.kv.cached_prefix_tokens(self._match_tokens(r))
            whole = uncached <= min(budget, first_chunk)
            if not whole and (long_chunk_taken or not self.order.may_start_long(r, partial)):
                continue  # a long prompt waits for its turn; short ones go past it
            if not whole and shared and budget < first_chunk:
                continue
            if not self._admit(r):
                pages_short = True
                continue
            self.waiting.remove(r)
            self.running[r.rid] = r
            seqs.append(self._prefill_chunk(r, budget))
            budget -= seqs[-1].num_tokens
            if r.in_prefill:
                partial.append(r)
                long_chunk_taken = True
        if not seqs and not self.kv.has_new_fetches:
            return None
        # A plan without sequences still goes when it carries storage fetches: their result
        # says which pages every stage read.
        plan = StepPlan(next(self._step_ids), seqs, self.kv.drain_ops())
        self.kv.plan_sent(plan.step_id)
        return plan

    def _chunk_tokens(self, r: Request) -> int:
        """The size of r's next chunk. The first chunk from scratch is C0; after a cached
        prefix of L tokens (or earlier chunks) it is the size predicted for L (ARCHITECTURE.md,
        'The chunking room')."""
        size = self.chunk_policy.next_chunk(r.num_scheduled)
        return min(size, r.num_tokens - r.num_scheduled)

    def _prefill_chunk(self, r: Request, budget: int) -> SeqWork:
        end = r.num_scheduled + min(self._chunk_tokens(r), budget)
        self.order.served(r, end - r.num_scheduled)
        return self._work(r, end)

    def _work(self, r: Request, end: int) -> SeqWork:
        start = r.num_scheduled
        new_pages = self.kv.grow(r, end)
        slide = self.kv.slide(r, start, end)
        self.kv.insert(r, r.tokens_upto, end)
        sample = None
        if end == r.num_tokens and r.params.max_new_tokens > 0:
            p = r.params
            sample = SampleSpec(p.temperature, p.top_p, p.top_k, r.seed, len(r.output_ids),
                                p.logprobs)
            r.awaiting_token = True
        targets = None
        if r.params.return_prompt_logprobs and start < len(r.prompt_ids):
            targets = r.prompt_ids[start + 1:min(end + 1, len(r.prompt_ids))]
        if start < len(r.prompt_ids):
            r.chunk_sizes.append(end - start)
        r.num_scheduled = end
        r.num_inflight += 1
        work = SeqWork(r.rid, start, end, [r.token_at(i) for i in range(start, end)],
                       list(r.pages), sample, targets, new_pages)
        if slide is not None:  # the window table as the chunk's pieces read it
            work.window_table, work.new_window_pages = slide.table, slide.new
        self.role.on_chunk(r, work, self.cfg.page_size)
        return work

    # ---- pages -------------------------------------------------------------------------------

    def _match_tokens(self, r: Request) -> list[int]:
        """The tokens whose cached KV r may reuse: all but the last known one (at least one
        token is computed, to get logits; the partial last page is never shared anyway), and
        none whose prompt logprob r still needs (those come from computed logits only)."""
        limit = r.num_tokens - 1
        if r.params.return_prompt_logprobs:
            limit = min(limit, len(r.prompt_logprobs))
        return r.tokens_upto(limit)

    def _admit(self, r: Request) -> bool:
        """Admits when the uncached pages plus a small decode headroom fit (cache leaves that
        nobody uses count as free: they are evicted when the pages are needed)."""
        if len(self.running) >= self.cfg.max_running_requests:
            return False
        if not self.kv.admit(r, self._match_tokens(r), self._headroom(r)):
            return False
        if r.params.return_prompt_logprobs:  # a resumed request recomputes past its cache
            del r.prompt_logprobs[r.num_scheduled:]
        if not r.output_ids and not r.chunk_sizes:
            r.cached_tokens = r.num_scheduled
            self.kv.counters.hit_tokens += r.num_scheduled
        r.admitted_at = next(self._admissions)
        return True

    def _headroom(self, r: Request) -> int:
        """Decode pages an admission keeps free for r: only where decoding can still need a
        page (a resumed request near its end must not wait for one it will never use)."""
        final = self.kv.pages_for(len(r.prompt_ids) + r.params.max_new_tokens)
        return min(DECODE_HEADROOM_PAGES, final - self.kv.pages_for(r.num_tokens))

    def _make_room(self, r: Request) -> bool:
        """Makes sure r's next decode token has a page: preempts the most recently admitted
        requests while it does not fit. False when r must wait (or was preempted itself)."""
        while not self.kv.can_grow(r, r.num_scheduled + 1):
            if any(v.preempt_pending for v in self.running.values()):
                return False  # pages are on their way back: preempt no one else meanwhile
            victims = [v for v in self.running.values() if not v.done and not v.preempt_pending]
            victim = max(victims, key=lambda v: v.admitted_at)
            self._preempt(victim)
            if victim is r or victim.preempt_pending:
                return False  # r is back in the queue, or the victim's pages free up later
        return True

    def _preempt(self, r: Request) -> None:
        """Sends r back to the front of the queue; its scheduled whole pages stay cached."""
        if r.num_inflight:
            r.preempt_pending = True  # stages still write its pages; finish this in update()
            return
        self.kv.release(r)
        r.num_scheduled, r.awaiting_token, r.preempt_pending = 0, False, False
        del self.running[r.rid]
        self.waiting.appendleft(r)
        self.kv.counters.preemptions += 1

    def _maybe_release(self, r: Request) -> None:
        if r.num_inflight or self.role.holds_pages(r):
            return  # stages may still write these pages, or a KV transfer read/write them
        self.kv.release(r)
        self.running.pop(r.rid, None)
        self.role.forget(r)
        self.order.forget(r.rid)

    # ---- requests whose prompt is computed elsewhere (the role calls these) ------------------

    def release_if_done(self, r: Request) -> None:
        """Frees a finished request's pages once nothing reads or writes them any more."""
        if r.done:
            self._maybe_release(r)

    def admit_for_kv(self, r: Request) -> bool:
        """Admits r into pages for its whole prompt (plus a decode headroom) that a KV transfer
        fills instead of a forward (PD decode); False while they do not fit."""
        if len(self.running) >= self.cfg.max_running_requests:
            return False
        if not self.kv.admit(r, [], self._headroom(r)):
            return False
        self.kv.grow(r, len(r.prompt_ids))
        self.kv.admit_received(r)
        r.admitted_at = next(self._admissions)
        self.running[r.rid] = r
        return True

    def continue_after_prompt(self, r: Request, token: int, logprob: float | None, top,
                              seed: int | None) -> RequestOutput | None:
        """r's prompt KV and first token came from elsewhere: from now on r decodes exactly
        as if it had computed its prompt. None when r was aborted meanwhile."""
        if r.done:
            self._maybe_release(r)
            return None
        if seed is not None:
            r.seed = seed  # the prefill's draws and ours continue one sequence
        r.num_scheduled = len(r.prompt_ids)
        r.output_ids.append(token)
        reason = self._finish_reason(r, token)
        out = RequestOutput(r.rid, [token], reason is not None, reason,
                            token_logprobs=[logprob] if logprob is not None else None,
                            top_logprobs=[[tuple(t) for t in top]] if top is not None else None,
                            chunk_sizes=[], num_prompt_tokens=len(r.prompt_ids))
        if reason is not None:
            r.done = True
            self._maybe_release(r)
        return out

    def fail(self, r: Request, reason: str) -> RequestOutput:
        """Ends r with an error; its pages go back once nothing reads or writes them."""
        r.done = True
        self._maybe_release(r)
        return RequestOutput(r.rid, [], True, "error", error=reason,
                             num_prompt_tokens=len(r.prompt_ids))

    # ---- results in --------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult | None) -> list[RequestOutput]:
        self.kv.finish_fetches(plan.step_id, result.failed_fetches if result else [])
        by_rid = {s.rid: s for s in result.seqs} if result else {}
        outputs = []
        for work in plan.seqs:
            r = self.running[work.rid]
            r.num_inflight -= 1
            out = self._apply(r, work, by_rid.get(work.rid))
            if out is not None:
                outputs.append(out)
            if out is not None and out.finished:
                r.done = True
            if r.done:
                self._maybe_release(r)
            elif r.preempt_pending and not r.num_inflight:
                self._preempt(r)
        return outputs

    def _apply(self, r: Request, work: SeqWork, res) -> RequestOutput | None:
        if r.done:
            return None
        if res is not None and res.error is not None:
            # The last stage could not sample or score this sequence: the request ends here
            # (update() frees its pages once nothing of it is in flight); the others go on.
            r.awaiting_token = False
            return RequestOutput(r.rid, [], True, "error", error=res.error,
                                 num_prompt_tokens=len(r.prompt_ids))
        if res is not None and res.prompt_logprobs:
            r.prompt_logprobs += res.prompt_logprobs
        if work.sample is None:
            if work.end == len(r.prompt_ids) and r.params.max_new_tokens == 0:
                return RequestOutput(r.rid, [], True, "length",
                                     prompt_logprobs=self._prompt_logprobs(r),
                                     chunk_sizes=list(r.chunk_sizes),
                                     num_prompt_tokens=len(r.prompt_ids),
                                     cached_tokens=r.cached_tokens)
            return None
        assert res is not None and res.token is not None, f"no token for {r.rid}"
        r.awaiting_token = False
        first = not r.output_ids
        r.output_ids.append(res.token)
        reason = self._finish_reason(r, res.token)
        return RequestOutput(
            r.rid, [res.token], reason is not None, reason,
            prompt_logprobs=self._prompt_logprobs(r) if first else None,
            token_logprobs=[res.token_logprob] if res.token_logprob is not None else None,
            top_logprobs=[res.top_logprobs] if res.top_logprobs is not None else None,
            chunk_sizes=list(r.chunk_sizes) if first else None,
            num_prompt_tokens=len(r.prompt_ids), cached_tokens=r.cached_tokens)

    @staticmethod
    def _prompt_logprobs(r: Request) -> list[float] | None:
        return list(r.prompt_logprobs) if r.params.return_prompt_logprobs else None

    def _finish_reason(self, r: Request, token: int) -> str | None:
        stops = r.params.stop_token_ids
        if not r.params.ignore_eos and (token in self.cfg.eos_token_ids or token in stops):
            return "stop"
        if len(r.output_ids) >= r.params.max_new_tokens or r.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None

