"""L3 storage tier (pipefill.kv.storage): chained page keys, model fingerprints, the `file`
backend (round trip, restart, corrupt / truncated / foreign / wrong-shape pages are misses,
unwritable and full directories warn once and go on), and the `mooncake` backend against a real
mooncake_master with a second client in another process."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import save_tiny_model
from pipefill.kv.storage import (chain_page_keys, model_fingerprint, open_page_store,
                                 stage_key_suffix)

SUFFIX = stage_key_suffix("f" * 32, "float32", 4, range(0, 3))
SHAPE = (2, 3, 4, 2, 8)   # [K/V, layers, page_size, kv heads, head_dim]


def page(seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "pipefill.storage" and r.levelno == logging.WARNING]


# ---- keys ------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 2**31 - 1), max_size=70), page_size=st.integers(1, 9),
       cut=st.integers(0, 70))
def test_chain_keys_prefix_stable_and_resumable(ids, page_size, cut):
    keys = chain_page_keys(ids, page_size)
    cut = min(cut, len(ids))
    assert len(keys) == len(ids) // page_size          # the partial last page has no key
    assert all(len(k) == 32 for k in keys)
    # A prefix's keys are the first keys of the whole: a shorter request hits a longer one.
    assert chain_page_keys(ids[:cut], page_size) == keys[:cut // page_size]
    # Hashing resumes from a parent key.
    start = (cut // page_size) * page_size
    parent = keys[start // page_size - 1] if start else b""
    assert chain_page_keys(ids[start:], page_size, parent) == keys[start // page_size:]


def test_chain_keys_depend_on_every_earlier_token():
    ids = list(range(100, 132))
    keys = chain_page_keys(ids, 8)
    changed = ids.copy()
    changed[13] += 1                                    # a token of page 1
    other = chain_page_keys(changed, 8)
    assert other[0] == keys[0] and all(a != b for a, b in zip(other[1:], keys[1:]))
    # Same ids as a list, a tensor or a numpy array: same keys.
    assert chain_page_keys(torch.tensor(ids), 8) == keys
    assert chain_page_keys(np.array(ids, dtype=np.int32), 8) == keys
    # Same tokens, different page size: no key in common.
    assert not set(chain_page_keys(ids, 16)) & set(keys)
    with pytest.raises(ValueError):
        chain_page_keys([-1, 2], 1)
    with pytest.raises(ValueError):
        chain_page_keys([1, 2], 0)


def test_stage_key_suffix_never_collides():
    variants = [("a" * 32, "float32", 64, range(0, 15)), ("b" * 32, "float32", 64, range(0, 15)),
                ("a" * 32, "bfloat16", 64, range(0, 15)), ("a" * 32, "float32", 32, range(0, 15)),
                ("a" * 32, "float32", 64, range(15, 30)), ("a" * 32, "float32", 64, range(0, 16)),
                ("a" * 32, torch.float16, 64, range(0, 15))]
    suffixes = {stage_key_suffix(*v) for v in variants}
    assert len(suffixes) == len(variants)
    assert stage_key_suffix("a" * 32, torch.bfloat16, 64, range(0, 15)) == \
        stage_key_suffix("a" * 32, "bfloat16", 64, range(0, 15))
    with pytest.raises(ValueError):
        stage_key_suffix("a" * 32, "complex64", 64, range(0, 15))
    with pytest.raises(ValueError):
        stage_key_suffix("a" * 32, "float32", 64, range(3, 3))


def test_model_fingerprint(tmp_path):
    a = save_tiny_model("llama", tmp_path / "a", seed=0)
    b = save_tiny_model("llama", tmp_path / "b", seed=1)
    copy = shutil.copytree(a, tmp_path / "copy")
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_fingerprint(a) == model_fingerprint(str(copy))     # content, not path or mtime
    # A large file is sampled (about 3 MiB read): header changes and sampled blocks count.
    big = tmp_path / "big.gguf"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 40 << 20, dtype=np.uint8))
    big.write_bytes(data)
    f0 = model_fingerprint(str(big))
    data[100] ^= 1
    big.write_bytes(data)
    assert model_fingerprint(str(big)) != f0
    with pytest.raises(ValueError):
        model_fingerprint(str(tmp_path / "empty_dir_that_is_missing"))


# ---- file backend ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_file_round_trip_and_restart(tmp_path, dtype):
    suffix = stage_key_suffix("f" * 32, dtype, 4, range(0, 3))
    keys = chain_page_keys(list(range(40)), 4)
    pages = [page(i, dtype) for i in range(len(keys))]
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=suffix) as store:
        for k, p in zip(keys[:6], pages):
            store.put(k, p)
        # Readable at once, whether still queued or already written.
        out = torch.empty(SHAPE, dtype=dtype)
        assert store.contains(keys) == 6
        assert store.get(keys[3], out) and torch.equal(out, pages[3])
        assert store.flush(30)
        stats = store.stats()
        assert stats["pages_written"] == 6 and stats["errors"] == 0
        assert stats["bytes_written"] == 6 * pages[0].nbytes
    # A new store on the same directory (a restarted server) hits what the old one wrote.
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=suffix) as store:
        assert store.contains(keys) == 6
        assert store.contains(keys[:3]) == 3
        for k, p in zip(keys[:6], pages):
            out = torch.full(SHAPE, float("nan")).to(dtype)
            assert store.get(k, out) and torch.equal(out, p)
        assert not store.get(keys[7], out)
        assert store.stats()["hits"] == 6 and store.stats()["misses"] == 1
        assert store.stats()["stored_pages"] == 6
        # Another stage, model or dtype (another suffix) never sees these pages.
    other = stage_key_suffix("f" * 32, dtype, 4, range(3, 6))
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=other) as store:
        assert store.contains(keys) == 0


def test_stage0_reads_another_stages_pages(tmp_path):
    """Stage 0 verifies that every stage can load a prefix before planning the fetch."""
    keys = chain_page_keys(list(range(12)), 4)
    s1 = stage_key_suffix("f" * 32, "float32", 4, range(3, 6))
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=SUFFIX) as stage0, \
            open_page_store("file", storage_dir=str(tmp_path), key_suffix=s1) as stage1:
        stage1.put(keys[0], page(5))
        stage1.put(keys[1], page(6))
        assert stage1.flush(30)
        out = torch.empty(SHAPE)
        assert stage0.contains(keys) == 0 and not stage0.get(keys[0], out)
        assert stage0.contains(keys, key_suffix=s1) == 2
        assert stage0.get(keys[1], out, key_suffix=s1) and torch.equal(out, page(6))


def test_get_into_a_strided_pool_view(tmp_path):
    """Stages read straight into their pool: `out` may be a non-contiguous view."""
    keys = chain_page_keys(list(range(8)), 4)
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=SUFFIX) as store:
        store.put(keys[0], page(0))
        store.flush(30)
        pool = torch.zeros(2, 3, 12, 2, 8)              # three pages side by side per layer
        view = pool[:, :, 4:8]                           # page 1, not contiguous
        assert not view.is_contiguous()
        assert store.get(keys[0], view)
        assert torch.equal(pool[:, :, 4:8], page(0)) and pool[:, :, :4].abs().sum() == 0


def _stored_file(store, key) -> str:
    return store.backend.path(store.full_key(key))


def test_corrupt_truncated_foreign_and_wrong_shape_are_misses(tmp_path, caplog):
    keys = chain_page_keys(list(range(24)), 4)
    pages = [page(i) for i in range(len(keys))]
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=SUFFIX) as store:
        for k, p in zip(keys, pages):
            store.put(k, p)
        store.flush(30)
        out = torch.empty(SHAPE)
        corrupt, truncated, foreign, garbage = (_stored_file(store, k) for k in keys[:4])
        with open(corrupt, "r+b") as f:                  # one flipped bit in the payload
            f.seek(-100, os.SEEK_END)
            b = f.read(1)
            f.seek(-100, os.SEEK_END)
            f.write(bytes([b[0] ^ 1]))
        with open(truncated, "r+b") as f:
            f.truncate(os.path.getsize(truncated) - 7)
        shutil.copyfile(_stored_file(store, keys[5]), foreign)   # intact, but another key's
        with open(garbage, "wb") as f:
            f.write(b"not a page at all")
        for k in keys[:4]:
            assert not store.get(k, out)
        assert store.stats()["misses"] == 4
        # Bad files are removed, so contains() stops before them and a put writes them again.
        assert store.contains(keys) == 0
        store.put(keys[0], pages[0])
        store.flush(30)
        assert store.get(keys[0], out) and torch.equal(out, pages[0])
        # A page whose header says another shape or dtype than the reader's is foreign too.
        assert store.get(keys[4], out) and torch.equal(out, pages[4])
        assert not store.get(keys[4], torch.empty(2, 3, 4, 2, 4))
        assert not store.get(keys[5], torch.empty(SHAPE, dtype=torch.bfloat16))
    assert warnings_of(caplog) == []      # bad data is a miss, not an error to warn about


def test_unwritable_directory_warns_once_and_goes_on(tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    keys = chain_page_keys(list(range(40)), 4)
    with open_page_store("file", storage_dir=str(blocker / "store"), key_suffix=SUFFIX) as s:
        for k in keys:
            s.put(k, page(0))
        assert s.flush(30)
        out = torch.empty(SHAPE)
        assert s.contains(keys) == 0 and not s.get(keys[0], out)
        assert s.stats()["pages_written"] == 0 and s.stats()["write_errors"] >= len(keys)
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and "--hicache-storage-dir" in msgs[0], msgs


FULL_DISK = textwrap.dedent("""
    import json, logging, os, resource, signal, sys, torch
    from pipefill.kv.storage import chain_page_keys, open_page_store
    warnings = []
    class Count(logging.Handler):
        def emit(self, record):
            if record.levelno == logging.WARNING:
                warnings.append(record.getMessage())
    logging.getLogger("pipefill.storage").addHandler(Count())
    # Files may not grow past 1 KiB: every page write fails with EFBIG, like a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    keys = chain_page_keys(list(range(40)), 4)
    store = open_page_store("file", storage_dir=sys.argv[1], key_suffix=sys.argv[2])
    for k in keys:
        store.put(k, torch.ones(2, 3, 4, 2, 8))
    store.flush(30)
    hit = store.get(keys[0], torch.empty(2, 3, 4, 2, 8))
    stats = store.stats()
    store.close()
    print(json.dumps({"warnings": warnings, "hit": hit, "stats": stats}))
""")


def test_full_disk_warns_once_leaves_no_partial_files(tmp_path):
    r = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path), SUFFIX],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["warnings"]) == 1 and "File too large" in out["warnings"][0], out
    assert not out["hit"] and out["stats"]["pages_written"] == 0, out
    left = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert left == [], left                             # no temp or partial page files


def test_put_never_blocks_or_raises(tmp_path, caplog):
    keys = chain_page_keys(list(range(8)), 4)
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=SUFFIX,
                         max_pending_bytes=100) as store:        # less than one page
        store.put(keys[0], page(0))
        store.put(keys[1], "not a tensor")                         # a caller bug: counted
        assert store.flush(30)
        assert store.stats()["puts_dropped"] == 1 and store.stats()["errors"] == 1
        assert store.contains(keys) == 0
    assert len(warnings_of(caplog)) == 1


def test_open_page_store_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="--hicache-storage-backend"):
        open_page_store("nfs", storage_dir=str(tmp_path), key_suffix=SUFFIX)
    with pytest.raises(ValueError, match="--hicache-storage-dir"):
        open_page_store("file", key_suffix=SUFFIX)
    with pytest.raises(ValueError, match="master"):
        open_page_store("mooncake", key_suffix=SUFFIX)
    with pytest.raises(ValueError, match="host:port"):
        open_page_store("mooncake", mooncake_master="localhost", key_suffix=SUFFIX)
    with pytest.raises(ValueError, match="key_suffix"):
        open_page_store("file", storage_dir=str(tmp_path), key_suffix="")


# ---- mooncake backend ------------------------------------------------------------------------

def _start_master():
    from pipefill.base.platform import free_port
    binary = shutil.which("mooncake_master", path=os.path.dirname(sys.executable))
    if binary is None:
        pytest.skip("mooncake_master is not installed (pip install 'pipefill[mooncake]')")
    port = free_port()
    proc = subprocess.Popen([binary, f"--rpc_port={port}", f"--metrics_port={free_port()}",
                             "--enable_metric_reporting=false",
                             "--enable_http_metadata_server=false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    import socket
    while time.monotonic() < deadline:
        assert proc.poll() is None, "mooncake_master exited at start"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("mooncake_master did not listen")


@pytest.fixture
def mooncake_master():
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda missing")
    proc, addr = _start_master()
    yield proc, addr
    proc.kill()
    proc.wait()


SECOND_CLIENT = textwrap.dedent("""
    import json, sys, torch
    from pipefill.kv.storage import chain_page_keys, open_page_store
    keys = chain_page_keys(list(range(40)), 4)
    store = open_page_store("mooncake", mooncake_master=sys.argv[1], key_suffix=sys.argv[2],
                            mooncake_segment_bytes=0)    # borrows the first client's memory
    found = store.contains(keys)
    pages = []
    for k in keys[:found]:
        out = torch.empty(2, 3, 4, 2, 8)
        pages.append(out.tolist() if store.get(k, out) else None)
    torch.manual_seed(7)
    store.put(keys[9], torch.randn(2, 3, 4, 2, 8))       # for the first client to read
    store.flush(30)
    store.close()
    print(json.dumps({"found": found, "pages": pages}))
""")


def test_mooncake_two_processes_share_pages(mooncake_master):
    _, addr = mooncake_master
    keys = chain_page_keys(list(range(40)), 4)
    pages = [page(i) for i in range(5)]
    with open_page_store("mooncake", mooncake_master=addr, key_suffix=SUFFIX,
                         mooncake_segment_bytes=32 << 20) as store:
        for k, p in zip(keys, pages):
            store.put(k, p)
        assert store.flush(30) and store.stats()["pages_written"] == 5
        r = subprocess.run([sys.executable, "-c", SECOND_CLIENT, addr, SUFFIX],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        second = json.loads(r.stdout.strip().splitlines()[-1])
        assert second["found"] == 5
        for got, want in zip(second["pages"], pages):
            assert got is not None and torch.equal(torch.tensor(got), want)
        torch.manual_seed(7)
        out = torch.empty(SHAPE)
        assert store.get(keys[9], out) and torch.equal(out, torch.randn(SHAPE))
        # A foreign object under our key (wrong shape) is a miss, not a wrong answer.
        store.put(keys[8], torch.zeros(2, 3, 4, 2, 4))
        store.flush(30)
        assert store.contains(keys[8:9]) == 1 and not store.get(keys[8], out)
        assert store.stats()["errors"] == 0


def test_mooncake_master_unreachable_is_a_sentence():
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda missing")
    from pipefill.base.platform import free_port
    addr = f"127.0.0.1:{free_port()}"                      # nothing listens there
    result = {}

    def attempt():
        try:
            open_page_store("mooncake", mooncake_master=addr, key_suffix=SUFFIX,
                            mooncake_connect_timeout_s=2)
        except RuntimeError as e:
            result["error"] = str(e)
    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(60)                                             # a hang guard, not a speed bar
    assert not t.is_alive(), "open_page_store hung on an unreachable master"
    assert addr in result["error"] and "mooncake_master" in result["error"]


def test_mooncake_master_lost_later_gives_misses(mooncake_master, caplog):
    proc, addr = mooncake_master
    keys = chain_page_keys(list(range(16)), 4)
    store = open_page_store("mooncake", mooncake_master=addr, key_suffix=SUFFIX)
    store.put(keys[0], page(0))
    assert store.flush(30) and store.contains(keys) == 1
    proc.kill()
    proc.wait()
    out = torch.empty(SHAPE)
    assert store.contains(keys) == 0
    assert not store.get(keys[0], out)
    store.put(keys[1], page(1))                            # dropped, never raised
    assert store.flush(30)
    store.close()
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and addr in msgs[0], msgs
