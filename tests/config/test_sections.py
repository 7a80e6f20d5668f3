"""The config sections: derived once from ServerArgs, frozen, fresh after replace(); the layer
partition is the layout's, computed when resolve() gives the model's layer count."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from pipefill.config import (DisaggMode, ServerArgs, StageInfo, flag_fields, make_server_args,
                             resolve)


def model_cfg(num_layers: int = 30):
    return SimpleNamespace(num_layers=num_layers, max_position_embeddings=4096,
                           sliding_window=None)


def test_resolve_gives_the_layout_its_partition():
    args = ServerArgs(pp_size=4, dtype="float32")
    assert args.layout.ranges == ()  # no layer count before resolve()
    args = resolve(args, model_cfg(30))
    assert args.layout.layer_counts == [7, 7, 8, 8]
    assert args.layout.stage(3) == StageInfo(3, 4, range(22, 30))
    assert args.layout.stage(0).is_first and args.layout.stage(3).is_last


def test_the_partition_is_checked_against_the_model_at_resolve():
    with pytest.raises(ValueError, match="sums to 6 but the model has 30 layers"):
        resolve(ServerArgs(pp_size=2, pp_layer_partition="3,3", dtype="float32"), model_cfg())


def test_sections_are_frozen_and_derived_once_per_args():
    args = resolve(ServerArgs(pp_size=2, dtype="float32"), model_cfg())
    assert args.layout is args.layout
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.layout.pp_size = 3
    other = args.replace(pp_size=3, pp_layer_partition="10,10,10")
    assert other.layout.layer_counts == [10, 10, 10] and args.layout.layer_counts == [15, 15]


def test_num_layers_is_no_flag():
    assert "num_layers" not in {f.name for f in flag_fields()}
    args = resolve(ServerArgs(dtype="float32"), model_cfg())
    assert "num_layers" not in args.flags() and args.flags()["dtype"] == "float32"
    with pytest.raises(ValueError, match="unknown engine argument"):
        make_server_args(None, num_layers=3)


def test_each_section_takes_its_flags():
    args = resolve(ServerArgs(page_size=16, disable_radix_cache=True, max_total_tokens=None,
                              disaggregation_mode="prefill", disaggregation_insecure=True,
                              header_read_timeout=3.0, chunked_prefill_size=128,
                              max_prefill_tokens=256, dtype="float32"), model_cfg())
    assert (args.cache.page_size, args.cache.radix) == (16, False)
    assert args.cache.capacity_tokens == 65536  # 4 x 4096 is below the floor
    assert args.chunking.chunked_prefill_size == 128 and args.chunking.max_prefill_tokens == 256
    assert args.disagg.mode is DisaggMode.PREFILL and args.disagg.enabled
    assert "--disaggregation-insecure" in args.disagg.insecure_warning
    assert args.serving.header_read_timeout == 3.0
    assert ServerArgs().disagg.insecure_warning is None


def test_secrets_stay_out_of_the_sections_repr():
    args = ServerArgs(cluster_secret="abc", api_key="key123")
    assert "abc" not in repr(args.disagg) and "key123" not in repr(args.serving)


@pytest.mark.parametrize("kwargs,match", [
    ({"page_size": 0}, "--page-size must be at least 1"),
    ({"pp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "must be a multiple of --nnodes"),
    ({"chunked_prefill_size": 4096, "max_prefill_tokens": 2048}, "--max-prefill-tokens"),
    ({"hicache_storage_backend": "file"}, "needs --hicache-storage-dir"),
    ({"max_connections": 0}, "--max-connections must be at least 1"),
    ({"decode_gemm_max_rows": -1}, "--decode-gemm-max-rows must be >= 0"),
    ({"gguf_int8_prefill_max_rows": -2}, "--gguf-int8-prefill-max-rows must be >= 0"),
])
def test_sections_check_their_flags_when_the_args_are_made(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kwargs)


@pytest.mark.parametrize("pp, tp, nnodes, expected", [
    # (stage, TP rank) per node; TP ranks share a node when --pp-size divides over the nodes.
    (2, 1, 2, [[(0, 0)], [(1, 0)]]),
    (2, 2, 2, [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]),
    (1, 2, 2, [[(0, 0)], [(0, 1)]]),
    (1, 4, 2, [[(0, 0), (0, 1)], [(0, 2), (0, 3)]]),
    (2, 2, 4, [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)]]),
])
def test_processes_are_dealt_to_nodes_in_blocks(pp, tp, nnodes, expected):
    for node, procs in enumerate(expected):
        layout = ServerArgs(pp_size=pp, tp_size=tp, nnodes=nnodes, node_rank=node,
                            dist_init_addr="h:1").layout
        assert layout.local_processes == procs
        assert list(layout.local_ranks) == [s for s, t in procs if t == 0]
        assert [layout.local_process(s, t) for s, t in procs] == list(range(len(procs)))
        assert layout.tp_spans_nodes(0) == (pp % nnodes != 0)  # as the blocks above show


def test_tp_across_nodes_needs_as_many_processes_on_each():
    with pytest.raises(ValueError, match="3 processes must be a multiple of --nnodes 2"):
        ServerArgs(tp_size=3, nnodes=2, dist_init_addr="h:1")


@pytest.mark.parametrize("pp, tp, nnodes, node, expected", [
    # {(stage, TP rank): GPU} of one node's processes under --device cuda
    (2, 1, 1, 0, {(0, 0): 0, (1, 0): 1}),
    (4, 1, 2, 1, {(2, 0): 0, (3, 0): 1}),
    (2, 2, 1, 0, {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}),
    (2, 2, 2, 1, {(1, 0): 0, (1, 1): 1}),
    (1, 4, 2, 1, {(0, 2): 0, (0, 3): 1}),
])
def test_each_cuda_process_takes_its_own_gpu(pp, tp, nnodes, node, expected):
    layout = ServerArgs(pp_size=pp, tp_size=tp, nnodes=nnodes, node_rank=node,
                        dist_init_addr="h:1", device="cuda").layout
    assert {p: layout.gpu_index(*p) for p in layout.local_processes} == expected
    if tp == 1:  # a pipeline's stages keep the GPUs they had before TP ran on CUDA
        assert all(gpu == s - layout.local_ranks.start for (s, _), gpu in expected.items())


def test_cuda_needs_a_visible_gpu_per_process_on_the_node():
    layout = ServerArgs(pp_size=2, tp_size=2, device="cuda").layout  # no longer refused
    layout.check_gpus(4)
    with pytest.raises(ValueError, match=r"--device cuda runs 4 process\(es\) on this node "
                       r"\(--pp-size 2 x --tp-size 2 over --nnodes 1\), one GPU each, but 3 "
                       r"GPU\(s\) are visible here"):
        layout.check_gpus(3)
    ServerArgs(pp_size=1, tp_size=4, nnodes=2, dist_init_addr="h:1",
               device="cuda").layout.check_gpus(2)  # two processes a node
    ServerArgs(tp_size=2).layout.check_gpus(0)  # CPU stages need none
