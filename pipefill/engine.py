"""pipefill.Engine: the Python API. Starts the stages, submits, collects; the stage handling
itself is the front-end core's (frontend.FrontEnd), which the HTTP server shares."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from pipefill.base.plan import NewRequest, PDInfo, RequestOutput, SamplingParams
from pipefill.chunking.progress import PrefillProgress
from pipefill.config import ServerArgs, make_server_args
from pipefill.frontend import FrontEnd, prepare
from pipefill.model.tokenizer import Tokenizer, load_tokenizer
from pipefill.runtime.launch import StageFailure, StageGroup

log = logging.getLogger("pipefill")


@dataclass
class GenerateOutput:
    output_ids: list[int]
    text: str
    prompt_logprobs: list[float] | None  # log p(x_t | x_<t) for t >= 1, when asked
    finish_reason: str | None
    num_prompt_tokens: int
    metrics: dict = field(default_factory=dict)  # ttft_s, e2e_s, chunk_sizes, decode_tok_per_s
    token_logprobs: list[float] | None = None  # each output token's logprob, when asked


@dataclass
class _Pending:
    """One prompt of a generate() call; take() is its sink (FrontEnd.submit)."""
    index: int
    num_prompt_tokens: int
    submitted: float
    pd: PDInfo | None = None  # its PD room on a prefill or decode role
    refused: str | None = None  # stage 0's sentence, when it refused the prompt
    output_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    done_at: float | None = None
    done: RequestOutput | None = None
    prompt_logprobs: list[float] | None = None
    token_logprobs: list[float] = field(default_factory=list)
    chunk_sizes: list[int] | None = None
    cached_tokens: int = 0

    def take(self, out: RequestOutput | Exception) -> None:
        """Raises what ends the whole call: stage 0 rejected this prompt (ValueError) or it
        failed while generating (RuntimeError; a ValueError where a PD decode's prefill
        refused it); generate() then aborts the others."""
        if isinstance(out, ValueError):
            self.refused = str(out)
        if isinstance(out, Exception):
            raise out
        now = time.perf_counter()
        if out.new_token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.output_ids += out.new_token_ids
        self.token_logprobs += out.token_logprobs or []
        self.prompt_logprobs = out.prompt_logprobs or self.prompt_logprobs
        self.chunk_sizes = out.chunk_sizes or self.chunk_sizes
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        if out.finished:
            if out.finish_reason == "error":
                refused = out.error_status is not None and 400 <= out.error_status < 500
                raise (ValueError if refused else RuntimeError)(out.error)
            self.done = out
            self.first_token_at = self.first_token_at or now
            self.done_at = now


class Engine:
    def __init__(self, model_path: str | None = None, **server_args):
        args, source = prepare(make_server_args(model_path, **server_args))
        if args.node_rank != 0:
            raise ValueError("the engine runs on node 0; other nodes run "
                             "`pipefill generate|serve --node-rank N` to host their stages")
        self.args: ServerArgs = args
        self.model_file = source.path
        self.model_config = source.config
        self._failure: str | None = None  # why the stages died, once they have
        self.core = FrontEnd(args, source)  # a PD prefill's bootstrap service starts here
        try:
            self.core.launch()
            # The tokenizer loads here while the stages load their weights.
            self.tokenizer: Tokenizer | None = load_tokenizer(source, args.chat_template)
            self.core.wait_ready()
        except BaseException:
            self.core.close(grace_s=1.0)
            raise
        self.kv_capacity_tokens = self.core.kv_capacity_tokens
        self.chunking: dict = self.core.chunking  # C0, mode, fitted cost model when profiled

    @property
    def _stages(self) -> StageGroup | None:
        """The stage processes (None once shut down)."""
        return self.core.stages

    # ---- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        core = getattr(self, "core", None)  # None when __init__ failed before making it
        if core is not None:
            core.close()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- requests ----------------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass token-id lists")
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        return list(prompt)

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        self.core.check_prompt(ids, params)

    def generate(self, prompts, max_new_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = -1, seed: int | None = None,
                 return_prompt_logprobs: bool = False, ignore_eos: bool = False,
                 priority: int | list[int] = 0, show_progress: bool | None = None,
                 pd: PDInfo | list[PDInfo] | None = None,
                 logprobs: bool = False) -> list[GenerateOutput]:
        """priority: one for every prompt, or a list (--schedule-policy priority: larger
        first). show_progress: a bar per prompt longer than one chunk while it prefills
        (tokens done, tokens/s, the ETA from the chunk cost model) on stderr; None = when
        stderr is a terminal. pd: on a PD role (disaggregation_mode prefill or decode), each
        prompt's room, the same on the prefill and the decode (a list, one per prompt): the
        prefill computes the first token and hands it to the decode with the KV; the decode
        continues from it (ARCHITECTURE.md, 'Prefill/decode disaggregation'). logprobs: each
        output token's logprob in GenerateOutput.token_logprobs."""
        self._require_stages()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        rooms = self._rooms(pd, len(prompts))
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed, ignore_eos,
                                self.tokenizer.eos_token_ids if self.tokenizer else (),
                                return_prompt_logprobs, 0 if logprobs else None)
        try:
            encoded, priorities, params = self._at_the_door(prompts, params, priority, rooms)
        except ValueError as e:  # none of the call's prompts runs: their decodes hear it
            for room in rooms:
                self.core.refuse_room(room, 400, str(e))
            raise
        now = time.perf_counter()
        pending = {self.core.new_rid("req"): _Pending(i, len(ids), now, room)
                   for i, (ids, room) in enumerate(zip(encoded, rooms))}
        try:
            self.core.submit([NewRequest(rid, ids, params, p.pd, priority)
                              for (rid, p), ids, priority in zip(pending.items(), encoded,
                                                                 priorities)],
                             [p.take for p in pending.values()])
            with PrefillBars(pending, show_progress) as bars:
                self._collect(pending, bars)
        except StageFailure as e:
            # A stage is gone: stop the rest (if that has not happened yet); this engine is
            # finished.
            self._failure = str(e)
            self.core.close(grace_s=1.0)
            raise
        except BaseException:
            # A rejected or failed request, or Ctrl-C: the others of this call must not keep
            # running (and holding pages at stage 0) with nobody to collect them. (A PD
            # prefill runs its rooms to their end anyway: their decodes wait for the KV.)
            self._abort_unfinished(pending)
            for p in pending.values():
                if p.refused is not None:
                    self.core.refuse_room(p.pd, 400, p.refused)
            raise
        finally:
            for rid in pending:
                self.core.release(rid)
        return [self._finish(p) for p in sorted(pending.values(), key=lambda p: p.index)]

    def _at_the_door(self, prompts, params: SamplingParams, priority: int | list[int],
                     rooms: list[PDInfo | None]
                     ) -> tuple[list[list[int]], list[int], SamplingParams]:
        """The call's token ids, priorities and sampling (a PD role's: pd_params), checked;
        ValueError with a sentence."""
        encoded = [self.encode(p) for p in prompts]
        priorities = priority if isinstance(priority, list) else [priority] * len(encoded)
        if len(priorities) != len(encoded):
            raise ValueError(f"{len(priorities)} priorities for {len(encoded)} prompts")
        for ids in encoded:
            self.check_prompt(ids, params)
        return encoded, priorities, self.core.pd_params(params, rooms[0] if rooms else None)

    def _rooms(self, pd: PDInfo | list[PDInfo] | None, num_prompts: int
               ) -> list[PDInfo | None]:
        """Each prompt's PD room, checked as the server checks the router's fields."""
        if pd is None or (isinstance(pd, PDInfo) and num_prompts == 1):
            rooms = [pd] * num_prompts
        elif isinstance(pd, list) and len(pd) == num_prompts:
            rooms = pd
        else:
            raise ValueError(f"pd: one PDInfo per prompt, in a list ({num_prompts} prompts)")
        if not all(isinstance(room, PDInfo) for room in rooms if room is not None):
            raise ValueError("pd: rooms are pipefill.PDInfo(room, bootstrap_host, "
                             "bootstrap_port)")
        rooms = [self.core.check_room(room) for room in rooms]
        if len({room.room for room in rooms if room is not None}) < \
                sum(room is not None for room in rooms):
            raise ValueError("pd: every prompt needs a bootstrap_room of its own")
        return rooms

    def _collect(self, pending: dict[str, _Pending], bars: "PrefillBars") -> None:
        """Reads and routes the stages' reports until every request of the call finished."""
        while any(p.done is None for p in pending.values()):
            msg = self.core.recv(100)
            if msg is not None:
                self.core.route(msg)
                bars.update((self.core.load or {}).get("prefill") or [])

    def _abort_unfinished(self, pending: dict[str, _Pending]) -> None:
        for rid, p in pending.items():
            if p.done is None:
                self.core.abort(rid)

    def _require_stages(self) -> None:
        if self.core.stages is None:
            if self._failure is not None:
                raise RuntimeError(f"this engine is shut down: its stages failed earlier "
                                   f"({self._failure}); start a new Engine")
            raise RuntimeError("the engine is shut down")

    def _finish(self, p: _Pending) -> GenerateOutput:
        ttft = p.first_token_at - p.submitted
        e2e = p.done_at - p.submitted
        decode_s = e2e - ttft
        text = self.tokenizer.decode(p.output_ids) if self.tokenizer else ""
        metrics = {"ttft_s": ttft, "e2e_s": e2e, "chunk_sizes": p.chunk_sizes or [],
                   "cached_tokens": p.cached_tokens,
                   "decode_tok_per_s": (len(p.output_ids) - 1) / decode_s
                   if decode_s > 0 and len(p.output_ids) > 1 else None}
        return GenerateOutput(p.output_ids, text, p.prompt_logprobs, p.done.finish_reason,
                              p.num_prompt_tokens, metrics,
                              p.token_logprobs if p.token_logprobs else None)

    def stage_pids(self) -> list[int]:
        """Process ids of this node's stage processes, by rank (memory reports read /proc)."""
        self._require_stages()
        return [proc.pid for proc in self.core.stages.procs]

    def collect_trace(self) -> list[dict]:
        """Every stage's spans since the last call (Chrome-trace events). Needs --trace-dir."""
        if not self.args.trace_dir:
            raise ValueError("tracing is off: pass --trace-dir DIR")
        self._require_stages()
        return self.core.collect_trace()

    def write_trace(self, name: str) -> dict:
        """Writes <trace_dir>/<name>.json and .png from the spans since the last collection
        and returns the bubble statistics."""
        return self.core.write_trace(name, self.collect_trace())

    def stats(self) -> dict:
        """Stage 0's page pool with its integrity check (free + used == total), and under
        "stages" every stage's own report."""
        self._require_stages()
        return self.core.stats()


class PrefillBars:
    """A bar per prompt of one generate() call while stage 0 reports it in prefill (prompts
    longer than one chunk), closed at its first token."""

    def __init__(self, pending: dict[str, "_Pending"], show: bool | None):
        self.pending, self.disable = pending, None if show is None else not show
        self.bars: dict[str, tqdm] = {}

    def update(self, prefill: list) -> None:
        for item in prefill:
            p = PrefillProgress.of(item)
            if p.rid not in self.pending or self.pending[p.rid].first_token_at is not None:
                continue
            bar = self.bars.get(p.rid)
            if bar is None:
                bar = self.bars[p.rid] = tqdm(
                    total=p.total, desc=f"prefill {p.rid}", unit="tok", unit_scale=True,
                    leave=False, disable=self.disable, dynamic_ncols=True)
            bar.update(p.done - bar.n)
            if p.eta_s is not None:
                bar.set_postfix_str(f"eta {p.eta_s:.0f}s", refresh=False)
        for rid, bar in list(self.bars.items()):
            if self.pending[rid].first_token_at is not None:
                bar.close()
                del self.bars[rid]

    def __enter__(self) -> "PrefillBars":
        return self

    def __exit__(self, *exc) -> None:
        for bar in self.bars.values():
            bar.close()
