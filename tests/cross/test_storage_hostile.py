"""The file storage tier against a shared or hostile directory: the size cap holds when several
processes write one folder (least recently read pages go first), links planted where we write
are never followed, and a page that goes bad between stage 0's verification and a stage's
fetch is a miss (the tokens are recomputed), never a crash or a different answer."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import zlib

import pytest
import torch
from conftest import save_tiny_model
from test_loop_inmemory import MemoryChannel, MemoryPipe

from pipefill.config import ServerArgs, resolve
from pipefill.kv.pool import PagePool
from pipefill.kv.storage import chain_page_keys, open_page_store, stage_key_suffix
from pipefill.kv.storage_file import LOCK_NAME, FileBackend
from pipefill.kv.storage_format import byte_view, encode_header
from pipefill.kv.storage_tier import StorageDirector, StorageTier
from pipefill.model.loader import WeightSource
from pipefill.chunking.policy import ChunkPolicy
from pipefill.runtime.loop import run_later_stage
from pipefill.runtime.stage import build_stage
from pipefill.runtime.trace import StageTracer
from pipefill.runtime.worker import make_first_stage_loop
from pipefill.base.plan import CopyKind, NewRequest, SamplingParams, StepResult
from pipefill.kv.radix import RadixCache
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig

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


# ---- a page that goes bad between stage 0's verification and a stage's fetch ----------------
#
# The stages run in this process (real stage code, real file stores, the loops joined by the
# in-memory pipe of test_loop_inmemory), so that the page can be damaged at exactly that moment:
# right after stage 0 verified it, before the plan that fetches it reaches the stages.

PROMPT = [(7 * i + 3) % 512 for i in range(100)]  # 6 whole pages of 16 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama_l3"), num_hidden_layers=3)


class InProcessPipeline:
    """Every stage of a pipeline in this process, each with its own file page store."""

    def __init__(self, model: str, storage_dir, pp_size: int = 2):
        source = WeightSource(model)
        self.args = resolve(ServerArgs(
            model_path=model, dtype="float32", page_size=16, max_total_tokens=1024,
            threads_per_stage=1, pp_size=pp_size, chunked_prefill_size=32,
            hicache_storage_backend="file", hicache_storage_dir=str(storage_dir)),
            source.config)
        cfg = source.config
        infos = [self.args.layout.stage(rank) for rank in range(pp_size)]
        self.executors = []
        for info in infos:
            self.executors.append(build_stage(self.args, source, info))
        links = [queue.Queue() for _ in range(pp_size)]
        results = queue.Queue()
        pipes = [MemoryPipe(r, pp_size, links, results) for r in range(pp_size)]
        self.channel = MemoryChannel()
        policy = ChunkPolicy(32, info={"mode": "fixed", "c0": 32})
        self.loop = make_first_stage_loop(self.args, cfg, self.executors[0], self.channel,
                                          pipes[0] if pp_size > 1 else None,
                                          StageTracer(0, False), policy)
        self.threads = [threading.Thread(target=self.loop.run, daemon=True)]
        self.threads += [threading.Thread(target=run_later_stage,
                                          args=(self.executors[r], pipes[r], self.channel),
                                          daemon=True) for r in range(1, pp_size)]
        for t in self.threads:
            t.start()

    @property
    def director(self):
        return self.loop.scheduler.kv.storage

    def generate(self, rid: str, prompt: list[int]) -> list[int]:
        self.channel.inbox.put(("add", [NewRequest(rid, prompt, SamplingParams(
            max_new_tokens=6, ignore_eos=True))]))
        tokens = []
        while True:
            kind, payload = self.channel.reports.get(timeout=60)
            assert kind not in ("fatal", "rejected"), payload
            for out in payload if kind == "outputs" else []:
                assert out.error is None, out.error
                tokens += out.new_token_ids
                if out.finished:
                    return tokens

    def check_pages_agree(self) -> None:
        """Every stage's replayed page map holds exactly stage 0's pages in use."""
        self.channel.inbox.put(("stats", None))  # carries the last frees to every stage
        answered = 0
        while answered < len(self.executors):  # load reports may come in between
            kind, payload = self.channel.reports.get(timeout=30)
            assert kind != "fatal", payload
            answered += kind == "stage_stats"
        pool = self.loop.scheduler.pool
        assert all(e.kv.owners.num_used == pool.num_used for e in self.executors)

    def close(self) -> None:
        self.channel.inbox.put(("stop", None))
        for t in self.threads:
            t.join(30)
            assert not t.is_alive(), "a stage did not stop"


def damage_after_verification(director, key_index: int, suffix_rank: int, how: str) -> None:
    """Wraps stage 0's verification: once it has verified the prompt's pages, one stage's
    copy of page `key_index` is deleted or corrupted on disk, before any stage fetches it."""
    verify = director.verified_prefix

    def verify_then_damage(keys, deadline=None):
        n = verify(keys, deadline)
        if n > key_index:
            store = director.tier.store
            path = store.backend.path(store.full_key(keys[key_index],
                                                     director.suffixes[suffix_rank]))
            if how == "delete":
                os.remove(path)
            else:
                data = bytearray(open(path, "rb").read())
                data[-7] ^= 0x40
                open(path, "wb").write(bytes(data))
        return n
    director.verified_prefix = verify_then_damage


@pytest.mark.parametrize("pp,rank,how", [(2, 1, "delete"), (2, 0, "corrupt"),
                                         (1, 0, "delete")])
def test_page_gone_after_verification_is_recomputed_on_every_stage(model, tmp_path, pp, rank,
                                                                   how):
    first = InProcessPipeline(model, tmp_path, pp)  # cold: computes and writes every page
    try:
        ref = first.generate("cold", PROMPT)
    finally:
        first.close()
    second = InProcessPipeline(model, tmp_path, pp)
    try:
        damage_after_verification(second.director, 3, rank, how)
        assert second.generate("warm", PROMPT) == ref
        stats = second.loop.scheduler.kv.stats()
        # Pages 0-2 came from storage; 3 failed on one stage, so 3.. were recomputed.
        assert stats["cache_hit_tokens_storage"] == 3 * 16, stats
        assert stats["storage_fetched_pages"] == 6
        # The stages are alive and agree: the same prompt again is served from pool pages.
        assert second.generate("again", PROMPT) == ref
        second.check_pages_agree()
    finally:
        second.close()


def storage_scheduler(root):
    """Stage 0's scheduler over a one-stage file store holding the first 4 pages of PROMPT."""
    suffix = stage_key_suffix("e" * 32, torch.float32, 16, range(0, 1))
    shape = (2, 1, 16, 1, 4)
    store = open_page_store("file", storage_dir=str(root), key_suffix=suffix)
    for i, key in enumerate(chain_page_keys(PROMPT[:64], 16)):
        store.put(key, torch.full(shape, float(i)))
    assert store.flush(30)
    director = StorageDirector(StorageTier(store, None, 0, "e" * 32), [suffix], [shape],
                               torch.float32, "write_through", 30.0)
    pool = PagePool(32)
    scheduler = Scheduler(SchedulerConfig(16, 64, 4, 512), pool, ChunkPolicy(32),
                          cache=RadixCache(16, pool, storage=director))
    return scheduler, store


def test_fetch_plan_goes_first_and_the_request_waits_for_its_result(tmp_path):
    scheduler, store = storage_scheduler(tmp_path)
    with store:
        scheduler.add(NewRequest("r", PROMPT, SamplingParams(max_new_tokens=2)))
        fetch = scheduler.schedule()
        assert fetch.seqs == []
        assert [op.kind for op in fetch.page_ops.cache_ops] == [CopyKind.FETCH] * 4
        assert scheduler.schedule() is None  # nothing runs before the stages have answered
        pages = [op.page for op in fetch.page_ops.cache_ops]
        # One stage could not read the third page: it and the fourth are not used.
        scheduler.update(fetch, StepResult(fetch.step_id, failed_fetches=[pages[2]]))
        plan = scheduler.schedule()
        assert [(w.rid, w.start) for w in plan.seqs] == [("r", 32)]
        assert plan.seqs[0].page_table[:2] == pages[:2]
        assert set(pages[2:]) <= set(plan.page_ops.freed)
        assert scheduler.kv.stats()["cache_hit_tokens_storage"] == 32


def test_abort_while_fetching_frees_the_pages(tmp_path):
    scheduler, store = storage_scheduler(tmp_path)
    with store:
        scheduler.add(NewRequest("r", PROMPT, SamplingParams(max_new_tokens=2)))
        fetch = scheduler.schedule()
        assert scheduler.abort("r").finish_reason == "abort"
        scheduler.update(fetch, StepResult(fetch.step_id))  # comes back after the abort
        freed = scheduler.kv.drain_ops().freed
        assert sorted(freed) == sorted(op.page for op in fetch.page_ops.cache_ops)
        assert scheduler.pool.num_free == 32 and scheduler.kv.cache.num_pages == 0


def test_storage_cap_flag_needs_the_file_backend(tmp_path):
    with pytest.raises(ValueError, match="must be positive"):
        ServerArgs(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                   hicache_storage_max_gb=0)
    with pytest.raises(ValueError, match="needs --hicache-storage-backend file"):
        ServerArgs(hicache_storage_backend="mooncake", hicache_mooncake_master="h:1",
                   hicache_storage_max_gb=1)
    with pytest.raises(ValueError, match="needs --hicache-storage-backend file"):
        ServerArgs(hicache_storage_max_gb=1)
    ServerArgs(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
               hicache_storage_max_gb=0.5)
