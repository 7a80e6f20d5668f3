"""`pipefill plan` end to end: the default model on this machine's kind of CPU, the published
deployments, --help, and a sentence (exit 2) for every bad file."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from pipefill.cli.main import build_parser, main
from pipefill.planner import Layout, Precision, evaluate, load_hardware_file, search

from test_planner_costs import DATA, SMOLLM2

BF16 = Precision("bfloat16", "bfloat16", "bfloat16")
# This machine (AMD EPYC Zen 4, 2 cores) in the README's measured figures.
ZEN4 = DATA / "epyc-zen4-2cores.toml"


def test_the_default_model_at_2048_tokens_orders_pp1_tp2_pp2():
    """As measured on this machine (bf16, 2,048 tokens, C0 2,048): PP1 with two threads
    1.722 s, TP2 1.999 s, PP2 one thread a stage 3.284 s (one chunk cannot pipeline)."""
    cpu = load_hardware_file(str(DATA / "two-cores.toml"))
    ttft = {name: evaluate(SMOLLM2, cpu, lay, BF16, 2048, 2048).ttft_s
            for name, lay in (("PP1", Layout(1, 1, 2)), ("TP2", Layout(1, 2)),
                              ("PP2", Layout(2, 1)))}
    assert ttft["PP1"] < ttft["TP2"] < ttft["PP2"]
    assert ttft["PP2"] / ttft["PP1"] == pytest.approx(2, rel=0.1)  # one core, no pipelining
    assert ttft["TP2"] / ttft["PP1"] < 1.1  # the all-reduces cost little
    # Left to choose C0, a pipeline of two cuts the prompt and nearly catches up.
    plans = {str(p.layout): p for p in search(SMOLLM2, cpu, 2, BF16, 2048)}
    assert plans["PP2xTP1"].num_chunks > 1 and plans["PP2xTP1"].ttft_s < 0.8 * ttft["PP2"]
    assert str(search(SMOLLM2, cpu, 2, BF16, 2048)[0].layout) == "PP1xTP1x2thr"


# The README's quiet sittings on this machine at 8,192 tokens, bf16, chunks of 2,048 (Benchmarks,
# "AMD EPYC Zen 4 (AVX-512-BF16, no AMX), 2 threads: ...", `bench prefill --pp-size 2
# --compare-tp-size 2`): PP1 on both cores, PP2 one thread a stage, TP2 one thread a rank (5:4
# query heads), PP1 on one thread (stop 37 only).
STOP_37 = {Layout(1, 1, 2): 11.14, Layout(2, 1): 14.75, Layout(1, 2): 11.91, Layout(1, 1, 1): 21.30}
STOP_36 = {Layout(1, 1, 2): 11.22, Layout(2, 1): 15.01, Layout(1, 2): 12.47}


def test_the_default_model_at_8192_tokens_against_this_machines_measurements():
    """Predicted from this machine's description (data/epyc-zen4-2cores.toml: peak and
    bandwidth as the README measured them, the TP ranks' link from `bench allreduce`, the
    efficiency calibrated once on stop 37's PP1 of 11.14 s) against the measured TTFTs of both
    quiet sittings, within 10%, and their ratios to PP1 within 5%. At 0.88: PP1 11.14 s, PP2
    15.1 s (+2% and +1%), TP2 11.9 s (0% and -4%: stop 36's TP2 ran 1.11x PP1, stop 37's
    1.07x), PP1 on one thread 22.1 s (+4%)."""
    cpu = load_hardware_file(str(ZEN4))
    at_peak = replace(cpu, efficiency=1.0)
    pp1 = Layout(1, 1, 2)
    calibrated = evaluate(SMOLLM2, at_peak, pp1, BF16, 8192, 2048).ttft_s
    # TTFT ~ (compute at the peak) / efficiency + the chunks' fixed overhead
    overhead = 4 * cpu.chunk_overhead
    calibrated = (calibrated - overhead) / (STOP_37[pp1] - overhead)
    assert cpu.efficiency == pytest.approx(calibrated, abs=0.005)  # the file's one constant
    ttft = {lay: evaluate(SMOLLM2, cpu, lay, BF16, 8192, 2048).ttft_s for lay in STOP_37}
    for measured in (STOP_37, STOP_36):
        for lay, seconds in measured.items():
            assert ttft[lay] == pytest.approx(seconds, rel=0.10), lay
            assert ttft[lay] / ttft[pp1] == pytest.approx(seconds / measured[pp1],
                                                          rel=0.05), lay


def plan_output(capsys, *args) -> str:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def test_plan_prints_the_best_layout_and_the_alternatives(capsys, tmp_path):
    out = plan_output(capsys, "--model-config", str(DATA / "smollm2-135m.json"), "--hardware",
                      str(DATA / "two-cores.toml"), "--input-len", "2048",
                      "--chunked-prefill-size", "2048", "--json", str(tmp_path / "p.json"))
    assert "best for 2048 tokens: PP1xTP1x2thr, chunks of 2048" in out
    assert "run: pipefill serve --pp-size 1 --tp-size 1 --threads-per-stage 2" in out
    rows = [line.split()[0] for line in out.splitlines() if re.match(r"\s+PP\d", line)]
    assert rows == ["PP1xTP1x2thr", "PP1xTP2", "PP2xTP1"]
    saved = json.loads((tmp_path / "p.json").read_text())
    assert [p["layout"] for p in saved["plans"]] == rows


def test_plan_for_qwen3_235b_on_four_h20_nodes(capsys):
    out = plan_output(capsys, "--model-config", str(DATA / "qwen3-235b-a22b-fp8.json"),
                      "--hardware", "h20", "--nodes", "4", "--input-len", "131072",
                      "--pp-size", "8", "--chunked-prefill-size", "18432",
                      "--smooth-factor", "0.8")
    assert "fp8 GEMMs, bfloat16 attention" in out
    best = re.search(r"best for 131072 tokens: PP8xTP4, dynamic chunks from C0 18432, sigma "
                     r"0.8: TTFT ([\d.]+) s", out)
    assert best and abs(float(best.group(1)) / 10.54 - 1) < 0.15
    assert "--nnodes 4" in out and "--enable-dynamic-chunking" in out


def test_the_default_model_on_this_machine(capsys):
    """The default model (its GGUF file) on this machine, measured now: two threads in one
    stage beat two TP ranks, which beat two stages that one chunk of 2,048 cannot
    pipeline. Prints what the lead compares with measured prefills."""
    out = plan_output(capsys, "--input-len", "2048", "--chunked-prefill-size", "2048",
                      "--devices", "2", "--measure-seconds", "0.3")
    assert "hardware this-cpu" in out and "measured now" in out
    rows = [line.split()[0] for line in out.splitlines() if re.match(r"\s+PP\d", line)]
    assert rows == ["PP1xTP1x2thr", "PP1xTP2", "PP2xTP1"], out


def failed_plan(capsys, *args) -> str:
    """stderr of a `pipefill plan` that must exit 2 with a sentence."""
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipefill plan: error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("content, words", [
    ("{not json", "not valid JSON"),
    ('{"model_type": "llama"}', "the config has no"),
    ('{"model_type": "gpt2"}', "unsupported architecture"),
    ("[1, 2]", "expected a JSON object"),
])
def test_a_bad_model_config_is_a_sentence(capsys, tmp_path, content, words):
    path = tmp_path / "config.json"
    path.write_text(content)
    assert words in failed_plan(capsys, "--model-config", str(path), "--hardware", "h20",
                                "--input-len", "1024")


def test_a_bad_hardware_file_is_a_sentence(capsys, tmp_path):
    path = tmp_path / "hw.json"
    path.write_text('{"devices_per_node": 8}')
    model = ["--model-config", str(DATA / "smollm2-135m.json"), "--input-len", "1024"]
    assert "missing" in failed_plan(capsys, *model, "--hardware", str(path))
    assert "no such preset" in failed_plan(capsys, *model, "--hardware", "h21")
    assert "no such file" in failed_plan(capsys, "--model-config", str(path) + "x.json",
                                         "--hardware", "h20", "--input-len", "1024")


@pytest.mark.parametrize("args, words", [
    (["--input-len", "0"], "--input-len must be at least 1"),
    (["--input-len", "64", "--smooth-factor", "2"], "--smooth-factor '2'"),
    (["--input-len", "64", "--pp-size", "3"], "no layout of 8 devices has --pp-size 3"),
    (["--input-len", "64", "--weight-dtype", "fp4"], "--weight-dtype 'fp4'"),
])
def test_bad_flags_are_sentences(capsys, args, words):
    assert words in failed_plan(capsys, "--model-config", str(DATA / "smollm2-135m.json"),
                                "--hardware", "h20", *args)


def test_help_explains_every_flag():
    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    for action in plan._actions:
        assert action.help and len(action.help) > 10, action.option_strings
