"""KV tensors in /dev/shm files (kv/shared.py): another mapping of a file sees every write both
ways, in the engine's cache classes; the names go on unlink while the mappings stay; a pool
larger than /dev/shm's free room is refused with a sentence before any file is made."""
import os

import pytest
import torch

from pipefill.kv.cache import KVCache
from pipefill.kv.shared import SHM_DIR, SharedEmpty, map_shared


def test_a_mapped_cache_shares_every_write_and_outlives_its_names():
    empty = SharedEmpty("test")
    cache = KVCache(2, 4, 16, 3, 8, torch.float32, empty=empty)
    assert [f[1] for f in empty.files] == [[2, 64, 3, 8]] * 2
    k, v = (map_shared(*f) for f in empty.files)
    empty.unlink()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(empty.prefix)]
    cache.k[1, 5, 2] = 7.0
    v[0, 63, 0, 7] = -2.0
    assert k[1, 5, 2, 3].item() == 7.0 and cache.v[0, 63, 0, 7].item() == -2.0
    assert k.data_ptr() != cache.k.data_ptr()  # two mappings of one file


@pytest.mark.parametrize("windowed", [[True, False, True], [False, False]],
                         ids=["window-layers", "none-here"])
def test_a_windowed_cache_keeps_both_pools_in_files(windowed):
    """A TP rank of a PD stage over a model with window layers ('Window pages'): the window
    layers' K and V follow the others' in the files, the order the leader maps them in; a
    stage with no window layers has empty window tensors, mapped without a file."""
    from pipefill.kv.cache import WindowedKVCache
    empty = SharedEmpty("windowed")
    cache = WindowedKVCache(windowed, 4, 16, 1, 8, torch.float32, empty=empty)
    tensors = [map_shared(*f) for f in empty.files]
    empty.unlink()
    mine = [cache.k, cache.v, cache.window.k, cache.window.v]
    assert [list(t.shape) for t in tensors] == [list(t.shape) for t in mine]
    if sum(windowed):
        cache.window.v[1, 63, 0, 3] = 5.0  # the last page's last row, as any other
        assert tensors[3][1, 63, 0, 3].item() == 5.0
    else:
        assert tensors[2].numel() == 0 == tensors[3].numel()


def test_a_pool_larger_than_dev_shm_is_refused_with_a_sentence():
    empty = SharedEmpty("too-big")
    with pytest.raises(ValueError, match="lower --max-total-tokens or give /dev/shm more room"):
        empty((1 << 50,), torch.uint8)
    assert empty.files == []
    with pytest.raises(RuntimeError, match="is gone"):
        map_shared(os.path.join(SHM_DIR, empty.prefix + "-0"), [4], "float32")
