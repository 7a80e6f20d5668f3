"""GGUF blocks kept quantized under tensor parallelism, in one process (ARCHITECTURE.md,
'Tensor parallelism inside a stage', 'GGUF blocks kept quantized'): a rank's QuantLinear holds
its own rows of blocks (column-parallel q/k/v, gate/up, the vocabulary rows of the head) or
whole blocks of every row (row-parallel o_proj by heads, down by MLP columns), laid out for
the decode kernel per shard, and dequantizes to the rank's slice of the dequantized matrix; a
row-parallel cut inside a block stays dequantized. Ranks played by threads against one rank
with the same blocks: logits within the int8 activations' summation order."""
import pytest
import torch

from conftest import shared_layout_bytes
from test_gguf_blocks import k_quant_gguf
from test_tp_shards import ALONE, assert_lean_decode_on_two_ranks
from pipefill.config import ServerArgs, StageInfo, resolve
from pipefill.kernels import huge_pages
from pipefill.kernels.quant_gemm import QuantLinear
from pipefill.model.loader import WeightSource
from pipefill.model.tensor_parallel import ShardedSource, tp_shard
from pipefill.runtime.stage import build_stage

LINEARS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "o_proj": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
           "down": ("mlp.down_proj",)}


@pytest.fixture(scope="module")
def k_file(tmp_path_factory):
    """4 heads of 64 over 2 KV heads, MLP width 512: o_proj Q5_0 (blocks of 32), down Q5_K
    (blocks of 256), the head Q6_K."""
    return k_quant_gguf(tmp_path_factory.mktemp("tp-gguf") / "k.gguf")


@pytest.mark.parametrize("size", [2, 3])
def test_rank_blocks_are_its_slice_of_the_matrix(k_file, size):
    """At TP 3 the MLP columns are 176, 176 and 160: down's Q5_K cut falls inside a block,
    so down loads dequantized; everything else stays in blocks on every rank. The file's
    blocks are cut before the decode layout is written: a rank's shared 2 MiB-page mappings
    hold its own rows' layout and nothing else (kernels/huge_pages.py)."""
    source = WeightSource(k_file)
    for rank in range(size):
        sharded = ShardedSource(source, tp_shard(source.config, rank, size))
        for kind, parts in LINEARS.items():
            names = tuple(f"model.layers.1.{p}.weight" for p in parts)
            before = huge_pages.shared_bytes()
            held = sharded.quant_linear(names)
            if kind == "down" and size == 3:
                assert held is None
                continue
            assert huge_pages.shared_bytes() - before == shared_layout_bytes([held])
            want = torch.cat([sharded.load(n) for n in names])
            assert held.shape == tuple(want.shape)
            assert torch.equal(held.dequantize(), want), (rank, kind)
        head = sharded.quant_linear(("lm_head.weight",))
        assert torch.equal(head.dequantize(), sharded.load("lm_head.weight"))


def test_two_ranks_of_blocks_match_one_rank(k_file):
    """Every linear layer and the head in blocks on both ranks and on the one: a prefill and
    decode steps (the integer path where the CPU has it) agree within 1e-4. The 40-row prefill
    dequantizes (--gguf-int8-prefill-max-rows 0): rounding 40 rows of activations to int8, a
    code that the ranks' float32 summation order moves across a rounding boundary moves the
    logits by more than that."""
    source = WeightSource(k_file)
    args = resolve(ServerArgs(model_path=k_file, dtype="float32", page_size=32,
                              max_total_tokens=512, threads_per_stage=1, weight_dtype="gguf",
                              gguf_int8_prefill_max_rows=0),
                   source.config)
    layers = range(source.config.num_layers)
    for rank in range(2):
        ex = build_stage(args.replace(tp_size=2), source, StageInfo(0, 1, layers, rank, 2),
                         comm=ALONE)
        assert ex.model.w.kept_dequantized == []
        assert all(isinstance(q, QuantLinear) for q in ex.model.w.layers[0].packed.values())
    assert_lean_decode_on_two_ranks(args, source, lean=False)
