"""Decode through the packed small-M GEMM, end to end.

* Greedy continuations of 64 tokens equal HF transformers (float32) and the previous code path
  (--decode-gemm-max-rows 0: F.linear everywhere), at batch 1 and batch 8 with mixed prompt
  lengths (so decode steps run 8 rows through every linear layer and the LM head).
* A sequence's logits are bit-identical alone and inside a batch of 8 (stage code in process:
  the same per-sequence prefill, then decode steps of 1 vs 8 rows): the kernel's per-row
  summation order does not depend on M, and nothing else in a decode step mixes rows.
* --weight-dtype bfloat16 under float32 compute equals HF float32 on the same weights rounded
  to bf16: the model is then the bf16-rounded model, computed in float32, so the greedy tokens
  must agree exactly (no bf16 tolerance needed).
"""
import random

import pytest
import torch

from conftest import save_tiny_model, single_stage, track
from pipefill import Engine
from pipefill.config import ServerArgs
from pipefill.kernels import decode_gemm
from pipefill.base.plan import SampleSpec, SeqWork, StepPlan

pytestmark = pytest.mark.skipif(not decode_gemm.available(),
                                reason="no decode GEMM path runs on this machine")

PAGE = 16
NEW = 64
LENGTHS = [5, 37, 16, 90, 1, 64, 23, 48]
_rng = random.Random(14)
PROMPTS = [[_rng.randrange(512) for _ in range(n)] for n in LENGTHS]


def hf_greedy(path: str, prompts: list[list[int]], n: int):
    """HF transformers float32 greedy tokens and top-1 minus top-2 logit gaps per prompt, each
    step a full forward without a KV cache (HF's cached generate disagrees with its own uncached
    forward on the tiny Qwen2 model past 64 tokens, by up to 0.13 in a logit). The prompts go
    as one right-padded batch: under the causal mask no real token sees the padding."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seqs = [list(p) for p in prompts]
    gaps = [[] for _ in prompts]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only adds waits on a busy CPU
    try:
        _greedy_steps(model, seqs, gaps, n)
    finally:
        torch.set_num_threads(threads)
    return [(s[len(p):], g) for s, p, g in zip(seqs, prompts, gaps)]


def _greedy_steps(model, seqs, gaps, n):
    with torch.no_grad():
        for _ in range(n):
            width = max(map(len, seqs))
            ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
            logits = model(ids).logits
            for i, s in enumerate(seqs):
                top = logits[i, len(s) - 1].topk(2)
                gaps[i].append(float(top.values[0] - top.values[1]))
                s.append(int(top.indices[0]))


def assert_agrees(ours: list[int], ref: list[int], gaps: list[float], min_gap: float = 1e-3):
    """Equal until the reference itself is a near tie (float32 sums in another order move a
    logit by ~1e-6; a gap under 1e-3 is a coin flip), after which the texts may part."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[i] < min_gap, f"token {i}: {a} != {b}, reference gap {gaps[i]:.4f}"
            return
    assert len(ours) == len(ref)


@pytest.fixture(scope="module")
def hf_tokens(tiny_models):
    return hf_greedy(tiny_models["qwen2"], PROMPTS, NEW)


def engine(path, **kw):
    return track(Engine(path, dtype="float32", page_size=PAGE, threads_per_stage=1, **kw))


def test_greedy_matches_hf_and_torch_path_batch_1_and_8(tiny_models, hf_tokens):
    # qwen2: qkv bias (the kernel's bias path) and a tied LM head.
    path = tiny_models["qwen2"]
    with engine(path) as e:
        batch = [o.output_ids for o in e.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)]
        alone = e.generate(PROMPTS[3:4], max_new_tokens=NEW, ignore_eos=True)[0].output_ids
    with engine(path, decode_gemm_max_rows=0) as e:
        torch_batch = [o.output_ids for o in e.generate(PROMPTS, max_new_tokens=NEW,
                                                        ignore_eos=True)]
    for ours, (ref, gaps) in zip(batch, hf_tokens):
        assert_agrees(ours, ref, gaps)
    assert alone == batch[3]
    assert torch_batch == batch


def _stage(path, dtype, **kw):
    return single_stage(path, dtype, page_size=PAGE, **kw)


def _step(ex, seqs: dict, tables, start):
    """One forward of seqs {i: tokens} starting at start[i] -> the logits of each last token."""
    spec = SampleSpec(0.0, 1.0, -1, 0, 0, None)
    works = []
    for i, toks in seqs.items():
        end = start[i] + len(toks)
        works.append(SeqWork(f"s{i}", start[i], end, toks, tables[i][:-(-end // PAGE)], spec))
    acts, _ = ex.forward(StepPlan(-1, works), None)  # -1: scratch plan, the test owns the pages
    rows = torch.tensor(list(range(len(works))))
    if any(w.num_tokens > 1 for w in works) and not acts.logit_rows_only:
        rows = torch.cumsum(torch.tensor([w.num_tokens for w in works]), 0) - 1
    return ex.model.logits(acts.hidden, acts.residual, rows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sequence_bits_alone_equal_inside_batch(tiny_models, dtype):
    if dtype == "bfloat16" and not decode_gemm.available(torch.bfloat16):
        pytest.skip("no bf16 decode GEMM path here")
    ex = _stage(tiny_models["llama"], dtype)
    assert ex.model.w.layers[0].packed is not None
    pages = 8
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(len(PROMPTS))]
    with torch.inference_mode():
        # Prefill each sequence alone (the same forward in both runs), then 6 decode steps.
        nxt = {i: int(_step(ex, {i: p}, tables, [0] * 8)[0].argmax()) for i, p in
               enumerate(PROMPTS)}
        alone_pos = list(LENGTHS)
        alone, tok = [], nxt[3]
        for s in range(6):
            logits = _step(ex, {3: [tok]}, tables, {3: LENGTHS[3] + s})[0]
            alone.append(logits.clone())
            tok = int(logits.argmax())
        for i, p in enumerate(PROMPTS):  # rewrite every cache from scratch
            _step(ex, {i: p}, tables, [0] * 8)
        toks = dict(nxt)
        for s in range(6):
            pos = [n + s for n in alone_pos]
            logits = _step(ex, {i: [toks[i]] for i in range(8)}, tables, pos)
            assert torch.equal(logits[3], alone[s]), f"step {s}: batch-8 row != batch-1 row"
            toks = {i: int(logits[i].argmax()) for i in range(8)}


def test_bf16_weights_under_float32_compute_match_the_rounded_model(tmp_path):
    path = save_tiny_model("llama", tmp_path / "src", seed=3)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # norms stay float32 in pipefill
                p.copy_(p.bfloat16().float())
    rounded = str(tmp_path / "rounded")
    model.save_pretrained(rounded)
    prompts = PROMPTS[:4]
    refs = hf_greedy(rounded, prompts, 32)
    with engine(path, weight_dtype="bfloat16") as e:
        outs = e.generate(prompts, max_new_tokens=32, ignore_eos=True)
    for out, (ref, gaps) in zip(outs, refs):
        assert_agrees(out.output_ids, ref, gaps)


def test_weight_dtype_errors_name_the_flag():
    from pipefill.model.loader import resolve_weight_dtype
    with pytest.raises(ValueError, match="--weight-dtype float32 needs --dtype float32"):
        resolve_weight_dtype("float32", torch.bfloat16)
    with pytest.raises(ValueError, match="--weight-dtype bfloat16"):
        resolve_weight_dtype("bfloat16", torch.float16)
    with pytest.raises(ValueError, match="--decode-gemm-max-rows"):
        ServerArgs(decode_gemm_max_rows=-1)
    assert resolve_weight_dtype("auto", torch.bfloat16) == torch.bfloat16


def _reference_support(logits, temperature, top_k, top_p) -> set[int]:
    """Tokens the old full-sort sampler could draw (mask top-k, sort, cut the nucleus)."""
    scaled = logits / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, -1)
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = (torch.cumsum(sorted_probs, -1) - sorted_probs) >= top_p
        drop[0] = False
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0))
    return set(torch.nonzero(probs).flatten().tolist())


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (50, 1.0), (-1, 0.9), (-1, 0.3), (40, 0.8),
                                         (-1, 0.9999), (1, 1.0)])
def test_sampler_draws_only_from_the_nucleus_without_a_full_sort(top_k, top_p):
    from pipefill.runtime.sampler import sample
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 3
    support = _reference_support(logits, 0.8, top_k, top_p)
    drawn = {sample(logits, SampleSpec(0.8, top_p, top_k, seed, 0, None))[0]
             for seed in range(200)}
    assert drawn <= support
    if len(support) > 1:
        assert len(drawn) > 1  # it does sample
    again = sample(logits, SampleSpec(0.8, top_p, top_k, 7, 3, None))[0]
    assert again == sample(logits, SampleSpec(0.8, top_p, top_k, 7, 3, None))[0]
    assert sample(logits, SampleSpec(0.0, top_p, top_k, 7, 3, None))[0] == int(logits.argmax())


def test_greedy_token_is_torch_argmax():
    """The greedy pick (numpy) equals torch.argmax: the first of tied maxima, a NaN as the
    maximum, infinities, bf16 logits, a strided row."""
    from pipefill.runtime.sampler import greedy_token
    nan, inf = float("nan"), float("inf")
    rows = [torch.tensor(r) for r in ([1., 3., 3., 2.], [1., nan, 5., nan], [-inf] * 4,
                                      [0., inf, inf], [nan] * 3, [2.])]
    g = torch.Generator().manual_seed(0)
    rows += [torch.randn(49152, generator=g), torch.randn(100, generator=g).to(torch.bfloat16),
             torch.randn(8, 300, generator=g)[:, 7]]
    rows += [torch.randint(0, 4, (1000,), generator=g).float() for _ in range(5)]  # many ties
    for r in rows:
        assert greedy_token(r) == int(torch.argmax(r)), r


def test_build_meta_slots_equal_token_slots_on_random_plans():
    """build_meta derives the write slots from the read slots and expands scattered page tables
    page by page: the same cache slots as token_slots, for decode and prefill work alike."""
    import random as _random

    from pipefill.kv.cache import token_slots
    from pipefill.runtime.executor import build_meta
    rng = _random.Random(0)
    cache = torch.arange(100_000)
    for _ in range(200):
        ps, works = rng.choice([16, 64]), []
        for i in range(rng.randint(1, 4)):
            start = rng.randint(0, 300)
            end = start + rng.choice([1, rng.randint(1, 200)])
            n = -(-end // ps)
            pages = (rng.sample(range(1000), n) if rng.random() < 0.5
                     else list(range(7 * i + 3, 7 * i + 3 + n)))
            works.append(SeqWork(f"r{i}", start, end, [1] * (end - start), pages))
        meta = build_meta(StepPlan(-1, works), ps, torch.device("cpu"))
        assert torch.equal(meta.positions, torch.cat([torch.arange(w.start, w.end)
                                                      for w in works]))
        for w, m in zip(works, meta.seqs):
            assert torch.equal(cache[m.write_slots],
                               cache[token_slots(w.page_table, w.start, w.end, ps)])
            assert torch.equal(cache[m.read_slots], cache[token_slots(w.page_table, 0, w.end, ps)])
            assert m.page_table.tolist() == w.page_table


def test_hidden_cpu_flags_force_the_fallback_paths(tiny_models):
    """--hide-cpu-flags runs the stage as on a smaller CPU: AVX-512 hidden -> the AVX2 path;
    AVX2 hidden too -> torch (no packed copies)."""
    assert decode_gemm.hidden_isas("avx512_bf16") == ("amx", "avx512bf16")
    assert decode_gemm.hidden_isas("amx_tile") == ("amx",)
    assert decode_gemm.hidden_isas("avx512f") == ("amx", "avx512bf16", "avx512")
    assert decode_gemm.hidden_isas("fma") == ("avx2",)
    if not decode_gemm.isa_status()["avx2"][0]:
        pytest.skip("AVX2 path cannot run here: " + decode_gemm.isa_status()["avx2"][1])
    from pipefill.kernels import fused_ops
    from pipefill.model.layers import FusedOps, TorchOps
    from pipefill.base.platform import usable_cpu_flags
    try:
        ex = _stage(tiny_models["llama"], "float32", hide_cpu_flags="avx512f")
        assert ex.model.w.lm_head_packed.isa == "avx2"
        assert all(p.isa == "avx2" for p in ex.model.w.layers[0].packed.values())
        # The fused elementwise ops follow the same hidden flags (a smaller build, or torch).
        if isinstance(ex.model.ops, FusedOps):
            assert "512" not in fused_ops.kernel_variant()
        ex = _stage(tiny_models["llama"], "float32", hide_cpu_flags="avx512f,avx2")
        assert ex.model.w.lm_head_packed is None and ex.model.w.layers[0].packed is None
        assert isinstance(ex.model.ops, TorchOps)
    finally:
        fused_ops.fused_available(flags=usable_cpu_flags(""))


def test_bench_decode_interleaves_cases_and_reports_batch_ratios(tiny_models, tmp_path, capsys):
    """`pipefill bench decode` on a tiny model: one row per (batch, context), each with its
    ratio to batch 1 at the same context (cases timed in turn within every repetition)."""
    import json

    from pipefill.cli.main import main
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--model-path", tiny_models["llama"], "--batch", "1,3",
                 "--context", "8,40", "--steps", "2", "--reps", "2", "--no-hf",
                 "--page-size", str(PAGE), "--dtype", "float32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 8), (3, 8), (1, 40), (3, 40)]
    assert all(r["x_batch_1"] == r["ms"] / next(s["ms"] for s in rows if s["batch"] == 1 and
                                               s["context"] == r["context"]) for r in rows)
    assert [r["x_batch_1"] for r in rows if r["batch"] == 1] == [1.0, 1.0]
    assert all(r["kv_bytes"] > 0 and r["floor_ms"] > 0 for r in rows)
    assert "x batch 1" in capsys.readouterr().out


def test_bench_decode_times_engine_generate_against_hf_alike(tiny_models, tmp_path, capsys):
    """With HF on, every (batch, context) row also times pipefill's whole Engine.generate loop
    the way HF generate is timed, both in every repetition: the row keeps every repetition's
    figure for both, and the ratio is the median of the per-repetition ratios."""
    import json
    import statistics

    from pipefill.cli.main import main
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--model-path", tiny_models["llama"], "--batch", "2",
                 "--context", "16", "--steps", "2", "--reps", "3",
                 "--page-size", str(PAGE), "--dtype", "float32", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert len(row["engine_ms_all"]) == len(row["hf_ms_all"]) == 3
    assert row["engine_ms"] == statistics.median(row["engine_ms_all"])
    ratios = [e / h for e, h in zip(row["engine_ms_all"], row["hf_ms_all"])]
    assert row["engine_over_hf"] == statistics.median(ratios)
    assert "Engine.generate" in capsys.readouterr().out
