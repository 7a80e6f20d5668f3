"""A long chunk's MLP in row tiles (model/layers.by_row_tiles): the same rows as one call,
with tile boundaries that are not multiples of anything the kernels block by."""
import pytest
import torch

from conftest import single_stage
from pipefill.model import layers
from pipefill.model.families.llama import LlamaFamily
from pipefill.model.layers import by_row_tiles, row_tiles
from pipefill.model.loader import resolve_model_path


def test_row_tiles_cover_the_rows_evenly():
    assert row_tiles(10, 20) == [(0, 10)]
    assert row_tiles(8192, 2048) == [(0, 2048), (2048, 4096), (4096, 6144), (6144, 8192)]
    tiles = row_tiles(8193, 2048)  # 5 tiles of 1,638 or 1,639 rows, none of 1 row
    assert tiles[0] == (0, 1638) and tiles[-1][1] == 8193 and len(tiles) == 5
    assert {b - a for a, b in tiles} == {1638, 1639}
    assert all(b - a >= 1024 for a, b in tiles)
    assert all(a == b_prev for (_, b_prev), (a, _) in zip(tiles, tiles[1:]))


def test_by_row_tiles_calls_fn_per_tile_into_one_output():
    seen = []

    def fn(x):
        seen.append(x.shape[0])
        return x * 2
    x = torch.arange(21.0).reshape(7, 3)
    assert torch.equal(by_row_tiles(fn, x, tile=3), x * 2) and seen == [2, 2, 3]
    seen.clear()
    assert torch.equal(by_row_tiles(fn, x, tile=7), x * 2) and seen == [7]


@pytest.mark.parametrize("dtype,weight_dtype,rows,tile", [
    ("bfloat16", "gguf", 3001, 1100),  # tiles of 1,001/1,000 rows: the dequantized GEMM
    ("float32", "gguf", 777, 200),  # float32: the integer path at any row count
    ("bfloat16", "bfloat16", 1234, 500),  # dense weights on oneDNN
])
def test_tiled_mlp_equals_one_call(monkeypatch, dtype, weight_dtype, rows, tile):
    stage = single_stage(resolve_model_path(None), dtype, weight_dtype=weight_dtype)
    model, w = stage.model, stage.model.w.layers[3]
    x = torch.randn(rows, model.cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
    x = x.to(model.dtype)
    with torch.inference_mode():
        monkeypatch.setattr(layers, "MLP_TILE_ROWS", 1 << 30)
        whole = LlamaFamily.mlp(model, w, x)
        monkeypatch.setattr(layers, "MLP_TILE_ROWS", tile)
        tiled = LlamaFamily.mlp(model, w, x)
    assert tiled.shape == whole.shape == (rows, model.cfg.hidden_size)
    assert torch.equal(tiled, whole)
