"""StageExecutor: runs one micro-batch's plan on this stage's layers and KV cache."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pipefill.chunking.profile import ProfileBench
from pipefill.kv.tiers import StageKV
from pipefill.kv.window import piece_pages
from pipefill.model.attention import SeqMeta
from pipefill.model.stage_model import ForwardMeta, StageModel
from pipefill.runtime.sampler import sample
from pipefill.base.plan import SeqResult, SeqWork, StepPlan, StepResult

log = logging.getLogger(__name__)


@dataclass
class Activations:
    hidden: torch.Tensor  # [num_tokens, hidden_size] compute dtype
    residual: torch.Tensor | None  # [num_tokens, hidden_size] float32; None before layer 0
    # After a last stage that computed only the logit rows (StageModel.trims): those rows, in
    # plan order, instead of every row.
    logit_rows_only: bool = False
    # Under the per-rank stage transport: these are this TP rank's rows (p2p.row_share) of a
    # micro-batch of this many rows, which the stage's ranks gather before the forward
    # (ARCHITECTURE.md, 'Tensor parallelism inside a stage'). 0: every row is here.
    share_of: int = 0


def build_meta(plan: StepPlan, page_size: int, device: torch.device,
               window: int | None = None) -> ForwardMeta:
    """window: the sliding window of layers that keep pages of their own
    (kv.cache.WindowedKVCache), which each sequence's window_table addresses (its page_table
    in a scratch plan, which owns the same ids in both pools) and which compute a chunk in
    pieces (kv.window.piece_pages); None: no such layers."""
    windowed = window is not None
    seqs, window_seqs, row = [], [], 0
    for work in plan.seqs:
        seqs.append(_seq_meta(work, work.page_table, row, page_size, device))
        if windowed:
            table = work.page_table if work.window_table is None else work.window_table
            window_seqs.append(_seq_meta(work, table, row, page_size, device))
        row += work.num_tokens
    return ForwardMeta(_positions(plan.seqs).to(device), seqs,
                       window_seqs=window_seqs if windowed else None,
                       window_piece=piece_pages(page_size, window) * page_size if windowed
                       else 0)


def _seq_meta(work: SeqWork, pages: list[int], row: int, page_size: int, device) -> SeqMeta:
    # A window table's freed entries (-1) address page 0: nothing reads them (the window
    # attention reads from the window's first key on).
    pages = [max(p, 0) for p in pages] if pages and min(pages) < 0 else pages
    table = torch.tensor(pages, dtype=torch.int32)
    read = _read_slots(pages, table, work.end, page_size, device)
    # The new tokens' slots are the tail of the slots read: a slice or a view, no new work.
    write = (slice(read.start + work.start, read.start + work.end)
             if isinstance(read, slice) else read[work.start:work.end])
    return SeqMeta(row, work.num_tokens, work.start, write, read, table)


def _positions(works) -> torch.Tensor:
    if all(w.end - w.start == 1 for w in works):  # a decode step: one tensor, not one per seq
        return torch.tensor([w.start for w in works])
    return torch.cat([torch.arange(w.start, w.end) for w in works])


def _read_slots(pages: list[int], table: torch.Tensor, end: int, page_size: int, device):
    """Cache slots of tokens [0, end): a slice when the pages are consecutive, else the page
    table expanded page by page (no per-token division)."""
    if end <= 0:
        return slice(0, 0)
    used = -(-end // page_size)
    if pages[used - 1] - pages[0] == used - 1 and all(
            b == a + 1 for a, b in zip(pages, pages[1:used])):
        return slice(pages[0] * page_size, pages[0] * page_size + end)
    slots = table[:used].long()[:, None] * page_size + torch.arange(page_size)
    return slots.view(-1)[:end].to(device)


def last_rows(plan: StepPlan) -> list[bool] | None:
    """Per sequence, whether its last row is its only logit row (False: it has none); None
    when some sequence needs other rows (prompt logprobs) or no row could be skipped."""
    keep = []
    for work in plan.seqs:
        rows = logit_rows(work, 0)
        if rows and rows != [work.num_tokens - 1]:
            return None
        keep.append(bool(rows))
    if sum(w.num_tokens for w in plan.seqs) == sum(keep):
        return None
    return keep


def logit_rows(work, row: int) -> list[int]:
    """Rows of a sequence whose logits are needed: prompt-logprob targets and the sample row."""
    rows = []
    if work.logprob_targets:
        rows += range(row, row + len(work.logprob_targets))
    if work.sample is not None and (not rows or rows[-1] != row + work.num_tokens - 1):
        rows.append(row + work.num_tokens - 1)
    return rows


class StageExecutor:
    def __init__(self, model: StageModel, kv: StageKV):
        self.model = model
        self.kv = kv  # page owners and cache tiers: called before and after each forward
        self.cache = kv.cache
        self.num_forwards = 0
        # A TP leader's link to its stage's other ranks (runtime/tp.py): everything this
        # executor does to its layers and pages, it first tells them, so they do the same.
        self.tp = None
        self.memory: dict = {}  # runtime/worker.stage_memory_marks, once the stage is loaded

    def apply_page_ops(self, ops) -> None:
        """Page ops that travel without a forward (control messages, the stop)."""
        if self.tp is not None:
            self.tp.share_page_ops(ops)
        self.kv.without_forward(ops)

    def own_pages(self, rid: str, pages: list[int], window_pages=()) -> None:
        """Pages a PD decode allocated to a request outside any plan (its KV comes from the
        prefill), on this stage's TP ranks too; window_pages: its window table ('Window
        pages'; -1: none)."""
        window = [p for p in window_pages if p != -1]
        if self.tp is not None:
            self.tp.share_owners(("allocate", rid, list(pages)))
            if window:
                self.tp.share_owners(("window_allocate", rid, window))
        self.kv.owners.allocate(rid, pages)
        if self.kv.window_owners is not None:
            self.kv.window_owners.allocate(rid, window)

    def pages_written(self, pages: list[int], window_pages=()) -> None:
        """Pages a PD transfer filled: readable from now on, on every TP rank."""
        window = [p for p in window_pages if p != -1]
        if self.tp is not None:
            self.tp.share_owners(("written", list(pages)))
            if window:
                self.tp.share_owners(("window_written", window))
        self.kv.owners.mark_written(pages)
        if self.kv.window_owners is not None:
            self.kv.window_owners.mark_written(window)

    def close(self) -> None:
        """At stop: the stage's other TP ranks stop too; pending storage writes finish."""
        if self.tp is not None:
            self.tp.share_stop()
        self.kv.close()

    def forward(self, plan: StepPlan, acts: Activations | None
                ) -> tuple[Activations | None, float]:
        """Runs this stage's layers; returns the output activations (None for a plan without
        sequences) and the forward seconds."""
        t0 = time.perf_counter()
        if self.tp is not None:
            acts = self.tp.share_forward(plan, acts)  # whole again under the per-rank transport
        if not plan.seqs:  # cache copies only (a storage fetch for a request that waits)
            self.kv.without_forward(plan.page_ops)
            return None, time.perf_counter() - t0
        if plan.step_id >= 0:  # scratch plans (warm-up, profile) run before anyone owns pages
            self.kv.before_forward(plan.page_ops, plan.seqs)
        self.num_forwards += 1
        device = self.cache.k.device
        meta = build_meta(plan, self.cache.page_size, device,
                          self.model.cfg.sliding_window if self.cache.window is not None else None)
        if self.model.is_last:
            meta.last_rows = last_rows(plan)
        if acts is None:
            ids = torch.tensor([t for w in plan.seqs for t in w.input_ids], dtype=torch.long)
            acts = Activations(self.model.embed(ids.to(device)), None)
        hidden, residual = self.model.forward(acts.hidden, acts.residual, meta,
                                              *self.cache.per_layer())
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the forward time is for the chunk-cost model
        if plan.step_id >= 0:
            self.kv.after_forward(plan.page_ops)
        return Activations(hidden, residual, self.model.trims(meta)), time.perf_counter() - t0

    def scratch_prefill(self, num_tokens: int, pages: list[int] | None = None) -> float:
        """Seconds of a from-scratch prefill of num_tokens dummy tokens on this stage's layers
        (zero activations in on later stages) into `pages`: a scratch plan (step id -1), no
        page bookkeeping, the caller owns the pages (pages 0.. by default, which no request
        owns before the stage serves)."""
        if pages is None:
            pages = list(range(-(-num_tokens // self.cache.page_size)))
        else:
            self.kv.wait_for(pages, pages)  # a host-tier copy out of a freed page finishes first
        plan = StepPlan(-1, [SeqWork("scratch", 0, num_tokens, [1] * num_tokens, pages)])
        acts = None
        if not self.model.is_first:
            shape, device = (num_tokens, self.model.cfg.hidden_size), self.cache.k.device
            acts = Activations(torch.zeros(shape, dtype=self.model.dtype, device=device),
                               torch.zeros(shape, dtype=torch.float32, device=device))
        return self.forward(plan, acts)[1]

    def profile_bench(self) -> ProfileBench:
        """What the chunking room's start-up profile times on this stage."""
        # The profile's cache key tells a TP stage's timings from one rank's.
        tp = f" tp{self.tp.size}" if self.tp is not None else ""
        return ProfileBench(self.scratch_prefill, self.cache.page_size,
                            type(self.cache).__name__ + tp, self.model.cfg.hidden_size)

    def logit_blocks(self, plan: StepPlan, acts: Activations | None):
        """Last stage: the logits of the rows needed_rows(plan) lists, in that order, as
        float32 blocks of rows (StageModel.logit_blocks); none where no row needs any. Every
        TP rank of the last stage runs through them for every plan: the ranks gather their
        vocabulary shares of each block together."""
        rows = [r for seq_rows in needed_rows(plan) for r in seq_rows]
        if not rows:
            return iter(())
        held = range(len(rows)) if acts.logit_rows_only else rows
        return self.model.logit_blocks(acts.hidden, acts.residual,
                                       torch.tensor(held, device=acts.hidden.device))

    def results(self, plan: StepPlan, acts: Activations) -> StepResult:
        """Last stage: logits on the needed rows, then sampling and logprobs, a block of
        rows at a time (each sequence takes the rows of each block that are its own)."""
        per_seq = needed_rows(plan)
        scores = [_SeqScores(work, len(rows)) for work, rows in zip(plan.seqs, per_seq)]
        seq, row = 0, 0  # the sequence whose rows come next, and its next row
        for block in self.logit_blocks(plan, acts):
            block, at = block.cpu(), 0
            while at < len(block):
                while scores[seq].rows == row:
                    seq, row = seq + 1, 0
                take = min(len(block) - at, scores[seq].rows - row)
                scores[seq].add(row, block[at:at + take])
                at, row = at + take, row + take
        result = StepResult(plan.step_id)
        result.seqs = [s.result() for s in scores]
        return result


def needed_rows(plan: StepPlan) -> list[list[int]]:
    """Per sequence of the plan, the rows of the micro-batch whose logits it needs."""
    per_seq, row = [], 0
    for work in plan.seqs:
        per_seq.append(logit_rows(work, row))
        row += work.num_tokens
    return per_seq


class _SeqScores:
    """One sequence's prompt logprobs and sampled token, from the blocks of logits its rows
    fall in. A failure (a sampling parameter that slipped past validation, a torch error)
    fails this request only: the stage keeps serving."""

    def __init__(self, work: SeqWork, rows: int):
        self.work, self.rows = work, rows
        self.prompt_logprobs: list[float] = []
        # sample()'s (token, logprob, top) from its last row, drawn when that row's block
        # arrives: no copy of the row outlives the block (ARCHITECTURE.md, 'A chunk's path').
        self.sampled: tuple | None = None
        self.error: str | None = None

    def add(self, first: int, logits: torch.Tensor) -> None:
        """The logits of its rows first .. first + len(logits) - 1."""
        if self.error is not None:
            return
        try:
            targets = self.work.logprob_targets or []
            k = min(len(targets) - first, len(logits))
            if k > 0:
                picked = torch.tensor(targets[first:first + k], dtype=torch.long)
                logprobs = torch.log_softmax(logits[:k], -1)
                self.prompt_logprobs += logprobs.gather(1, picked[:, None])[:, 0].tolist()
            if first + len(logits) == self.rows and self.work.sample is not None:
                self.sampled = sample(logits[-1], self.work.sample)
        except Exception as e:  # noqa: BLE001 - becomes this request's error
            self._failed(e)

    def result(self) -> SeqResult:
        res = SeqResult(self.work.rid)
        if self.error is None and self.sampled is not None:
            res.token, res.token_logprob, res.top_logprobs = self.sampled
        if self.error is not None:
            return SeqResult(self.work.rid, error=self.error)
        if self.work.logprob_targets:
            res.prompt_logprobs = self.prompt_logprobs
        return res

    def _failed(self, e: Exception) -> None:
        log.warning("sampling failed for %s: %s: %s", self.work.rid, type(e).__name__, e)
        self.error = f"sampling failed: {type(e).__name__}: {e}"
