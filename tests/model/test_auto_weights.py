"""--weight-dtype auto on a GGUF file (model/auto_weights.py): the rule, one test per branch,
the facts read from the default Q4_1 file, and a stage built with auto: blocks kept where the
quantized decode GEMM has a vector path here, dequantized once --hide-cpu-flags hides them."""
import dataclasses
import functools
import logging

import pytest
import torch

from pipefill.config import ServerArgs, resolve
from pipefill.kernels import quant_gemm as qg
from pipefill.kernels.quant_gemm import QuantLinear
from pipefill.model.auto_weights import AutoFacts, auto_keeps_gguf, gather_facts
from pipefill.model.loader import (WeightSource, hidden_decode_paths, resolve_model_path,
                                   stage_keeps_blocks, tensor_names)
from pipefill.runtime.stage import StageInfo, build_stage

BASE = AutoFacts(types=("Q4_1", "Q8_0"), unreadable=(), float_isa="avx512", int8="avx512vnni",
                 device="cpu", dtype_flag="auto", dtype=torch.bfloat16, tp_size=1,
                 block_bytes=60 * 2**20, dense_bytes=200 * 2**20)
# Hides both float builds the quantized GEMM has (and so both integer paths).
NO_VECTOR_PATH = "avx512f,avx2"


def facts(**kw) -> AutoFacts:
    return dataclasses.replace(BASE, **kw)


@pytest.mark.parametrize("kw,keeps,says", [
    ({}, True, "integer path (avx512vnni)"),
    ({"int8": None}, True, "float path (avx512)"),
    ({"int8": None, "float_isa": "avx2"}, True, "float path (avx2)"),
    ({"dtype_flag": "bfloat16"}, True, "integer path"),
    ({"dtype": torch.float32}, True, "integer path"),  # auto resolved to float32 (no bf16 CPU)
    ({"int8": None, "float_isa": "scalar"}, False, "no vector path"),
    ({"int8": None, "float_isa": "torch"}, False, "no vector path"),
    ({"device": "cuda"}, False, "CPU stages"),
    ({"tp_size": 2}, False, "--tp-size 2"),
    ({"types": ()}, False, "plain floats"),
    ({"types": ("IQ2_XS", "Q4_1"), "unreadable": ("IQ2_XS",)}, False, "reads IQ2_XS"),
    ({"dtype_flag": "float32", "dtype": torch.float32}, False, "--dtype float32"),
    ({"dtype_flag": "float16", "dtype": torch.float16}, False, "float32 or bfloat16"),
], ids=["int8", "float-avx512", "float-avx2", "bf16-flag", "auto-float32", "scalar", "torch",
        "cuda", "tp", "no-blocks", "unreadable-type", "float32-flag", "float16"])
def test_the_rule_per_branch(kw, keeps, says):
    got, why = auto_keeps_gguf(facts(**kw))
    assert got is keeps and says in why, why
    assert why.startswith("auto: ") and "60 MiB a decode step in blocks against 200 MiB" in why


def test_facts_of_the_default_q4_1_file():
    """Every layer matrix is Q4_1 (0.625 bytes a weight), the tied head Q8_0 (1.0625); the
    dequantized bf16 copy is 2 bytes a weight. A first stage without the head leaves the
    embedding out (a decode step reads one row of it)."""
    source = WeightSource(resolve_model_path(None))
    cfg, layers = source.config, range(source.config.num_layers)
    whole = gather_facts(source, tensor_names(cfg, layers, True, True), "cpu", "auto",
                         torch.bfloat16)
    assert whole.types == ("Q4_1", "Q8_0") and whole.unreadable == ()
    first = gather_facts(source, tensor_names(cfg, layers, True, False), "cpu", "auto",
                         torch.bfloat16)
    assert first.types == ("Q4_1",)
    assert first.block_bytes == pytest.approx(first.dense_bytes * 0.625 / 2, rel=1e-9)
    head = cfg.vocab_size * cfg.hidden_size
    assert whole.dense_bytes - first.dense_bytes == 2 * head
    assert whole.block_bytes - first.block_bytes == head * 34 // 32
    # Decided without the kernels (no build at start): an explicit --dtype float32.
    exact = gather_facts(source, tensor_names(cfg, layers, True, True), "cpu", "float32",
                         torch.float32)
    assert exact.float_isa == "not asked" and not auto_keeps_gguf(exact)[0]


def first_two_layers(source: WeightSource, **kw):
    """A first stage of two layers (of a two-stage pipeline) with these flags: what a stage
    makes of --weight-dtype auto, at a fraction of the whole model's load."""
    args = resolve(ServerArgs(model_path=source.path, dtype="bfloat16", max_total_tokens=256,
                              threads_per_stage=1, **kw), source.config)
    return build_stage(args, source, StageInfo(0, 2, range(2)))


def kept_blocks(stage) -> bool:
    packed = stage.model.w.layers[0].packed or {}
    return bool(packed) and all(isinstance(q, QuantLinear) for q in packed.values())


def test_auto_keeps_blocks_here_and_not_without_a_vector_path(caplog):
    """End to end on this CPU: auto keeps the default file's blocks where the quantized GEMM
    has a vector path (logged with the reason), and dequantizes once --hide-cpu-flags hides
    the ISAs it needs."""
    source = WeightSource(resolve_model_path(None))
    vector = qg.choose_int8()[0] or qg.choose_isa()[0] in ("avx512", "avx2")
    with caplog.at_level(logging.INFO, logger="pipefill"):
        stage = first_two_layers(source, weight_dtype="auto")
    assert kept_blocks(stage) is bool(vector)
    if vector:
        assert "GGUF blocks kept quantized (--weight-dtype auto, auto: decode reads fewer " \
               "bytes" in caplog.text and "MiB a decode step in blocks against" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipefill"):
        hidden = first_two_layers(source, weight_dtype="auto", hide_cpu_flags=NO_VECTOR_PATH)
    assert not kept_blocks(hidden)
    assert "GGUF weights dequantized at load (--weight-dtype: auto: no vector path" in \
        caplog.text



def test_one_stage_decision_for_the_stage_and_the_figures():
    """stage_keeps_blocks, the one question build_stage and the memory figures ask: auto
    decides on the stage's own facts (with the vector paths hidden: dequantized; at TP 2:
    dequantized), gguf keeps the blocks and still gives the facts the figures count, a dtype
    gives none."""
    source = WeightSource(resolve_model_path(None))
    ask = functools.partial(stage_keeps_blocks, source=source, layers=range(2), first=True,
                            last=False, device="cpu", dtype_flag="bfloat16",
                            dtype=torch.bfloat16)
    hidden = hidden_decode_paths(NO_VECTOR_PATH)
    assert {"avx512", "avx2", "int8-avx2"} <= set(hidden)
    keeps, why, facts = ask("auto", disable=hidden)
    assert not keeps and "no vector path" in why and facts.types == ("Q4_1",)
    keeps, why, facts = ask("gguf", disable=hidden)
    assert (keeps, why) == (True, "requested") and facts.block_bytes < facts.dense_bytes
    assert ask("bfloat16") == (False, "bfloat16 requested", None)
    keeps, why, _ = ask("auto", tp_size=2)
    assert not keeps and "--tp-size 2 dequantizes under auto" in why
