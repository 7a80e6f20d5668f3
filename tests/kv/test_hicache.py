"""The host tier (L2): the scheduler's decisions replayed on a token-level fake KV (every read
must see the tokens of its positions, through evictions, host stores/loads and preemptions),
the copy thread on real caches, and real engines with a pool far smaller than the workload."""
import random

import pytest
import torch

from conftest import save_tiny_model, track
from pipefill import Engine
from pipefill.chunking.policy import ChunkPolicy
from pipefill.kv.cache import KVCache
from pipefill.kv.host import HostDirector, HostTier, host_slots
from pipefill.kv.pool import PageOwners, PagePool
from pipefill.base.plan import CacheOp, CopyKind, NewRequest, SamplingParams, SeqResult, StepResult
from pipefill.kv.radix import RadixCache
from pipefill.scheduler.scheduler import Scheduler, SchedulerConfig

PAGE = 4


class TokenStage:
    """A stage whose KV 'values' are the token ids themselves: pool and host pages are lists,
    copies move them, a forward writes its tokens and checks that every position it reads
    holds that position's token. Page ownership is checked as on a real stage."""

    def __init__(self, num_pages: int, num_slots: int, tokens: dict[str, list[int]]):
        self.pool = [[None] * PAGE for _ in range(num_pages)]
        self.host = [[None] * PAGE for _ in range(num_slots)]
        self.owners = PageOwners(num_pages)
        self.tokens = tokens  # rid -> prompt + outputs so far (the test keeps it current)

    def run(self, plan) -> None:
        ops = plan.page_ops
        for op in ops.cache_ops:
            if op.kind is CopyKind.STORE:
                assert op.page in self.owners.written
                self.host[op.slot] = list(self.pool[op.page])
        self.owners.free(ops.freed)
        for op in ops.cache_ops:
            if op.kind is CopyKind.LOAD:
                self.owners.allocate("<prefix cache>", [op.page])
                self.owners.mark_written([op.page])
                self.pool[op.page] = list(self.host[op.slot])
        self.owners.replay([], plan.seqs, PAGE)
        for w in plan.seqs:
            for pos, tok in zip(range(w.start, w.end), w.input_ids):
                self.pool[w.page_table[pos // PAGE]][pos % PAGE] = tok
            want = self.tokens[w.rid]
            for pos in range(w.end):
                got = self.pool[w.page_table[pos // PAGE]][pos % PAGE]
                assert got == want[pos], f"{w.rid} position {pos}: {got} != {want[pos]}"
        self.owners.to_cache(ops.cached)


def run_workload(seed: int, num_pages: int, num_slots: int, inflight: int = 3):
    rng = random.Random(seed)
    pool = PagePool(num_pages)
    host = HostDirector(num_slots) if num_slots else None
    cache = RadixCache(PAGE, pool, host)
    s = Scheduler(SchedulerConfig(PAGE, 16, 4, 4096, ()), pool, ChunkPolicy(8), cache)
    docs = [[rng.randrange(50) for _ in range(rng.randrange(8, 30))] for _ in range(3)]
    tokens, expect = {}, {}
    for i in range(12):
        prompt = rng.choice(docs) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
        n = rng.randrange(1, 12)
        tokens[f"r{i}"] = list(prompt)
        expect[f"r{i}"] = [(7 * i + k) % 50 for k in range(n)]
        s.add(NewRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=n)))
    stage = TokenStage(num_pages, num_slots, tokens)
    queue, got = [], {}
    for _ in range(5000):
        plan = s.schedule() if len(queue) < inflight else None
        if plan is not None:
            stage.run(plan)
            queue.append(plan)
            continue
        if not queue:
            break
        done = queue.pop(0)
        result = StepResult(done.step_id, [
            SeqResult(w.rid, expect[w.rid][w.sample.step] if w.sample else None)
            for w in done.seqs])
        for out in s.update(done, result):
            got.setdefault(out.rid, []).extend(out.new_token_ids)
            tokens[out.rid] += out.new_token_ids
    assert got == expect
    stage.owners.free(s.kv.drain_ops().freed)
    pool.check_integrity()
    assert pool.num_used == cache.num_pages == stage.owners.num_used and s.kv.promised == 0
    return s


@pytest.mark.parametrize("slots", [0, 3, 10], ids=["L1-only", "L1+tiny-L2", "L1+L2"])
@pytest.mark.parametrize("seed", range(8))
def test_small_pool_reads_the_right_tokens(seed, slots):
    s = run_workload(seed, num_pages=14, num_slots=slots)
    assert s.kv.stats()["cache_evicted_pages"] > 0


def test_host_tier_loads_and_preempts_in_the_same_run():
    stats = [run_workload(seed, num_pages=12, num_slots=24).kv.stats() for seed in range(8)]
    assert sum(st["host_loaded_pages"] for st in stats) > 0
    assert sum(st["cache_hit_tokens_host"] for st in stats) > 0
    assert sum(st["preemptions"] for st in stats) > 0


def test_host_slots_agree_from_arguments():
    assert host_slots(False, None, 2.0, 100, 16, 4, 2, 16, 4) == 0
    assert host_slots(True, None, 1.5, 100, 16, 4, 2, 16, 4) == 150
    page_bytes = 2 * 4 * 16 * 2 * 16 * 4  # K and V, 4 layers of the largest stage
    assert host_slots(True, 1.0, 2.0, 100, 16, 4, 2, 16, 4) == 2**30 // page_bytes


def test_copy_thread_moves_pages_both_ways():
    cache = KVCache(2, 8, 4, 2, 16, torch.float32)
    tier = HostTier(cache, 6)
    owners = PageOwners(8)
    data = torch.randn(2, 2, 3, 4, 2, 16)
    owners.allocate("r", [1, 2, 3])
    owners.check("r", [], [1, 2, 3])
    cache.write_pages([1, 2, 3], data)
    tier.store([CacheOp(CopyKind.STORE, p, s) for p, s in ((1, 5), (2, 0), (3, 2))], owners)
    owners.free([1, 2, 3])
    tier.load([CacheOp(CopyKind.LOAD, p, s) for p, s in ((6, 5), (7, 0), (0, 2))], owners)
    tier.wait_for([6, 7, 0])
    assert torch.equal(cache.read_pages([6, 7, 0]), data)


# ---- real engines ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama_hc"), num_hidden_layers=3)


def workload():
    docs = [[(7 * i + 3 + 31 * d) % 512 for i in range(100)] for d in range(3)]
    return [doc + [1, 2, 3] for doc in docs] + [doc + [4, 5] for doc in docs]


def run_engine(path, logprobs: bool = False, **kw):
    """One prompt at a time (each doc is evicted by the next ones, then hit from L2), then
    all at once with long outputs in a pool that cannot hold them (preemption). logprobs:
    returns the outputs (with their token logprobs) instead of their token ids."""
    flags = dict(dtype="float32", page_size=16, threads_per_stage=1, chunked_prefill_size=32,
                 max_total_tokens=16 * 20, max_model_len=200)
    with track(Engine(path, **(flags | kw))) as e:
        prompts = workload()
        outs = [e.generate([p], max_new_tokens=6, ignore_eos=True, logprobs=logprobs)[0]
                for p in prompts]
        outs += e.generate(prompts[:3], max_new_tokens=60, ignore_eos=True, logprobs=logprobs)
        return outs if logprobs else [o.output_ids for o in outs], e.stats()


@pytest.mark.parametrize("pp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_small_pool_engine_equals_no_cache(model, pp):
    on, stats = run_engine(model, pp_size=pp, enable_hierarchical_cache=True)
    off, _ = run_engine(model, pp_size=pp, disable_radix_cache=True)
    assert on == off
    assert stats["host_loaded_pages"] > 0 and stats["cache_hit_tokens_host"] > 0
    assert stats["preemptions"] > 0
    for stage in stats["stages"][1:]:
        assert stage["host_slots_total"] == stats["host_slots_total"]


@pytest.mark.slow
@pytest.mark.parametrize("kind,flags", [
    ("irregular", {}),  # the sdpa path (head dim 48, pages of 16)
    ("kernels", dict(page_size=32, max_total_tokens=32 * 10))])
def test_gemma_small_pool_engine_equals_no_cache(tmp_path, kind, flags):
    """Gemma 3 with short windows through the host tier: the window layers keep pages of
    their own, freed outside the window, and a host slot keeps its page's window part where the
    tree held one (ARCHITECTURE.md, 'Window pages'), so a hit from L2 reads the window keys a
    cold run computes: the same greedy tokens, token logprobs within 1e-4. "kernels": head
    dim 256 on a vector kernel, whose window layers keep packed pages of their own."""
    from test_gemma3_family import save_gemma
    if kind == "kernels":  # named, so a kernel that does not fit fails instead of passing on sdpa
        from pipefill.kernels.cpu_attention import best_kernel
        flags = flags | {"attention_backend": best_kernel(bf16_dot=False)}
        if flags["attention_backend"] is None:
            pytest.skip("no float32 vector attention kernel here")
    path = save_gemma(kind, tmp_path / "gemma")
    on, stats = run_engine(path, logprobs=True, enable_hierarchical_cache=True, **flags)
    off, _ = run_engine(path, logprobs=True, disable_radix_cache=True, **flags)
    assert [o.output_ids for o in on] == [o.output_ids for o in off]
    for a, b in zip(on, off):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
    assert stats["host_loaded_pages"] > 0 and stats["cache_hit_tokens_host"] > 0
    assert stats["host_loaded_window_pages"] > 0  # window parts came back from the host
    # The window layers freed their pages outside the window: fewer than the global layers'.
    assert 0 < stats["window_pages_peak"] < stats["pages_peak"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_cache_pages_round_trip_through_the_kernel_layout(dtype):
    """AmxKVCache.read_pages/write_pages (token-major, for storage) against the vector
    kernels' own packing (cpu_attention.write_kv), where this CPU can build them."""
    from pipefill.kernels import cpu_attention
    from pipefill.kernels.amx_attention import AmxKVCache
    if cpu_attention.best_kernel() is None:
        pytest.skip("no vector attention kernel on this CPU")
    cache = AmxKVCache(2, 6, 64, 2, 64, dtype)
    data = torch.randn(2, 2, 2, 64, 2, 64).to(dtype)  # [K/V, layers, pages, tokens, H, D]
    for layer in range(2):
        k, v = (data[i, layer].reshape(128, 2, 64) for i in range(2))
        cpu_attention.write_kv(cache.k[layer], cache.v[layer], k, v,
                               torch.tensor([4, 1], dtype=torch.int32), 0)
    assert torch.equal(cache.read_pages([4, 1]), data)
    other = AmxKVCache(2, 6, 64, 2, 64, dtype)
    other.write_pages([4, 1], data)
    assert torch.equal(other.k[:, [4, 1]], cache.k[:, [4, 1]])


# ---- storage tier (L3, file backend) --------------------------------------------------------

def storage_run(path, storage_dir, prompts, **kw):
    with track(Engine(path, dtype="float32", page_size=16, threads_per_stage=1, pp_size=2,
                      chunked_prefill_size=32, hicache_storage_backend="file",
                      hicache_storage_dir=str(storage_dir), **kw)) as e:
        outs = [e.generate([p], max_new_tokens=6, ignore_eos=True)[0] for p in prompts]
        return [o.output_ids for o in outs], [o.metrics["cached_tokens"] for o in outs], \
            e.stats()


def test_file_storage_survives_a_restart_and_bad_files_are_misses(model, tmp_path):
    prompts = workload()[:2]
    ref = [o.output_ids for o in [run_engine_outputs(model, p) for p in prompts]]
    out, cached, _ = storage_run(model, tmp_path, prompts)  # writes every whole page
    assert out == ref and cached == [0, 0]
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 2 * 2 * (103 // 16)  # 2 prompts x 2 stages x 6 whole pages
    out, cached, stats = storage_run(model, tmp_path, prompts)  # a fresh engine: hits
    assert out == ref and cached == [96, 96]
    assert stats["cache_hit_tokens_storage"] == 192
    # Damage two page files (whichever stage and prompt): one corrupt, one truncated. Every
    # whole page is used, so each damaged one ends its prompt's hit there; outputs unchanged.
    victims = files[:2]
    data = bytearray(victims[0].read_bytes())
    data[-5] ^= 0xFF
    victims[0].write_bytes(bytes(data))
    victims[1].write_bytes(victims[1].read_bytes()[:100])
    out, cached, stats = storage_run(model, tmp_path, prompts)
    assert out == ref
    assert stats["cache_hit_tokens_storage"] < 192


@pytest.mark.slow
@pytest.mark.parametrize("kind,page", [("irregular", 16), ("kernels", 32)])
def test_gemma_storage_hits_equal_no_cache(tmp_path, kind, page):
    """Gemma 3 with short windows through the file storage tier (PP2): the window layers keep
    pages of their own, a stored page keeps its window part where the tree held one, and a
    fresh engine's hit from L3 fetches the window its first chunk reads (ARCHITECTURE.md,
    'Window pages'), so it reads the window keys a cold run computes: the same greedy tokens,
    token logprobs within 1e-4 of no cache. "kernels": packed window pages (a vector kernel)."""
    from test_gemma3_family import save_gemma
    path = save_gemma(kind, tmp_path / "gemma")
    prompts = workload()[:2]

    def outputs(**kw):
        with track(Engine(path, dtype="float32", page_size=page, threads_per_stage=1,
                          pp_size=2, chunked_prefill_size=32, **kw)) as e:
            return [e.generate([p], max_new_tokens=6, ignore_eos=True, logprobs=True)[0]
                    for p in prompts], e.stats()

    off, _ = outputs(disable_radix_cache=True)
    stored = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "l3"))
    outputs(**stored)  # writes every whole page and the window parts its tree holds
    on, stats = outputs(**stored)  # a fresh engine: hits
    assert [o.output_ids for o in on] == [o.output_ids for o in off]
    for a, b in zip(on, off):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
    assert [o.metrics["cached_tokens"] for o in on] == [96, 96]
    assert stats["storage_fetched_window_pages"] > 0  # window parts came back from storage
    assert 0 < stats["window_pages_peak"] < stats["pages_peak"]


def test_write_back_pages_survive_a_clean_stop(model, tmp_path):
    """write_back saves a page only when it leaves the pool, or at a clean stop: a pool large
    enough to evict nothing still leaves every page on disk for the next engine."""
    prompts = workload()[:2]
    ref = no_cache_outputs(model, prompts)
    out, cached, stats = storage_run(model, tmp_path, prompts, hicache_write_policy="write_back")
    assert out == ref and cached == [0, 0]
    assert stats["cache_evicted_pages"] == 0  # nothing was saved by an eviction
    files = [p for p in tmp_path.rglob("*") if p.is_file() and ".tmp." not in p.name]
    assert len(files) == 2 * 2 * (103 // 16)  # written at the stop: 2 prompts x 2 stages x 6
    out, cached, stats = storage_run(model, tmp_path, prompts, hicache_write_policy="write_back")
    assert out == ref and cached == [96, 96]
    assert stats["cache_hit_tokens_storage"] == 192


@pytest.mark.slow
def test_storage_cap_holds_for_the_stages_of_an_engine(model, tmp_path):
    """Both stages write one folder under --hicache-storage-max-gb: it stays under the cap,
    evicts, and the answers are the same as without storage."""
    prompts = workload()
    ref = no_cache_outputs(model, prompts)
    cap_gb = 60_000 / 2**30  # about 8 of the 36 pages the six prompts leave
    out, _, stats = storage_run(model, tmp_path, prompts, hicache_storage_max_gb=cap_gb)
    assert out == ref
    stored = sum(p.stat().st_size for p in tmp_path.rglob("*")
                 if p.is_file() and not p.name.startswith("."))
    assert 0 < stored <= cap_gb * 2**30
    assert sum(stage.get("storage_evicted_pages", 0) for stage in stats["stages"]) > 0


def no_cache_outputs(path, prompts) -> list[list[int]]:
    """Each prompt's tokens from one engine without the prefix cache."""
    with track(Engine(path, dtype="float32", page_size=16, threads_per_stage=1,
                      disable_radix_cache=True)) as e:
        return [e.generate([p], max_new_tokens=6, ignore_eos=True)[0].output_ids
                for p in prompts]


def run_engine_outputs(path, prompt):
    with track(Engine(path, dtype="float32", page_size=16, threads_per_stage=1,
                      disable_radix_cache=True)) as e:
        return e.generate([prompt], max_new_tokens=6, ignore_eos=True)[0]


@pytest.mark.slow
def test_mooncake_two_engines_share_one_store(model, tmp_path):
    """Two engines (PP2 each) on one mooncake_master: the second hits what the first wrote."""
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda missing")
    from test_storage import _start_master
    proc, addr = _start_master()
    kw = dict(dtype="float32", page_size=16, threads_per_stage=1, pp_size=2,
              chunked_prefill_size=32, hicache_storage_backend="mooncake",
              hicache_mooncake_master=addr)
    prompt = workload()[0]
    try:
        with track(Engine(model, **kw)) as first:
            a = first.generate([prompt], max_new_tokens=6, ignore_eos=True)[0]
            with track(Engine(model, **kw)) as second:
                b = second.generate([prompt], max_new_tokens=6, ignore_eos=True)[0]
                assert second.stats()["cache_hit_tokens_storage"] == 96
        assert a.output_ids == b.output_ids and b.metrics["cached_tokens"] == 96
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_write_policy_decides_when_pages_are_saved(policy):
    from pipefill.kv.storage import chain_page_keys
    from pipefill.kv.storage_tier import StorageDirector
    pool = PagePool(8)
    cache = RadixCache(2, pool, storage=StorageDirector(None, [], [], torch.float32, policy, 0.0))
    pages = pool.allocate(2)
    cache.insert([1, 1, 2, 2], pages)
    pool.release(pages)
    on_insert = cache.storage.drain_ops()
    cache.evict(2)
    on_evict = cache.storage.drain_ops()
    keys = [k.hex() for k in chain_page_keys([1, 1, 2, 2], 2)]
    saved = on_insert if policy == "write_through" else on_evict
    assert [(op.kind, op.page, op.key) for op in saved] == [
        (CopyKind.SAVE if policy == "write_through" else CopyKind.SAVE_EVICTED, p, k)
        for p, k in zip(pages, keys)]
    assert (on_evict if policy == "write_through" else on_insert) == []
