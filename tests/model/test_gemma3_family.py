"""The Gemma 3 family against HF transformers on the same random weights (float32): prompt
logprobs within 1e-4 and 16 greedy tokens identical. Sliding windows shorter than the prompt
(7 tokens: every chunk crosses a window edge), global layers at irregular positions
(layer_types) or by sliding_window_pattern, odd head counts with GQA, head_dim independent of
hidden / heads, query_pre_attn_scalar apart from head_dim, separate local and global rope bases
(the global one linearly scaled), a final logit softcap; chunked and dynamically chunked
prefill, pipelines of 1 to 3 stages with uneven partitions, a prefix-cache hit, and the
language model of a Gemma3ForConditionalGeneration checkpoint. A prompt 20 windows long, in
float32 and int8 KV: the window layers' pages in use, as their pool counts them, stay within a
window and a chunk while the global layers keep every token (ARCHITECTURE.md, 'Window
pages'), in prefill and in decode."""
import random

import pytest
import torch
from safetensors import safe_open

from conftest import (assert_matches_hf, assert_pages_free, assert_prefix_hit_matches,
                      hf_reference, track)
from pipefill import Engine
from pipefill.kernels.cpu_attention import kernel_available
from pipefill.kv.window import ring_pages, window_before
from pipefill.model.attention import choose_backend
from pipefill.model.loader import LANGUAGE_MODEL_PREFIXES, WeightSource, tensor_names

PAGE = 16
_rng = random.Random(5)
PROMPT = [_rng.randrange(512) for _ in range(90)]

TEXT = {
    # 3 query heads on 1 KV head, head_dim 48 (hidden / heads = 32), window 7, global layers
    # 0 and 3 of 5, rope bases 10,000 (linear x2) and 100, scores by 1/sqrt(40), softcap 30.
    "irregular": dict(vocab_size=512, hidden_size=96, intermediate_size=112,
                      num_hidden_layers=5, num_attention_heads=3, num_key_value_heads=1,
                      head_dim=48, sliding_window=7, query_pre_attn_scalar=40,
                      layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                   "full_attention", "sliding_attention"],
                      rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 10_000.0},
                                       "sliding_attention": {"rope_type": "default",
                                                             "rope_theta": 100.0}},
                      final_logit_softcapping=30.0, max_position_embeddings=1024),
    # 4 heads on 2, head_dim 64, window 20, a global layer after every two local ones.
    "pattern": dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    sliding_window=20, sliding_window_pattern=3, max_position_embeddings=1024),
    # Gemma 3 270M's attention: 4 query heads over 1 KV head of 256, scores by
    # query_pre_attn_scalar^-0.5 apart from head_dim; window 20, shorter than a kernel page.
    "kernels": dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                    sliding_window=20, query_pre_attn_scalar=200, sliding_window_pattern=3,
                    max_position_embeddings=1024),
}


def _randomize(model) -> None:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn_like(p))  # norms scale by 1 + w: w near 0


def save_gemma(kind: str, path) -> str:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    model = AutoModelForCausalLM.from_config(Gemma3TextConfig(**TEXT[kind]), dtype=torch.float32)
    _randomize(model)
    model.save_pretrained(str(path))
    return str(path)


def save_multimodal(path) -> str:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=TEXT["pattern"], vision_config=vision.to_dict(),
                       mm_tokens_per_image=4)
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    _randomize(model)
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory):
    paths = {k: save_gemma(k, tmp_path_factory.mktemp(k)) for k in TEXT}
    return {k: (p, hf_reference(p, PROMPT, 16)) for k, p in paths.items()}


def check(engine, ref, chunk=None):
    return assert_matches_hf(engine, PROMPT, ref, chunk)


@pytest.mark.parametrize("kind,chunk", [
    pytest.param("irregular", PAGE, marks=pytest.mark.slow), ("irregular", 37),
    pytest.param("pattern", 256, marks=pytest.mark.slow)])
def test_one_stage_matches_hf(kind, chunk, gemma_models):
    path, ref = gemma_models[kind]
    with track(Engine(path, dtype="float32", page_size=PAGE, chunked_prefill_size=chunk,
                      threads_per_stage=1)) as engine:
        check(engine, ref, chunk)
        # Again from the prefix cache: a window layer reads the cached keys of its window.
        assert_prefix_hit_matches(engine, PROMPT, ref[1], PAGE)


@pytest.mark.parametrize("kind,pp,partition,dynamic", [
    # Stage-local layer indices would put the wrong layers in windows here (global ones
    # in the middle of a stage's slice).
    ("irregular", 3, "2,1,2", False), ("pattern", 2, "1,3", True)])
def test_pipeline_matches_hf(kind, pp, partition, dynamic, gemma_models):
    path, ref = gemma_models[kind]
    kw = {"enable_dynamic_chunking": True} if dynamic else {}
    with track(Engine(path, dtype="float32", page_size=PAGE, chunked_prefill_size=32,
                      pp_size=pp, threads_per_stage=1, pp_layer_partition=partition,
                      **kw)) as engine:
        check(engine, ref, None if dynamic else 32)


@pytest.mark.slow
def test_multimodal_checkpoint_runs_its_language_model(tmp_path):
    path = save_multimodal(tmp_path)
    ref = hf_reference(path, PROMPT, 16)
    with track(Engine(path, dtype="float32", page_size=PAGE, chunked_prefill_size=32,
                      threads_per_stage=1)) as engine:
        check(engine, ref, 32)


def test_the_hf_comparison_sees_the_window_edge(gemma_models, tmp_path):
    """A query at position p sees keys (p - window, p] in a local layer, in pipefill and in
    transformers' sliding mask (kv > q - window): `window` keys, itself included. The same
    random weights with the edge one key nearer or farther give prompt logprobs far outside
    the 1e-4 that test_one_stage_matches_hf allows, so that test pins the semantics."""
    ref = gemma_models["irregular"][1][0]
    for window in (6, 8):
        kind = f"window{window}"
        TEXT[kind] = {**TEXT["irregular"], "sliding_window": window}
        try:
            shifted = hf_reference(save_gemma(kind, tmp_path / kind), PROMPT, 1)[0]
        finally:
            del TEXT[kind]
        assert (shifted - ref).abs().max().item() > 1e-2, window


def test_config_reads_the_layer_kinds_and_ropes(gemma_models):
    cfg = WeightSource(gemma_models["irregular"][0]).config
    assert cfg.sliding_layers == (False, True, True, False, True)
    assert [cfg.window_of(i) for i in range(5)] == [None, 7, 7, None, 7]
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (cfg.rope_theta, cfg.local_rope_theta) == (10_000.0, 100.0)
    assert cfg.query_pre_attn_scalar == 40 and cfg.final_logit_softcapping == 30.0
    source = WeightSource(gemma_models["pattern"][0])
    cfg = source.config
    assert cfg.sliding_layers == (True, True, False, True)
    with safe_open(f"{gemma_models['pattern'][0]}/model.safetensors", framework="pt") as st:
        stored = set(st.keys())
    assert set(tensor_names(cfg, range(cfg.num_layers), True, True)) == stored


def test_multimodal_checkpoint_is_read_as_its_language_model(tmp_path):
    path = save_multimodal(tmp_path)
    source = WeightSource(path)
    cfg = source.config
    assert cfg.sliding_layers == (True, True, False, True) and cfg.tie_word_embeddings
    for name in tensor_names(cfg, range(cfg.num_layers), True, True):
        assert source.has(name), name
    with safe_open(f"{path}/model.safetensors", framework="pt") as st:
        key = next(k for k in st.keys() if k.endswith("layers.2.mlp.down_proj.weight"))
        assert key.startswith(LANGUAGE_MODEL_PREFIXES), key
        stored = st.get_tensor(key)
    assert torch.equal(source.load("model.layers.2.mlp.down_proj.weight"), stored)


_VECTOR = [pytest.param(isa, marks=pytest.mark.skipif(
    not kernel_available(isa)[0], reason=f"{isa} kernel cannot run here"))
    for isa in ("avx512", "avx2")]


@pytest.mark.parametrize("isa", _VECTOR)
def test_vector_kernels_match_hf(isa, gemma_models):
    """Head dim 256 and windows on a float32 vector kernel: chunks of 37 start mid-window,
    the window pages are freed as the prompt goes, and a prefix hit reads the kept window."""
    path, ref = gemma_models["kernels"]
    with track(Engine(path, dtype="float32", page_size=32, chunked_prefill_size=37,
                      attention_backend=isa, threads_per_stage=1)) as engine:
        check(engine, ref, 37)
        assert_prefix_hit_matches(engine, PROMPT, ref[1], 32)


def test_kernels_take_windows_and_head_dim_256():
    cpu = torch.device("cpu")
    backend, why = choose_backend("auto", torch.float32, 256, 32, cpu, windowed=True)
    if backend != "sdpa":
        assert "the kernel bounds the sliding windows" in why
    with pytest.raises(ValueError, match="amx is not available: the model has sliding-window "
                                         "layers, which the AMX kernel does not bound"):
        choose_backend("amx", torch.bfloat16, 64, 64, cpu, windowed=True)
    with pytest.raises(ValueError, match="head_dim is 256, the kernel supports 64 and 128"):
        choose_backend("amx", torch.bfloat16, 256, 64, cpu)
    with pytest.raises(ValueError, match="head_dim is 96, the kernel supports 64, 128 and 256"):
        choose_backend("avx2", torch.float32, 96, 64, cpu)
    backend, why = choose_backend("auto", torch.float32, 256, PAGE, cpu, windowed=True)
    assert backend == "sdpa" and f"--page-size {PAGE} is not a multiple of 32" in why


@pytest.mark.parametrize("prefix,chunk,window,slots_as", [
    (0, 20, 7, "slice"), (5, 9, 7, "tensor"), (13, 1, 7, "slice"), (30, 16, 16, "tensor"),
    (3, 4, 7, "slice"), (6, 1, 7, "tensor")])
def test_window_attention_sees_the_last_window_keys(prefix, chunk, window, slots_as):
    """A chunk at [L, L + C) over a cached prefix: the query at p sees keys (p - window, p],
    as a per-row float64 softmax over exactly those keys computes."""
    from pipefill.model.attention import SeqMeta, attend_sequence
    torch.manual_seed(prefix * 100 + chunk)
    total, offset, scale = prefix + chunk, 3, 0.3
    k_cache, v_cache = torch.randn(64, 1, 8), torch.randn(64, 1, 8)
    q = torch.randn(chunk, 3, 8)  # 3 query heads on 1 KV head
    slots = slice(offset, offset + total)
    if slots_as == "tensor":
        slots = torch.arange(offset, offset + total)
    new = slice(offset + prefix, offset + total)
    seq = SeqMeta(0, chunk, prefix, new, slots, torch.zeros(1, dtype=torch.int32))
    out = attend_sequence(q, k_cache[new], v_cache[new], k_cache, v_cache, seq, scale, window)
    for i in range(chunk):
        p = prefix + i
        seen = range(offset + max(0, p - window + 1), offset + p + 1)
        keys, values = k_cache[list(seen), 0].double(), v_cache[list(seen), 0].double()
        weights = torch.softmax(q[i].double() @ keys.T * scale, -1)
        torch.testing.assert_close(out[i].double(), weights @ values, atol=1e-5, rtol=1e-5)


def test_int8_decode_row_reads_only_its_window_natively():
    """On the sdpa path a decode row over an int8 cache runs the C++ kernel on its window's
    rows only (the rows before it hold NaN scales): equal to the torch path, which
    dequantizes the window."""
    from pipefill.kernels.kv_quant import store
    from pipefill.model.attention import SeqMeta, attend_sequence, native_decode_isa
    isa = native_decode_isa(torch.int8)
    if isa is None:
        pytest.skip("the int8 decode kernel does not run here")
    torch.manual_seed(0)
    window, prefix, dim = 7, 30, 256
    k_cache = torch.zeros(64, 1, dim + 4, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(prefix + 1, 1, dim), torch.randn(prefix + 1, 1, dim)
    store(k_cache, slice(0, prefix + 1), k)
    store(v_cache, slice(0, prefix + 1), v)
    for cache in (k_cache, v_cache):
        cache[:prefix + 1 - window, :, dim:].view(torch.float32).fill_(float("nan"))
    q = torch.randn(1, 4, dim)
    seq = SeqMeta(0, 1, prefix, slice(prefix, prefix + 1), slice(0, prefix + 1),
                  torch.zeros(1, dtype=torch.int32))
    args = (q, k[prefix:], v[prefix:], k_cache, v_cache, seq, dim ** -0.5, window)
    native = attend_sequence(*args, native=isa)
    torch.testing.assert_close(native, attend_sequence(*args), atol=1e-5, rtol=1e-5)


LONG_PAGE, LONG_CHUNK = 4, 16
LONG = [_rng.randrange(512) for _ in range(20 * TEXT["pattern"]["sliding_window"])]


def window_bound(prompt_len: int) -> int:
    """Window pages one sequence may hold, whatever its chunks: its ring (a window and a piece)
    and the window before its prompt's last cacheable page boundary (kv/window.py)."""
    window = TEXT["pattern"]["sliding_window"]
    prompt_window = window_before((prompt_len - 1) // LONG_PAGE, LONG_PAGE, window)
    return ring_pages(LONG_PAGE, window) + len(prompt_window)


@pytest.fixture(scope="module")
def long_reference(gemma_models):
    return hf_reference(gemma_models["pattern"][0], LONG, 16)


def test_window_pages_stay_within_a_window_over_a_long_prompt(gemma_models, long_reference):
    """Two stages (a local layer, then local, global, local); HF parity on a prompt 20
    windows long, the same prompt again from the prefix cache, then a long decode."""
    path = gemma_models["pattern"][0]
    with track(Engine(path, dtype="float32", page_size=LONG_PAGE,
                      chunked_prefill_size=LONG_CHUNK, pp_size=2, pp_layer_partition="1,3",
                      threads_per_stage=1)) as engine:
        assert_matches_hf(engine, LONG, long_reference, LONG_CHUNK)
        stats = engine.stats()
        # The pools' own counters: the global layers keep every token, the window layers a
        # window and a piece.
        assert stats["pages_peak"] == -(-(len(LONG) + 15) // LONG_PAGE)
        assert stats["window_pages_peak"] <= window_bound(len(LONG)) < len(LONG) // LONG_PAGE / 4
        # The same prompt again reads the window the tree kept before its last boundary.
        assert_prefix_hit_matches(engine, LONG, long_reference[1], LONG_PAGE)
        stats = engine.stats()
        # Decode frees too: 120 tokens (30 pages) beside the windows the tree holds.
        short = LONG[:30]
        engine.generate([short], max_new_tokens=120, ignore_eos=True)
        after = engine.stats()
        assert after["window_pages_peak"] <= max(
            stats["window_pages_peak"], stats["window_pages_used"] + window_bound(len(short)))
        assert_pages_free(engine)


@pytest.mark.slow
def test_window_pages_with_an_int8_cache(gemma_models, long_reference):
    """The window layers' own pages hold int8 rows with their scales like the others: the
    prompt logprobs stay within the int8 bound of test_quant_kv (the llama families')."""
    path = gemma_models["pattern"][0]
    with track(Engine(path, dtype="float32", page_size=LONG_PAGE,
                      chunked_prefill_size=LONG_CHUNK, kv_cache_dtype="int8",
                      threads_per_stage=1)) as engine:
        out = engine.generate([LONG], max_new_tokens=1, return_prompt_logprobs=True)[0]
        gap = (torch.tensor(out.prompt_logprobs) - long_reference[0]).abs()
        assert gap.max().item() < 0.04, gap.max().item()
        assert engine.stats()["window_pages_peak"] <= window_bound(len(LONG))


@pytest.mark.parametrize("isa", _VECTOR)
def test_one_chunk_many_windows_long_on_a_vector_kernel_matches_hf(isa, gemma_models):
    """One chunk of 200 tokens over windows of 20 on pages of 32: the kernel writes a piece's
    K/V into the ring of window pages and reads them back, piece after piece, so a page that a
    later page takes over is read before it is overwritten (kv/window.py; a whole chunk at once
    would read other tokens' keys: Gemma 3 270M's logprobs were off by up to 0.9 nats on
    1,000-token chunks when pages were shared)."""
    path, _ = gemma_models["kernels"]
    prompt = LONG[:200]
    ref = hf_reference(path, prompt, 16)
    with track(Engine(path, dtype="float32", page_size=32, chunked_prefill_size=256,
                      attention_backend=isa, threads_per_stage=1)) as engine:
        assert_matches_hf(engine, prompt, ref, 256)
