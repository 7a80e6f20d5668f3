"""`pipefill bench prefill` as a user runs it (the CLI, real stage processes, tiny model), and
the weight and KV byte counts its memory report divides by."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import FAMILIES, save_tiny_model
from pipefill.bench.make_model import write_fp8_copy
from pipefill.bench.memory import memory_report, stage_needs, stage_weight_bytes
from pipefill.config import make_server_args, resolve
from pipefill.kernels import quant_gemm
from pipefill.kernels.prefill_gemm import onednn_status
from pipefill.model.loader import WeightSource, load_stage_weights, resolve_model_path

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def weight_nbytes(w) -> int:
    """Bytes of the distinct tensors a stage holds (a tied head counted once), an embedding
    held as GGUF blocks (a QuantLinear) included."""
    seen, total = set(), 0
    tensors = [getattr(layer, f) for layer in w.layers for f in layer.__dataclass_fields__
               if f not in ("packed", "prefill")] + [w.embed, w.final_norm, w.lm_head]
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.nbytes
    return total


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_match_the_loaded_stage(tmp_path, family, dtype):
    source = WeightSource(save_tiny_model(family, tmp_path))
    cfg = source.config
    for layers, first, last in ((range(0, 4), True, True), (range(0, 2), True, False),
                                (range(2, 4), False, True)):
        w = load_stage_weights(source, layers, first, last, dtype)
        assert stage_weight_bytes(cfg, len(layers), first, last, dtype) == weight_nbytes(w)


def test_weight_bytes_of_a_gguf_file_count_what_each_stage_keeps():
    """The default model's GGUF file, a stage of 2 layers and one of 28: gguf counts the
    matrices as the blocks a loaded stage holds (they are their own decode copies: nothing
    packed), bfloat16 dequantized with packed copies, and auto what model/auto_weights.py's
    rule picks: blocks where the quantized GEMM has a vector path here, dequantized once
    --hide-cpu-flags hides them."""
    source = WeightSource(resolve_model_path(None))

    def needs(**kw):
        args = resolve(make_server_args(source.path, dtype="bfloat16", pp_size=2,
                                        pp_layer_partition="2,28", **kw), source.config)
        return stage_needs(args, source.config, 64, 1024, source=source)
    gguf, plain = needs(weight_dtype="gguf"), needs(weight_dtype="bfloat16")
    held = load_stage_weights(source, range(2), True, False, torch.bfloat16, blocks=True)
    quantized = sum(q.nbytes for layer in held.layers for q in layer.packed.values())
    assert gguf[0]["weights"] == weight_nbytes(held) + quantized
    assert [(n["blocks"], n["packed"]) for n in gguf] == [(True, 0), (True, 0)]
    assert not any(n["blocks"] for n in plain) and all(n["packed"] > 0 for n in plain)
    assert sum(n["weights"] for n in gguf) < 0.5 * sum(n["weights"] for n in plain)
    vector = quant_gemm.choose_int8()[0] or quant_gemm.choose_isa()[0] in ("avx512", "avx2")
    auto = needs(weight_dtype="auto")
    assert [n["blocks"] for n in auto] == [bool(vector)] * 2
    assert [n["weights"] for n in auto] == [n["weights"] for n in (gguf if vector else plain)]
    assert all(n["blocks_why"].startswith("auto: ") for n in auto)
    hidden = needs(weight_dtype="auto", hide_cpu_flags="avx512f,avx2")
    assert [(n["blocks"], n["weights"]) for n in hidden] == \
        [(False, n["weights"]) for n in plain]


def test_weight_bytes_of_fp8_codes_count_what_each_stage_keeps(tmp_path):
    """A tiny FP8 checkpoint (widths over one 128 block) in stages of 1 and 3 layers: fp8
    counts the linear layers as the codes, block scales and grid rows a loaded stage holds,
    with no packed copies of them (only the last stage's head, dequantized, has one where the
    decode GEMM runs); bfloat16 counts them dequantized."""
    save_tiny_model("qwen3", tmp_path / "float", hidden_size=144, intermediate_size=200)
    write_fp8_copy(tmp_path / "float", tmp_path / "fp8")
    source = WeightSource(str(tmp_path / "fp8"))
    cfg = source.config

    def needs(**kw):
        args = resolve(make_server_args(source.path, dtype="bfloat16", pp_size=2,
                                        pp_layer_partition="1,3", **kw), cfg)
        return stage_needs(args, cfg, 64, 1024, source=source)
    fp8, plain = needs(weight_dtype="fp8"), needs(weight_dtype="bfloat16")
    for need, (layers, first, last) in zip(fp8, ((range(1), True, False),
                                                 (range(1, 4), False, True))):
        held = load_stage_weights(source, layers, first, last, torch.bfloat16, blocks=True)
        codes = sum(q.nbytes for layer in held.layers for q in layer.packed.values())
        assert need["blocks"] and need["weights"] == weight_nbytes(held) + codes
    head = cfg.vocab_size * cfg.hidden_size * 2 if plain[1]["packed"] else 0
    assert [n["packed"] for n in fp8] == [0, head]
    assert not any(n["blocks"] for n in plain)
    assert sum(n["weights"] for n in fp8) < sum(n["weights"] for n in plain)


def test_kv_bytes_count_whole_pages_of_each_stage_layers(tmp_path):
    source = WeightSource(save_tiny_model("llama", tmp_path))
    args = resolve(make_server_args(str(tmp_path), dtype="float32", pp_size=2,
                                    pp_layer_partition="1,3"), source.config)
    needs = stage_needs(args, source.config, prompt_tokens=65, pool_tokens=1024)
    per_layer_token = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, float32
    assert [n["kv_prompt"] for n in needs] == [128 * per_layer_token, 3 * 128 * per_layer_token]
    assert [n["kv_pool"] for n in needs] == [1024 * per_layer_token, 3 * 1024 * per_layer_token]
    report = memory_report(needs, [10 * 2**20, 20 * 2**20], 5 * 2**20)
    need = sum(n["weights"] + n["packed"] + n["kv_prompt"] for n in needs)
    assert report["ratio_prompt"] == pytest.approx(30 * 2**20 / need)
    assert report["ratio_pool"] < report["ratio_prompt"]


def test_kv_bytes_of_window_layers_count_what_they_hold(tmp_path):
    """Gemma 3's local layers free their pages outside the window (ARCHITECTURE.md, 'Window
    pages'): a prompt's KV is its global layer's pages and, per local layer, its ring (a
    window and a piece) and the window the prefix cache keeps, whatever the chunk size, under
    PD (tcp, mooncake, TP ranks) and the storage tier too."""
    from pipefill.model.families.gemma3 import GEMMA3
    cfg = GEMMA3.config_from_hf(dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=20,
        sliding_window_pattern=3, max_position_embeddings=1024))  # local, local, global, local
    per_layer_page = 2 * 2 * 64 * 4 * 4  # K and V, 2 KV heads, head_dim 64, float32, 4 tokens
    kw = dict(dtype="float32", page_size=4, chunked_prefill_size=64)
    args = resolve(make_server_args(str(tmp_path), **kw), cfg)
    needs = stage_needs(args, cfg, prompt_tokens=400, pool_tokens=1024)
    # The ring: a piece (a quarter window, a page at least: 1) and ceil(19 / 4) = 5 pages; the
    # window before page boundary 99 (token 396): tokens 377-395, pages 94-98.
    window_pages = (1 + 5) + 5
    assert needs[0]["kv_prompt"] == (100 + 3 * window_pages) * per_layer_page
    assert needs == stage_needs(args.replace(chunked_prefill_size=16), cfg, 400, 1024)
    short = stage_needs(args, cfg, prompt_tokens=12, pool_tokens=1024)  # 3 pages, all held
    assert short[0]["kv_prompt"] == 4 * 3 * per_layer_page
    pd = resolve(make_server_args(str(tmp_path), disaggregation_mode="prefill",
                                  disaggregation_insecure=True, **kw), cfg)
    assert stage_needs(pd, cfg, 400, 1024)[0]["kv_prompt"] == needs[0]["kv_prompt"]
    stored = resolve(make_server_args(str(tmp_path), hicache_storage_backend="file",
                                      hicache_storage_dir=str(tmp_path / "l3"), **kw), cfg)
    assert stage_needs(stored, cfg, 400, 1024)[0]["kv_prompt"] == needs[0]["kv_prompt"]
    mooncake = resolve(make_server_args(str(tmp_path), disaggregation_mode="prefill",
                                        disaggregation_insecure=True,
                                        disaggregation_transfer_backend="mooncake", **kw), cfg)
    assert stage_needs(mooncake, cfg, 400, 1024)[0]["kv_prompt"] == needs[0]["kv_prompt"]
    tp = resolve(make_server_args(str(tmp_path), disaggregation_mode="prefill",
                                  disaggregation_insecure=True, tp_size=2, **kw), cfg)
    assert stage_needs(tp, cfg, 400, 1024)[0]["kv_prompt"] == needs[0]["kv_prompt"]


def test_bench_prefill_reports_peak_rss_and_scaling(tmp_path):
    model = save_tiny_model("llama", tmp_path / "model")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pipefill.cli.main", "bench", "prefill", "--model-path", model,
         "--input-len", "300", "--pp-size", "1,2", "--reps", "2", "--no-hf", "--no-split",
         "--chunked-prefill-size", "128", "--max-prefill-tokens", "128",
         "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "peak RSS of the stages" in proc.stdout
    assert "peak above the baseline" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {(r["len"], r["pp_size"]) for r in rows} == {(300, 1), (300, 2)}
    for r in rows:
        mem = r["memory"]
        assert len(mem["stages"]) == r["pp_size"]
        # A stage process holds at least its weights and the prompt's KV, and an interpreter
        # with torch costs far more than a tiny model: ratios well above 1.
        for s in mem["stages"]:
            assert s["peak_rss"] > s["weights"] + s["kv_prompt"]
            assert s["ratio_prompt"] > 1 and s["ratio_pool"] > 0
            assert s["load_peak_rss"] > s["weights"]
            assert s["weights"] < s["rss_before"] <= s["peak_rss"]
            # The stage's own marks: its RSS before any weight below its peak, and its weight
            # tensors the bytes the report counts within 15% (the decode GEMM's copies carry
            # padding and scales the count leaves out: 10% of this tiny model's bytes); a
            # second copy of any matrix would break it.
            assert 0 < s["baseline_rss"] < s["loaded_rss"] and s["baseline_rss"] < s["peak_rss"]
            assert s["above_baseline"] == s["peak_rss"] - s["baseline_rss"]
            need = s["weights"] + s["packed"]
            assert abs(s["weight_tensors"] - need) < 0.15 * need
        assert mem["total_peak_rss"] == sum(s["peak_rss"] for s in mem["stages"])
        assert mem["ratio_above_baseline"] < mem["ratio_prompt"]
        assert mem["engine_peak_rss"] > 0
        # Cold prefills: no repetition reuses an earlier one's pages (every chunk computed).
        assert sum(r["chunk_sizes"]) == r["len"]
        if r["pp_size"] == 2:
            base = next(x for x in rows if x["len"] == r["len"] and x["pp_size"] == 1
                        and x["threads_per_stage"] == r["threads_per_stage"])
            assert r["scaling_efficiency"] == pytest.approx(
                base["pipefill"]["ttft_s"] / (2 * r["pipefill"]["ttft_s"]))


def test_bench_prefill_time_split_with_auto_chunks(tmp_path):
    """--chunked-prefill-size auto: the time split runs the C0 auto chose in the timed run
    (it passed the string 'auto' to the scheduler and died with a TypeError)."""
    model = save_tiny_model("llama", tmp_path / "model")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pipefill.cli.main", "bench", "prefill", "--model-path", model,
         "--input-len", "300", "--reps", "1", "--no-hf", "--chunked-prefill-size", "auto",
         "--dynamic-chunking-profile-cache", str(tmp_path / "profiles"), "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "time split" in proc.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["split"]["wall_s"] > 0 and sum(row["chunk_sizes"]) == 300


@pytest.mark.skipif(not onednn_status()[0], reason=onednn_status()[1])
def test_bench_prefill_compares_prefill_gemms_in_turn(tmp_path):
    model = save_tiny_model("llama", tmp_path / "model")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pipefill.cli.main", "bench", "prefill", "--model-path", model,
           "--input-len", "200", "--reps", "1", "--no-hf", "--no-split", "--dtype", "float32",
           "--json", str(out)]
    proc = subprocess.run(cmd + ["--compare-prefill-gemm", "torch,onednn"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    base = rows[0]["config"]
    assert [r["config"] for r in rows] == [base, f"{base}-torch", f"{base}-onednn"]
    assert "prefill GEMM torch (requested)" in proc.stderr
    assert "prefill GEMM onednn (requested)" in proc.stderr
    bad = subprocess.run(cmd + ["--compare-prefill-gemm", "mkl"], capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode == 2 and "--compare-prefill-gemm 'mkl'" in bad.stderr


def test_bench_prefill_against_hf_reports_spread_and_paired_ratio(tmp_path):
    """With HF on, each row gives the median TTFT of both sides with their [min-max] spread, and
    pipefill / HF is the median of the per-repetition ratios (each pair timed back to back),
    not one median over the other."""
    import statistics
    model = save_tiny_model("llama", tmp_path / "model")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pipefill.cli.main", "bench", "prefill", "--model-path", model,
         "--input-len", "200", "--reps", "3", "--no-split", "--dtype", "float32",
         "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    ours, hf = row["pipefill"]["times_s"], row["hf"]["times_s"]
    assert len(ours) == len(hf) == 3
    assert row["ratio_ttft_pipefill_over_hf"] == pytest.approx(
        statistics.median(a / b for a, b in zip(ours, hf)))
    assert row["hf"]["min_s"] == min(hf) and row["pipefill"]["max_s"] == max(ours)
    assert f"[{min(ours):.3f}-{max(ours):.3f}]" in proc.stdout


@pytest.mark.slow
def test_bench_prefill_compares_weight_dtypes_in_turn(tmp_path):
    """The default GGUF dequantized and with its blocks kept, timed in one run."""
    from pipefill.model.loader import resolve_model_path
    try:
        model = resolve_model_path(None)
    except ValueError as e:
        pytest.skip(str(e))
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pipefill.cli.main", "bench", "prefill", "--model-path", model,
           "--input-len", "100", "--reps", "1", "--no-hf", "--no-split", "--json", str(out)]
    proc = subprocess.run(cmd + ["--compare-weight-dtype", "bfloat16,gguf"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    base = json.loads(out.read_text())["rows"][0]["config"]
    assert [r["config"] for r in json.loads(out.read_text())["rows"]] == \
        [base, f"{base}-bfloat16", f"{base}-gguf"]
    assert "GGUF blocks kept quantized (--weight-dtype gguf, requested)" in proc.stderr
    assert "GGUF weights dequantized at load" in proc.stderr
    bad = subprocess.run(cmd + ["--compare-weight-dtype", "int4"], capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode == 2 and "--compare-weight-dtype 'int4'" in bad.stderr


@pytest.mark.slow
def test_bench_prefill_compares_tp_sizes(tmp_path):
    """--compare-tp-size 2 adds TP2 (one thread per rank) beside PP1 with the same threads,
    with its scaling efficiency against that one process."""
    model = save_tiny_model("llama", tmp_path / "model")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pipefill.cli.main", "bench", "prefill", "--model-path", model,
         "--input-len", "200", "--reps", "1", "--no-hf", "--no-split", "--dtype", "float32",
         "--threads-per-stage", "1", "--compare-tp-size", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    tp = rows["pp1-t1-tp2"]
    assert tp["tp_size"] == 2 and sum(tp["chunk_sizes"]) == 200
    assert tp["scaling_efficiency"] == pytest.approx(
        rows["pp1-t1"]["pipefill"]["ttft_s"] / (2 * tp["pipefill"]["ttft_s"]))


@pytest.mark.slow
def test_bench_prefill_compares_moe_splits_in_turn(tmp_path):
    """--compare-tp-moe-split width,expert times each TP configuration once per split (a
    mixture-of-experts model) in its place; without a TP configuration it is refused."""
    from test_moe_family import save_moe
    model = save_moe("qwen3_moe", tmp_path / "model")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pipefill.cli.main", "bench", "prefill", "--model-path", model,
           "--input-len", "100", "--reps", "1", "--no-hf", "--no-split", "--dtype", "float32",
           "--threads-per-stage", "1", "--compare-tp-moe-split", "width,expert"]
    proc = subprocess.run(cmd + ["--compare-tp-size", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["pp1-t1", "pp1-t1-tp2-expert", "pp1-t1-tp2-width"]
    assert "experts split by expert" in proc.stderr and "experts split by width" in proc.stderr
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "needs a tensor-parallel configuration" in bad.stderr
