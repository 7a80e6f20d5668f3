"""The file storage tier against a shared or hostile directory: the size cap holds when several
processes write one folder (least recently read pages go first), links planted where we write
are never followed, and a page that goes bad between stage 0's verification and a stage's
fetch is a miss (the tokens are recomputed), never a crash or a different answer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zlib

import torch

from pipefill.kv.storage import chain_page_keys, open_page_store
from pipefill.kv.storage_file import LOCK_NAME, FileBackend
from pipefill.kv.storage_format import byte_view, encode_header

SUFFIX = "f" * 32 + ".float32.p4.l0-3"
SHAPE = (2, 3, 4, 2, 8)  # 768 bytes of payload per page


def page_files(root) -> list:
    return [p for p in root.rglob("*") if p.is_file() and p.name != LOCK_NAME]


def stored_bytes(root) -> int:
    return sum(p.stat().st_size for p in page_files(root))


def write_page(backend: FileBackend, key: str, value: float) -> bool:
    page = torch.full(SHAPE, value)
    payload = byte_view(page)
    return backend.write(key, encode_header(key, page, zlib.crc32(payload)), payload)


def page_size_on_disk(tmp_path) -> int:
    probe = FileBackend(str(tmp_path / "probe"))
    assert write_page(probe, "probe", 0.0)
    return stored_bytes(tmp_path / "probe")


WRITER = textwrap.dedent("""
    import json, sys, torch
    from pipefill.kv.storage import chain_page_keys, open_page_store
    root, first, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = open_page_store("file", storage_dir=root, key_suffix=sys.argv[4],
                            storage_max_bytes=cap)
    keys = chain_page_keys(list(range(first, first + 4 * 60)), 4)  # 60 pages of its own
    for i, k in enumerate(keys):
        store.put(k, torch.full((2, 3, 4, 2, 8), float(i)))
    store.flush(60)
    print(json.dumps(store.stats()))
    store.close()
""")


def test_cap_holds_for_two_processes_writing_one_folder(tmp_path):
    one = page_size_on_disk(tmp_path)
    root = tmp_path / "store"
    cap = 25 * one + one // 2  # room for 25 pages
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(first), str(cap),
                               SUFFIX], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for first in (0, 100000)]
    stats = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        stats.append(json.loads(out.strip().splitlines()[-1]))
    total = stored_bytes(root)
    assert total <= cap, f"{total} bytes stored under a cap of {cap}"
    assert total >= cap * 0.5, f"eviction removed far too much: {total} of {cap} bytes left"
    assert sum(s["evicted_pages"] for s in stats) >= 120 - 25
    assert sum(s["pages_written"] for s in stats) == 120  # every page was written once
    assert not [p for p in page_files(root) if ".tmp." in p.name]
    assert stats[-1]["usage_bytes"] <= cap


def test_least_recently_read_pages_are_evicted_first(tmp_path):
    one = page_size_on_disk(tmp_path)
    backend = FileBackend(str(tmp_path / "store"), max_bytes=10 * one)
    keys = [f"k{i}" for i in range(14)]
    for i, key in enumerate(keys[:10]):
        assert write_page(backend, key, float(i))
    out = torch.empty(SHAPE)
    assert backend.read_into(keys[0], out) and backend.read_into(keys[1], out)
    for i, key in enumerate(keys[10:]):
        assert write_page(backend, key, float(10 + i))
    kept = {k for k in keys if os.path.isfile(backend.path(k))}
    assert {keys[0], keys[1]} <= kept, "pages just read were evicted"
    assert keys[2] not in kept, "the oldest unread page was kept"
    assert stored_bytes(tmp_path / "store") <= 10 * one


def test_a_page_larger_than_the_cap_is_not_written(tmp_path):
    one = page_size_on_disk(tmp_path)
    backend = FileBackend(str(tmp_path / "store"), max_bytes=one - 1)
    assert not write_page(backend, "probe", 1.0)  # the probe's size exactly
    assert page_files(tmp_path / "store") == []


def test_planted_link_at_the_temporary_path_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    backend = FileBackend(str(tmp_path / "store"))
    key = "k0"
    os.makedirs(os.path.dirname(backend.path(key)))
    os.symlink(victim, backend.temp_path(key))
    assert write_page(backend, key, 3.0)
    assert victim.read_bytes() == b"precious"
    assert os.path.islink(backend.temp_path(key))  # left alone, not replaced
    out = torch.empty(SHAPE)
    assert backend.read_into(key, out) and torch.equal(out, torch.full(SHAPE, 3.0))
    written = os.stat(backend.path(key))
    assert written.st_mode & 0o777 == 0o600


def test_planted_link_as_the_fan_out_folder_is_not_followed(tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    backend = FileBackend(str(tmp_path / "store"))
    key = "k0"
    os.symlink(elsewhere, os.path.dirname(backend.path(key)))
    with caplog.at_level("WARNING", logger="pipefill.storage"):
        assert not write_page(backend, key, 1.0)
    assert list(elsewhere.iterdir()) == []
    assert "cannot write L3 pages" in caplog.text


def test_planted_link_at_a_page_path_is_a_miss(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 4096)
    backend = FileBackend(str(tmp_path / "store"))
    key = "k0"
    os.makedirs(os.path.dirname(backend.path(key)))
    os.symlink(secret, backend.path(key))
    assert not backend.read_into(key, torch.empty(SHAPE))
    assert secret.read_bytes() == b"x" * 4096


def test_store_with_a_cap_round_trips(tmp_path):
    keys = chain_page_keys(list(range(4 * 6)), 4)
    with open_page_store("file", storage_dir=str(tmp_path), key_suffix=SUFFIX,
                         storage_max_bytes=1 << 20) as store:
        for i, k in enumerate(keys):
            store.put(k, torch.full(SHAPE, float(i)))
        assert store.flush(30)
        out = torch.empty(SHAPE)
        assert all(store.get(k, out) and out[0, 0, 0, 0, 0] == i for i, k in enumerate(keys))
        assert store.stats()["usage_bytes"] == stored_bytes(tmp_path)
