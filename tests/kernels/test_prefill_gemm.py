"""Prefill-sized linear layers on oneDNN (kernels.prefill_gemm, --prefill-gemm).

* The reordered GEMM against float64 for many (M, K, N): M = 1, M not a multiple of any
  block, K and N not multiples of the vector width, with and without bias, a strided input.
* Row counts are padded to a multiple of a grain (finer for small counts): a padded call
  gives the bits of the
  whole-grain call, and many distinct row counts leave the resident memory nearly where
  it was (oneDNN keeps one ~0.7 MiB primitive per row count it has seen).
* The choice: auto takes oneDNN for float32 on AMD CPUs only, and for a mixture-of-experts
  layer's experts in any dtype it runs; a named onednn that cannot run is an error naming
  the flag.
* A stage with its matrices moved to oneDNN's layout drops the plain copies and computes what
  the torch stage computes; an engine on it equals HF transformers through PP1 and PP2.
"""
import os

import pytest
import torch

from conftest import hf_reference, single_stage, track
from pipefill import Engine
from pipefill.bench.memory import proc_status_bytes
from pipefill.config import make_server_args
from pipefill.frontend import prepare
from pipefill.kernels.prefill_gemm import (ROW_GRAIN, SMALL_ROW_GRAIN, SMALL_ROWS,
                                           OneDnnLinear, choose_prefill_gemm,
                                           experts_in_onednn_layout, onednn_status,
                                           padded_rows, torch_linear)

pytestmark = pytest.mark.skipif(not onednn_status()[0], reason=onednn_status()[1])

CPU = torch.device("cpu")
F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("m", [1, 3, 33, 257, 2055])
@pytest.mark.parametrize("k,n", [(64, 96), (576, 960), (100, 37)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_against_float64(m, k, n, with_bias):
    g = torch.Generator().manual_seed(m * 7 + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    lin = OneDnnLinear.reorder(w, b, rows_hint=2048)
    y = lin(x)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.shape == (m, n) and y.dtype == F32
    # float32 products summed over K: the error grows like sqrt(K) * eps * |x||w|.
    bound = 8 * k ** 0.5 * torch.finfo(F32).eps * (x.abs().max() * w.abs().max()).item()
    assert (y.double() - ref).abs().max().item() < bound
    assert lin.nbytes == w.numel() * 4 and (lin.out_features, lin.in_features) == (n, k)


def test_row_counts_round_up_to_the_grain():
    small = (1, SMALL_ROW_GRAIN, SMALL_ROW_GRAIN + 1, SMALL_ROWS - 1, SMALL_ROWS)
    assert [padded_rows(m) for m in small] == \
        [SMALL_ROW_GRAIN, SMALL_ROW_GRAIN, 2 * SMALL_ROW_GRAIN, SMALL_ROWS, SMALL_ROWS]
    assert [padded_rows(m) for m in (SMALL_ROWS + 1, 2048, 2049)] == \
        [SMALL_ROWS + ROW_GRAIN, 2048, 2048 + ROW_GRAIN]


def test_a_padded_call_gives_the_bits_of_the_whole_grain_call():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2 * ROW_GRAIN, 576, generator=g)
    lin = OneDnnLinear.reorder(torch.randn(960, 576, generator=g), None, rows_hint=2048)
    whole = lin(x)
    for m in (1, 17, ROW_GRAIN + 1, 2 * ROW_GRAIN - 1):
        assert torch.equal(lin(x[:m]), whole[:m])
    tall = torch.randn(SMALL_ROWS + 2 * ROW_GRAIN, 576, generator=g)
    whole = lin(tall)
    for m in (SMALL_ROWS - 3, SMALL_ROWS + 5):
        assert torch.equal(lin(tall[:m]), whole[:m])


def test_torch_linear_pads_bfloat16_only():
    """bfloat16 F.linear on CPU is oneDNN as well: torch_linear pads its rows; float32
    (MKL, no per-shape state) is F.linear untouched."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(ROW_GRAIN, 64, generator=g)
    w = torch.randn(96, 64, generator=g)
    whole = torch.nn.functional.linear(x.bfloat16(), w.bfloat16())
    assert torch.equal(torch_linear(x[:5].bfloat16(), w.bfloat16()), whole[:5])
    assert torch_linear(x[:5].bfloat16(), w.bfloat16()).shape == (5, 96)
    assert torch.equal(torch_linear(x[:5], w), torch.nn.functional.linear(x[:5], w))


def test_many_row_counts_keep_resident_memory_bounded():
    """200 distinct row counts in 17 grains: without the grains oneDNN would build and keep
    200 primitives (~140 MiB here); with them, 17."""
    lin = OneDnnLinear.reorder(torch.randn(960, 576), None, rows_hint=2048)
    x = torch.randn(8 * ROW_GRAIN, 576)
    counts = range(2 * ROW_GRAIN // 3, 8 * ROW_GRAIN, 2)[:200]
    grains = sorted({padded_rows(m) for m in counts})
    assert len(grains) == 17
    for m in grains:  # the grains' primitives first
        lin(x[:m])
    before = proc_status_bytes(os.getpid(), "VmRSS")
    for m in counts:
        lin(x[:m])
    assert proc_status_bytes(os.getpid(), "VmRSS") - before < 40 * 2**20


def test_bfloat16_and_strided_input():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 80, generator=g).to(BF16)
    wide = torch.randn(40, 160, generator=g).to(BF16)
    x = wide[:, ::2]  # not contiguous
    y = OneDnnLinear.reorder(w, None, rows_hint=64)(x)
    ref = x.double() @ w.double().T
    assert y.dtype == BF16
    assert (y.double() - ref).abs().max().item() < 0.02 * ref.abs().max().item()


def test_wrong_width_is_a_clear_error():
    lin = OneDnnLinear.reorder(torch.randn(8, 16), None, rows_hint=4)
    with pytest.raises(ValueError, match="16 input features, got 12"):
        lin(torch.randn(3, 12))


def test_auto_takes_onednn_for_float32_on_amd_only():
    amd, intel = "AuthenticAMD", "GenuineIntel"
    assert choose_prefill_gemm("auto", F32, F32, CPU, amd)[0] == "onednn"
    assert choose_prefill_gemm("auto", F32, F32, CPU, "HygonGenuine")[0] == "onednn"
    assert choose_prefill_gemm("auto", F32, F32, CPU, "")[0] == "torch"  # e.g. not x86
    assert choose_prefill_gemm("auto", F32, F32, CPU, intel)[0] == "torch"
    assert choose_prefill_gemm("auto", BF16, BF16, CPU, amd)[0] == "torch"
    assert choose_prefill_gemm("auto", F32, BF16, CPU, amd)[0] == "torch"  # --weight-dtype
    assert choose_prefill_gemm("auto", torch.float16, torch.float16, CPU, amd)[0] == "torch"
    assert choose_prefill_gemm("auto", F32, F32, torch.device("cuda"), amd)[0] == "torch"
    assert choose_prefill_gemm("torch", F32, F32, CPU, amd) == ("torch", "requested")
    assert choose_prefill_gemm("onednn", BF16, BF16, CPU, intel) == ("onednn", "requested")


def test_named_onednn_that_cannot_run_names_the_flag():
    with pytest.raises(ValueError, match="--prefill-gemm onednn is not available: dtype"):
        choose_prefill_gemm("onednn", torch.float16, torch.float16, CPU, "AuthenticAMD")
    with pytest.raises(ValueError, match="--prefill-gemm onednn is not available: the matri"):
        choose_prefill_gemm("onednn", F32, BF16, CPU, "AuthenticAMD")
    with pytest.raises(ValueError, match="--prefill-gemm 'mkl'"):
        choose_prefill_gemm("mkl", F32, F32, CPU, "AuthenticAMD")


def test_front_end_refuses_a_named_onednn_before_any_stage_starts(tiny_models):
    with pytest.raises(ValueError, match="--prefill-gemm onednn is not available: dtype float16"):
        prepare(make_server_args(tiny_models["llama"], dtype="float16", prefill_gemm="onednn"))
    prepare(make_server_args(tiny_models["llama"], dtype="float32", prefill_gemm="onednn"))


def test_stage_drops_the_plain_matrices_and_computes_the_same(tiny_models):
    # qwen2: the qkv bias rides in the oneDNN copy.
    path = tiny_models["qwen2"]
    plain = single_stage(path, "float32", prefill_gemm="torch")
    dnn = single_stage(path, "float32", prefill_gemm="onednn")
    assert all(layer.prefill is None and layer.qkv is not None for layer in plain.model.w.layers)
    for layer in dnn.model.w.layers:
        assert set(layer.prefill) == {"qkv", "o_proj", "gate_up", "down"}
        assert layer.qkv is layer.o_proj is layer.gate_up is layer.down is None
        assert layer.prefill["qkv"].bias is not None
    x = torch.randn(300, plain.model.cfg.hidden_size)
    for a, b in zip(plain.model.w.layers, dnn.model.w.layers):
        want = torch.nn.functional.linear(x, a.qkv, a.qkv_bias)
        assert (b.prefill["qkv"](x) - want).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def reference(tiny_models):
    return hf_reference(tiny_models["llama"], PROMPT, 8, full_forwards=True)


PROMPT = [(13 * i + 7) % 512 for i in range(300)]


@pytest.mark.parametrize("pp", [1, 2])
def test_engine_on_onednn_equals_hf(tiny_models, reference, pp):
    with track(Engine(tiny_models["llama"], dtype="float32", page_size=16, threads_per_stage=1,
                      pp_size=pp, chunked_prefill_size=128, prefill_gemm="onednn",
                      disable_radix_cache=True)) as e:
        out = e.generate([PROMPT], max_new_tokens=8, ignore_eos=True,
                         return_prompt_logprobs=True)[0]
    ref_lp, ref_tokens = reference
    assert out.metrics["chunk_sizes"] == [128, 128, 44]
    assert out.output_ids == ref_tokens
    assert (torch.tensor(out.prompt_logprobs) - ref_lp).abs().max().item() < 1e-4


def test_experts_move_to_onednn_where_the_dense_matrices_stay_on_torch():
    assert experts_in_onednn_layout("auto", BF16, BF16, CPU) == (True, "few rows per expert")
    assert experts_in_onednn_layout("torch", BF16, BF16, CPU) == (False, "requested")
    assert not experts_in_onednn_layout("auto", F32, BF16, CPU)[0]  # --weight-dtype
    assert not experts_in_onednn_layout("auto", BF16, BF16, torch.device("cuda"))[0]


def test_a_bfloat16_moe_stage_runs_its_experts_on_onednn(tmp_path):
    """bfloat16 on auto: the dense matrices stay plain for F.linear, every routed and shared
    expert moves to oneDNN's layout, and a chunk's hidden state is the torch stage's up to
    bfloat16 rounding."""
    from test_moe_family import save_moe
    path = save_moe("qwen2_moe", tmp_path)
    plain = single_stage(path, "bfloat16", prefill_gemm="torch")
    dnn = single_stage(path, "bfloat16")
    for layer in dnn.model.w.layers:
        assert layer.prefill is None and layer.qkv is not None
        if layer.moe is not None:
            assert layer.moe.experts.linears[0].plain is None
            assert len(layer.moe.experts.linears[0].prefill) == layer.moe.experts.num_experts
            assert set(layer.moe.shared.prefill) == {"gate_up", "down"}
    x = torch.randn(200, plain.model.cfg.hidden_size).to(BF16)
    for a, b in zip(plain.model.w.layers, dnn.model.w.layers):
        if a.moe is not None:
            want, got = a.moe(x).float(), b.moe(x).float()
            assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()
