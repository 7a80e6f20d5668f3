"""`pipefill bench decode`: decode steps at each batch size and context length, against the
memory floor, against torch's F.linear on the same stage and against HF transformers.

One stage holding every layer is built in this process (the engine's own stage code); each of
`--batch` sequences gets `--context` cached tokens (the KV pages are filled with values, so they
are real memory reads), then greedy decode steps run through the executor (forward + LM head +
sampling, as on a last stage). Timed, interleaved per repetition:

* pipefill — the packed small-M decode GEMM (--decode-gemm-max-rows) for every linear layer;
* torch    — the same stage with the packed copies switched off (F.linear everywhere);
* general  — the packed GEMM, but every layer through the family's layer_forward instead of
             the lean decode path (model/decode_step.py): what the per-call overhead costs;
* latent torch — a latent-attention model (DeepSeek) whose decode rows run on the latent
             kernel (kernels/mla_attention.py): the same steps with them in torch (mla.absorbed);
* engine   — pipefill's whole `Engine.generate` loop (front end, scheduler, stage process,
             sampling, detokenization) for 1 + S new tokens, timed as HF's is: per step
             (last token - first token) / S, a batch of equal prompts, the prefix cache off;
* HF       — transformers `generate` on the same weights and dtype in this process, the same
             way (a streamer notes each step's tokens), alternating with `engine` in every
             repetition.

Every repetition visits all (batch, context) cases in turn, so the ratios between batch sizes
come from steps timed side by side (this machine's speed drifts by tens of percent within
minutes). engine and HF are timed after them, A B A B per case; their rows give the median
and the spread (min-max) over the repetitions, and the ratio is the median of the
per-repetition ratios.

Bytes per step = weights streamed (packed copies, or the torch matrices; the embedding is a
gather and is not counted, but a head kept as GGUF blocks counts its blocks, the embedding's
where they are tied) + the KV cache read (batch x context x bytes per token). The memory floor
is those bytes over the read bandwidth measured in this run on the stage's threads
(kernels.quant_gemm.read_bandwidth: one pass over 512 MiB, as a decode GEMM at M = 1 streams
its weights; where that kernel does not build, torch's `copy_` of 512 MiB, read + write bytes
per second). The engine loop around a step (scheduler, pipes) is not timed.
A mixture-of-experts model's step reads, besides attention, KV and head, each sparse layer's
router and shared expert and only the distinct routed experts its rows chose: those are
counted from the routing each timed step took (the mean over steps), and the row adds the
routers' own time (GEMM, softmax, top-k: torch ops) as a share of the step. Where --tp-size
(or a --compare-tp-size) splits the experts by expert (--tp-moe-split), the row also gives
what each rank reads of them from the same routing: only the distinct experts it holds.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import statistics
import time

import torch

from pipefill.bench.prefill import add_peer_flags, load_hf_model, parse_ints, start_peer
from pipefill.config import resolve, server_args_from_namespace, server_args_parser_group
from pipefill.engine import Engine
from pipefill.kernels.quant_gemm import read_bandwidth
from pipefill.model.loader import WeightSource, resolve_model_path
from pipefill.model.tensor_parallel import resolve_moe_split, tp_shard
from pipefill.base.platform import cpu_name, dtype_name, resolve_dtype
from pipefill.runtime.stage import StageInfo, build_stage
from pipefill.base.plan import SampleSpec, SeqWork, StepPlan

log = logging.getLogger("pipefill.bench")


def add_parser(sub) -> None:
    p = sub.add_parser("decode", help="decode steps vs. the memory floor, torch and HF",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,4,16", help="comma-separated batch sizes")
    p.add_argument("--context", default="512,8192", help="comma-separated cached tokens")
    p.add_argument("--steps", type=int, default=16, help="decode steps per repetition")
    p.add_argument("--reps", type=int, default=3, help="repetitions (medians reported)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--hf-max-tokens", type=int, default=16384,
                   help="skip HF where batch x context exceeds this (its prefill is slow)")
    p.add_argument("--json", metavar="FILE", help="write every number to this JSON file")
    p.add_argument("--compare-tp-size", metavar="LIST", default="",
                   help="also time Engine.generate's batch-1 decode step at each --context "
                        "with --tp-size N (comma-separated; usable cores // N threads per "
                        "rank) against --tp-size 1 on all the stage's threads, alternating")
    add_peer_flags(p)
    server_args_parser_group(p, skip=("max_total_tokens",))
    p.set_defaults(run=run)



def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes per second (read + write) of torch's copy_ on this process's threads."""
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(reps))
    return 2 * nbytes / best


def floor_bandwidth() -> tuple[float, str]:
    """(bytes per second, what they are) that the memory floor divides by: the read bandwidth
    of this process's threads, or copy_'s read + write where the read kernel does not build."""
    try:
        return read_bandwidth(), "read bandwidth"
    except RuntimeError:
        return copy_bandwidth(), "copy bandwidth (read + write)"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(ns: argparse.Namespace) -> int:
    batches = parse_ints(ns.batch, "--batch")
    contexts = parse_ints(ns.context, "--context")
    tp_sizes = (parse_ints(ns.compare_tp_size, "--compare-tp-size", minimum=2)
                if ns.compare_tp_size.strip() else [])
    if ns.steps < 1 or ns.reps < 1:
        raise ValueError("--steps and --reps must be at least 1")
    args = server_args_from_namespace(ns)
    source = WeightSource(resolve_model_path(args.model_path))
    per_seq = max(contexts) + ns.steps + 1
    args = resolve(args.replace(max_model_len=args.max_model_len or per_seq), source.config)
    if per_seq > args.max_model_len:
        raise ValueError(f"--context {max(contexts)} + --steps {ns.steps} does not fit "
                         f"--max-model-len {args.max_model_len}")
    pages_per_seq = -(-per_seq // args.page_size)
    engine_args = args.replace(pp_size=1, disable_radix_cache=True)
    # prefill_gemm torch: the `torch` column is F.linear on the plain matrices, which a
    # oneDNN prefill copy would replace (decode itself runs the packed copies either way).
    args = args.replace(max_total_tokens=max(batches) * pages_per_seq * args.page_size, pp_size=1,
                        prefill_gemm="torch")
    torch.set_num_threads(args.layout.num_threads)
    executor = _build(args, source)
    dtype = resolve_dtype(args.dtype)
    bw, bw_what = floor_bandwidth()
    hf = None if ns.no_hf else load_hf_model(source, dtype)
    print(f"{cpu_name()}, {args.layout.num_threads} threads, {dtype_name(dtype)} compute, "
          f"weights {args.weight_dtype}; {bw_what} {bw / 1e9:.1f} GB/s"
          + (f"; {executor.model.attention.describe()}"
             if hasattr(executor.model.attention, "describe") else ""))
    cases = [(batch, context) for context in contexts for batch in batches]
    peer = start_peer(ns, resolve_model_path(args.model_path), args.layout.num_threads,
                      per_seq + 16)
    try:
        rows = bench_cases(executor, cases, pages_per_seq, ns.steps, ns.reps, bw,
                           peer_steps_ms(peer, source.config.vocab_size, max(contexts)),
                           expert_shares(args.tp_moe_split, source.config,
                                         [args.tp_size, *tp_sizes]))
    finally:
        if peer is not None:
            peer.close()
    single = {r["context"]: r["ms"] for r in rows if r["batch"] == 1}
    for row in rows:
        if row["context"] in single:
            row["x_batch_1"] = row["ms"] / single[row["context"]]
    if hf is not None:
        del executor  # the engine's stage process holds its own copy of the weights
        gc.collect()  # the model and its decode runner refer to each other: free them now
        with Engine(**engine_args.flags()) as engine:
            for row in rows:
                if row["batch"] * row["context"] <= ns.hf_max_tokens:
                    row.update(generate_vs_hf(engine, hf, row["batch"], row["context"],
                                              ns.steps, ns.reps, source.config.vocab_size))
    for row in rows:
        print_row(row)
    tp_rows = compare_tp(engine_args, tp_sizes, contexts, ns.steps, ns.reps,
                         source.config.vocab_size)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"cpu": cpu_name(), "threads": args.layout.num_threads,
                       "args": args.flags(), "floor_bytes_per_s": bw,
                       "floor_bandwidth": bw_what, "rows": rows,
                       "tp_rows": tp_rows}, f, indent=2)
        print(f"wrote {ns.json}")
    return 0


def _build(args, source):
    info = StageInfo(0, 1, range(source.config.num_layers))
    return build_stage(args, source, info)


def weight_bytes(model, packed: bool) -> int:
    """Bytes of the weights every step reads: each layer's dense matrices (a sparse layer's
    router and shared expert, not its routed experts: routed_bytes counts those) and the head."""
    total = 0
    for layer in model.w.layers:
        if packed and layer.packed:
            total += sum(p.nbytes for p in layer.packed.values())
        else:
            total += sum(getattr(layer, n).nbytes for n in model.family.matrices
                         if getattr(layer, n) is not None)
        if getattr(layer, "up", None) is not None:  # MLA's kv_b_proj, plain (model/mla.py)
            total += layer.up.kv_b.nbytes
        if getattr(layer, "moe", None) is not None:
            total += layer.moe.fixed_bytes_read()
    return total + head_bytes(model.w, packed)


def head_bytes(w, packed: bool) -> int:
    """Bytes of the LM head a step reads: its decode copy (packed), else the plain matrix; a
    head held only as GGUF blocks (a tied head on the stage that holds the embedding is the
    embedding's blocks, lm_head None) reads those blocks either way. 0 off the last stage."""
    if packed and w.lm_head_packed is not None:
        return w.lm_head_packed.nbytes
    if w.lm_head is not None:
        return w.lm_head.nbytes
    return w.lm_head_quant.nbytes if w.lm_head_quant is not None else 0


def expert_shares(requested: str, cfg, tp_sizes: list[int]) -> dict[int, list[range]]:
    """{TP size: each rank's expert ids} for the sizes above 1 whose ranks hold whole experts
    (--tp-moe-split expert, or auto where it resolves to it); {} for a dense model."""
    if cfg.moe is None:
        return {}
    return {size: [tp_shard(cfg, rank, size, "expert").experts for rank in range(size)]
            for size in sorted(set(tp_sizes)) if size > 1
            and resolve_moe_split(requested, cfg, size)[0] == "expert"}


def routed_bytes(model, experts: range | None = None) -> int:
    """Bytes of the routed experts the last step read: in each sparse layer, every distinct
    expert its rows chose, once (the routing the step actually took), of those in `experts`
    (a TP rank's own under the expert split), by default the ones the layer holds."""
    total = 0
    for layer in model.w.layers:
        moe = getattr(layer, "moe", None)
        if moe is None or moe.last_ids is None:
            continue
        first, ids = moe.experts.first, moe.last_ids
        held = range(first, first + moe.experts.num_experts) if experts is None else experts
        total += moe.expert_bytes_read(ids[(ids >= held.start) & (ids < held.stop)])
    return total


def routed_bytes_by_rank(model, shares: dict[int, list[range]]) -> dict:
    """The last step's routed expert bytes: "stage" (this stage, every expert it holds) and,
    per TP size of `shares`, what each rank would read of its own experts."""
    return {"stage": routed_bytes(model),
            **{size: [routed_bytes(model, r) for r in ranks] for size, ranks in shares.items()}}


def _moe_copies(block) -> list[tuple[object, str]]:
    """(holder, attribute) of every decode copy of a sparse block."""
    holders = [(block, "router_packed")] + [(m, "packed") for m in block.experts.linears]
    if block.shared is not None:
        holders += [(block.shared, "packed")]
    return holders


class _TorchLinears:
    """Switches the stage's packed copies off for the `torch` measurement."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        layers = self.model.w.layers
        self.saved = [layer.packed for layer in layers], self.model.w.lm_head_packed
        self.saved_moe = [(holder, name, getattr(holder, name)) for layer in layers
                          if getattr(layer, "moe", None) is not None
                          for holder, name in _moe_copies(layer.moe)]
        for layer in layers:
            layer.packed = None
        for holder, name, value in self.saved_moe:
            setattr(holder, name, {} if isinstance(value, dict) else None)
        self.model.w.lm_head_packed = None

    def __exit__(self, *exc):
        for layer, packed in zip(self.model.w.layers, self.saved[0]):
            layer.packed = packed
        for holder, name, value in self.saved_moe:
            setattr(holder, name, value)
        self.model.w.lm_head_packed = self.saved[1]


def peer_steps_ms(peer, vocab_size: int, longest: int):
    """(context, steps) -> the llama.cpp peer's ms per greedy step after `context` (at most
    `longest`) tokens of a fixed random prompt, or None without a peer."""
    if peer is None:
        return None
    prompt = [100 + (7919 * i) % (min(vocab_size, peer.n_vocab) - 100) for i in range(longest)]
    return lambda context, steps: peer.decode_ms_per_token(prompt[:context], steps)


def bench_cases(executor, cases: list[tuple[int, int]], pages_per_seq: int, steps: int,
                reps: int, bw: float, peer=None, shares: dict | None = None) -> list[dict]:
    """One row per (batch, context) case. Each repetition times every case in turn (and in a
    case: packed GEMM, torch, general path, and at batch 1 the llama.cpp peer where there is
    one), so a drift of the machine's speed reaches all cases alike and the batch-B / batch-1
    ratios compare steps timed minutes apart at most. shares: expert_shares's, for the
    routed expert bytes per rank."""
    cache, model = executor.cache, executor.model
    for part in (cache, cache.window):  # the window layers' own pages too, where kept apart
        if part is not None:  # real memory behind every page the steps read (any layout)
            part.k.fill_(0.01)
            part.v.fill_(0.01)
    times = {case: {"ours": [], "torch": [], "general": [], "routed_bytes": [], "peer": [],
                    "latent_torch": []} for case in cases}
    latent_kernel = getattr(model.attention, "decode_isa", None) is not None
    for case in cases:
        _steps_ms(executor, *case, pages_per_seq, 2)  # warm-up (buffers of this batch size)
    for _ in range(reps):
        for case in cases:
            t = times[case]
            t["ours"] += _steps_ms(executor, *case, pages_per_seq, steps, t["routed_bytes"],
                                   shares or {})
            with _TorchLinears(model):
                t["torch"] += _steps_ms(executor, *case, pages_per_seq, steps)
            model.fast_decode = False  # the general layer code (before the lean decode path)
            t["general"] += _steps_ms(executor, *case, pages_per_seq, steps)
            model.fast_decode = True
            if peer is not None and case[0] == 1:  # llama-cpp-python decodes one sequence
                t["peer"].append(peer(case[1], steps))
            if latent_kernel:
                with _TorchLatentDecode(model):
                    t["latent_torch"] += _steps_ms(executor, *case, pages_per_seq, steps)
    rows = [_row(model, cache, *case, times[case], bw) for case in cases]
    for row, case in zip(rows, cases):
        if times[case]["peer"]:
            row["llama_cpp_ms"] = statistics.median(times[case]["peer"])
            row["llama_cpp_ms_all"] = times[case]["peer"]
    if any(getattr(layer, "moe", None) is not None for layer in model.w.layers):
        for row in rows:
            row["router_ms"] = router_ms(model, row["batch"], reps * steps)
    return rows


class _TorchLatentDecode:
    """Runs a latent-attention model's decode rows in torch instead of on the latent kernel,
    for the `latent torch` measurement."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.saved = self.model.attention
        self.model.attention = dataclasses.replace(self.saved, decode_isa=None)

    def __exit__(self, *exc):
        self.model.attention = self.saved


def _steps_ms(executor, batch: int, context: int, pages_per_seq: int, n_steps: int,
              routed: list | None = None, shares: dict | None = None) -> list[float]:
    """Milliseconds of each of n_steps greedy decode steps of `batch` sequences at `context`
    cached tokens (forward + LM head + sampling, as on a last stage); each step's routed
    expert bytes (routed_bytes_by_rank over `shares`) appended to `routed` where given."""
    tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(batch)]
    times = []
    for s in range(n_steps):
        spec = SampleSpec(0.0, 1.0, -1, 0, s, None)
        # step_id -1: a scratch plan (no page owners to check: this bench owns the pool).
        plan = StepPlan(-1, [SeqWork(f"r{i}", context + s, context + s + 1, [100 + i],
                                    tables[i], spec) for i in range(batch)])
        t0 = time.perf_counter()
        acts, _ = executor.forward(plan, None)
        executor.results(plan, acts)
        times.append(1e3 * (time.perf_counter() - t0))
        if routed is not None:
            routed.append(routed_bytes_by_rank(executor.model, shares or {}))
    return times


def router_ms(model, batch: int, reps: int) -> float:
    """Median ms of every sparse layer's router of one step (its GEMM, softmax, top-k and
    renormalisation, as model/moe.py runs them) on `batch` random rows."""
    from pipefill.model.layers import linear
    from pipefill.model.moe import choose
    blocks = [layer.moe for layer in model.w.layers if getattr(layer, "moe", None) is not None]
    x = torch.randn(batch, model.cfg.hidden_size).to(model.dtype)
    times = []
    with torch.inference_mode():
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for b in blocks:
                logits = linear(x, b.router, None, b.router_packed)
                (b.rule or choose)(logits[:, :b.spec.num_experts], b.spec, model.dtype)
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times[1:])  # the first: warm-up


def _row(model, cache, batch: int, context: int, times: dict, bw: float) -> dict:
    cfg = model.cfg
    kv = batch * context * sum(s.bytes_per_token for s in model.family.kv_specs(
        cfg, range(model.num_layers), cache.k.dtype))  # the latent's, for MLA
    # The routed experts a step read, from the routing the timed steps took (0: dense).
    steps = times["routed_bytes"]
    routed = statistics.mean(s["stage"] for s in steps) if steps else 0.0
    per_rank = {size: [statistics.mean(s[size][r] for s in steps) for r in range(size)]
                for size in (steps[0] if steps else {}) if size != "stage"}
    wbytes = weight_bytes(model, packed=True) + routed
    ms = statistics.median(times["ours"])
    return {"batch": batch, "context": context, "ms": ms,
            "torch_ms": statistics.median(times["torch"]),
            "general_ms": statistics.median(times["general"]),
            "tok_per_s_per_request": 1e3 / ms, "tok_per_s": batch * 1e3 / ms,
            "weight_bytes": wbytes, "head_bytes": head_bytes(model.w, packed=True),
            "routed_expert_bytes": routed, "kv_bytes": kv, "gb_per_s": (wbytes + kv) / ms / 1e6,
            "floor_ms": 1e3 * (wbytes + kv) / bw,
            **({"latent_torch_ms": statistics.median(times["latent_torch"])}
               if times["latent_torch"] else {}),
            **({"routed_expert_bytes_per_rank": per_rank} if per_rank else {})}


def equal_prompts(batch: int, context: int, vocab: int) -> torch.Tensor:
    """`batch` copies of one random prompt of `context` tokens, seeded by the context."""
    g = torch.Generator().manual_seed(context)
    return torch.randint(100, vocab, (1, context), generator=g).repeat(batch, 1)


class _TokenClock:
    """A transformers streamer that only notes when each step's tokens arrive (the first put is
    the prompt)."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode_ms(model, ids: torch.Tensor, steps: int) -> float:
    """ms per step of HF generate after its first token: (last token - first token) / steps."""
    clock = _TokenClock()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1 + steps,
                       min_new_tokens=1 + steps, do_sample=False, pad_token_id=0,
                       streamer=clock)
    first, last = clock.stamps[1], clock.stamps[-1]  # stamps[0]: the prompt
    return 1e3 * (last - first) / steps


def engine_decode_ms(engine, ids: torch.Tensor, steps: int) -> float:
    """ms per step of Engine.generate after the batch's first tokens, from the engine's own
    per-request clock: (last request done - last first token) / steps."""
    outs = engine.generate(ids.tolist(), max_new_tokens=1 + steps, ignore_eos=True)
    first = max(o.metrics["ttft_s"] for o in outs)
    last = max(o.metrics["e2e_s"] for o in outs)
    return 1e3 * (last - first) / steps


def generate_vs_hf(engine, hf, batch: int, context: int, steps: int, reps: int,
                   vocab: int) -> dict:
    """Per-step decode time of pipefill's whole Engine.generate loop and of HF generate, both
    from the first token to the last (the prompt's prefill left out: its run-to-run noise is
    larger than a few decode steps), alternated in every repetition."""
    ids = equal_prompts(batch, context, vocab)
    engine_decode_ms(engine, ids, 1), hf_decode_ms(hf, ids, 1)  # warm-up
    ms = {"engine": [], "hf": []}
    for _ in range(reps):
        ms["engine"].append(engine_decode_ms(engine, ids, steps))
        ms["hf"].append(hf_decode_ms(hf, ids, steps))
    ratios = [e / h for e, h in zip(ms["engine"], ms["hf"]) if h > 0]
    return {"engine_ms": statistics.median(ms["engine"]), "engine_ms_all": ms["engine"],
            "hf_ms": statistics.median(ms["hf"]), "hf_ms_all": ms["hf"],
            "engine_over_hf": statistics.median(ratios) if ratios else None}


def compare_tp(engine_args, sizes: list[int], contexts: list[int], steps: int, reps: int,
                vocab: int) -> list[dict]:
    """Batch-1 decode steps of Engine.generate at --tp-size 1 (the stage's threads) against
    each of `sizes` (threads split over the ranks), A B per repetition at every context: the
    TP ranks' step has two all-reduces a layer and the logits' gather where TP 1 has none."""
    rows = []
    threads = engine_args.layout.num_threads
    for size in sizes:
        tp_args = engine_args.replace(tp_size=size, threads_per_stage=max(1, threads // size))
        with Engine(**engine_args.flags()) as whole, Engine(**tp_args.flags()) as split:
            for context in contexts:
                ids = equal_prompts(1, context, vocab)
                engine_decode_ms(whole, ids, 1), engine_decode_ms(split, ids, 1)  # warm-up
                ms = {"tp1": [], "tp": []}
                for _ in range(reps):
                    ms["tp1"].append(engine_decode_ms(whole, ids, steps))
                    ms["tp"].append(engine_decode_ms(split, ids, steps))
                row = {"tp_size": size, "context": context, "threads_tp1": threads,
                       "threads_per_rank": tp_args.layout.num_threads,
                       "tp1_ms": statistics.median(ms["tp1"]), "tp1_ms_all": ms["tp1"],
                       "tp_ms": statistics.median(ms["tp"]), "tp_ms_all": ms["tp"],
                       "tp_over_tp1": statistics.median(
                           t / w for t, w in zip(ms["tp"], ms["tp1"]))}
                print_tp_row(row)
                rows.append(row)
    return rows


def print_tp_row(row: dict) -> None:
    print(f"batch   1 context {row['context']:>6}: Engine.generate --tp-size 1 "
          f"({row['threads_tp1']} threads) {row['tp1_ms']:7.2f} ms/step "
          f"[{_spread(row['tp1_ms_all'])}]  --tp-size {row['tp_size']} "
          f"({row['threads_per_rank']} per rank) {row['tp_ms']:7.2f} ms/step "
          f"[{_spread(row['tp_ms_all'])}]  TP/TP1 {row['tp_over_tp1']:.2f}", flush=True)


def print_row(row: dict) -> None:
    line = (f"batch {row['batch']:>3} context {row['context']:>6}: {row['ms']:7.2f} ms/step "
            f"({row['tok_per_s_per_request']:6.1f} tok/s per request, {row['tok_per_s']:7.1f} "
            f"total)  {(row['weight_bytes'] + row['kv_bytes']) / 1e6:6.0f} MB/step (head "
            f"{row['head_bytes'] / 1e6:.0f}) at "
            f"{row['gb_per_s']:5.1f} GB/s = {row['ms'] / row['floor_ms']:4.2f}x the floor "
            f"({row['floor_ms']:.2f} ms){_x_batch_1(row)}  torch linear {row['torch_ms']:7.2f} ms "
            f"({row['torch_ms'] / row['ms']:4.2f}x)  general path {row['general_ms']:7.2f} ms "
            f"({row['general_ms'] / row['ms']:4.2f}x)")
    if "router_ms" in row:  # a mixture-of-experts model: what the floor's experts are
        line += (f"  routed experts {row['routed_expert_bytes'] / 1e6:.0f} MB/step (distinct "
                 f"experts touched){_per_rank(row)}  router {row['router_ms']:.3f} ms "
                 f"({100 * row['router_ms'] / row['ms']:.1f}% of the step)")
    if "llama_cpp_ms" in row:
        line += (f"  |  llama.cpp {row['llama_cpp_ms']:7.2f} ms/token "
                 f"[{_spread(row['llama_cpp_ms_all'])}]  pipefill tok/s / llama.cpp's "
                 f"{row['llama_cpp_ms'] / row['ms']:.2f}")
    if "latent_torch_ms" in row:  # the latent kernel against torch on the same steps
        line += (f"  latent attention in torch {row['latent_torch_ms']:7.2f} ms "
                 f"({row['latent_torch_ms'] / row['ms']:4.2f}x)")
    if "hf_ms" in row:
        line += (f"  |  Engine.generate {row['engine_ms']:7.2f} ms/step "
                 f"[{_spread(row['engine_ms_all'])}]  HF generate {row['hf_ms']:7.2f} ms/step "
                 f"[{_spread(row['hf_ms_all'])}]  engine/HF {_ratio(row['engine_over_hf'])}")
    print(line, flush=True)


def _per_rank(row: dict) -> str:
    """What each rank reads of the routed experts under the expert split, per TP size."""
    return "".join(f"; per rank at --tp-size {size} split by expert (its own experts): "
                   + " / ".join(f"{b / 1e6:.0f}" for b in ranks) + " MB/step"
                   for size, ranks in row.get("routed_expert_bytes_per_rank", {}).items())


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _x_batch_1(row: dict) -> str:
    return f", {row['x_batch_1']:4.2f}x batch 1" if "x_batch_1" in row else ""
