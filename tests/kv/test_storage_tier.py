"""The storage tier (L3) in the pipeline, without processes: stage 0's verification of every
stage's stored pages never raises (an unreadable, corrupt or missing file of ANY stage ends the
usable prefix there for all), and a stage's batched fetch puts exactly the stored pages into
both cache layouts."""
from __future__ import annotations

import os

import pytest
import torch

import pipefill.kv.storage_tier as storage_tier
from pipefill.kv.cache import KVCache
from pipefill.kv.pool import PageOwners
from pipefill.kv.storage import chain_page_keys, open_page_store, stage_key_suffix
from pipefill.kv.storage_tier import StorageDirector, StorageTier
from pipefill.base.plan import CacheOp, CopyKind

FP = "e" * 32
PS, H, D = 4, 2, 8
RANGES = [range(0, 3), range(3, 5)]  # two stages: 3 and 2 layers
SUFFIXES = [stage_key_suffix(FP, torch.float32, PS, r) for r in RANGES]
SHAPES = [(2, len(r), PS, H, D) for r in RANGES]


def page(seed: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def write_both_stages(root, keys) -> list:
    """Each stage's own store writes its pages, as the stage processes do."""
    for suffix, shape in zip(SUFFIXES, SHAPES):
        with open_page_store("file", storage_dir=str(root), key_suffix=suffix) as store:
            for i, k in enumerate(keys):
                store.put(k, page(i, shape))
            assert store.flush(30)


def director(store) -> StorageDirector:
    return StorageDirector(StorageTier(store, None, 0, FP), SUFFIXES, SHAPES, torch.float32,
                           "write_through", prefetch_timeout_s=30.0)


def test_unreadable_or_bad_page_of_another_stage_is_a_miss_never_an_error(tmp_path):
    keys = chain_page_keys(list(range(6 * PS)), PS)
    write_both_stages(tmp_path, keys)
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=SUFFIXES[0]) as store:
        d = director(store)
        assert d.verified_prefix(keys) == 6
        backend = store.backend
        # Stage 1's page 4 becomes a directory: opening it raises IsADirectoryError (an
        # OSError the old direct backend read let through into stage 0's scheduler).
        path4 = backend.path(store.full_key(keys[4], SUFFIXES[1]))
        os.remove(path4)
        os.mkdir(path4)
        assert d.verified_prefix(keys) == 4
        # Stage 1's page 2 corrupt (one payload bit): its checksum fails, a miss for all.
        path2 = backend.path(store.full_key(keys[2], SUFFIXES[1]))
        data = bytearray(open(path2, "rb").read())
        data[-3] ^= 0x10
        open(path2, "wb").write(bytes(data))
        assert d.verified_prefix(keys) == 2
        # Stage 1's page 1 missing: 1. Stage 0's own page 0 truncated: nothing usable.
        os.remove(backend.path(store.full_key(keys[1], SUFFIXES[1])))
        assert d.verified_prefix(keys) == 1
        path0 = backend.path(store.full_key(keys[0], SUFFIXES[0]))
        open(path0, "r+b").truncate(50)
        assert d.verified_prefix(keys) == 0
        assert store.stats()["misses"] >= 2  # the failed verification reads are counted
        # The store still works for stage 0 afterwards.
        assert d.verified_prefix(keys[:0]) == 0


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_batched_fetch_loads_exactly_the_stored_pages(tmp_path, layout, monkeypatch):
    """More pages than one batch, into scattered pool pages of either cache layout."""
    if layout == "packed":
        from pipefill.kernels.amx_attention import AmxKVCache
        cache = AmxKVCache(2, 12, 64, 2, 64, torch.float32)
        ps, shape = 64, (2, 2, 64, 2, 64)
    else:
        cache = KVCache(2, 12, PS, H, D, torch.float32)
        ps, shape = PS, (2, 2, PS, H, D)
    monkeypatch.setattr(storage_tier, "_FETCH_BATCH", 2)  # 5 pages: batches of 2, 2, 1
    keys = chain_page_keys(list(range(5 * ps)), ps)
    suffix = stage_key_suffix(FP, torch.float32, ps, range(0, 2))
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=suffix) as store:
        for i, k in enumerate(keys):
            store.put(k, page(i, shape))
        assert store.flush(30)
        tier = StorageTier(store, cache, 0, FP)
        pages = [9, 2, 7, 0, 4]
        assert tier.fetch([CacheOp(CopyKind.FETCH, p, -1, k.hex()) for p, k in zip(pages, keys)],
                          PageOwners(12)) == []
        got = cache.read_pages(pages)
        for i in range(5):
            assert torch.equal(got[:, :, i], page(i, shape))


def test_fetch_reports_pages_it_cannot_read_and_goes_on(tmp_path):
    cache = KVCache(2, 12, PS, H, D, torch.float32)
    shape = (2, 2, PS, H, D)
    keys = chain_page_keys(list(range(4 * PS)), PS)
    suffix = stage_key_suffix(FP, torch.float32, PS, range(0, 2))
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=suffix) as store:
        for i, k in enumerate(keys[:3]):  # the last page was never stored
            store.put(k, page(i, shape))
        assert store.flush(30)
        os.remove(store.backend.path(store.full_key(keys[1])))  # and the second is gone
        owners = PageOwners(12)
        ops = [CacheOp(CopyKind.FETCH, p, -1, k.hex()) for p, k in zip([5, 6, 7, 8], keys)]
        assert StorageTier(store, cache, 0, FP).fetch(ops, owners) == [6, 8]
        assert torch.equal(cache.read_pages([5, 7])[:, :, 1], page(2, shape))
        owners.free([5, 6, 7, 8])  # stage 0 frees the failed ones: no page is left dangling
