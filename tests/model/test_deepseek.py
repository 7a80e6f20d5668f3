"""The DeepSeek family (V3 and V2, multi-head latent attention, DeepSeekMoE) against HF
transformers on the same random weights (float32): prompt logprobs within 1e-4 and 16 greedy
tokens identical. Odd shapes: 3 heads, head sizes 10 + 6 (rope) and 14 (value), latents of
21 + 6 (an odd latent_dim) and 18 + 16 values, expert counts not powers of two; V3 with q LoRA, 2 expert
groups of which 1 is searched, a correction bias, a dense first layer and yarn with mscale and
mscale_all_dim; V2 without q LoRA, greedy and group-limited routing. Chunked and dynamically
chunked prefill, pipelines of 1 and 2 stages with uneven partitions, a prefix-cache hit; the
absorbed attention (decode) against the decompressed one (prefill), and a prefill forced
down each; the pool's KV bytes per token are the latent's; a PD pair refuses a decode whose
latent layout differs."""
import json
import logging
import random

import pytest
import torch

from conftest import (assert_matches_hf, assert_prefix_hit_matches, hf_reference,
                      single_stage, track)
from pipefill import Engine
from pipefill.model.attention import SeqMeta, choose_backend
from pipefill.model.families import family_for_hf_config
from pipefill.model.mla import LatentUp, absorbed, decompressed, latent_attention, write_latent

PAGE = 16
_rng = random.Random(27)
PROMPT = [_rng.randrange(512) for _ in range(90)]

COMMON = dict(vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False)
MODELS = {
    # q LoRA 20, an odd latent (21 + rope 6), 8 experts in 2 groups (1 searched), top-3, a
    # shared expert, layer 0 dense, sigmoid scores with a correction bias, yarn x4 with both
    # mscales.
    "v3": ("DeepseekV3Config", dict(
        hidden_size=48, intermediate_size=72, moe_intermediate_size=20, num_hidden_layers=4,
        num_attention_heads=3, num_key_value_heads=3, q_lora_rank=20, kv_lora_rank=21,
        qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=14, n_routed_experts=8,
        num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.8})),
    # no q LoRA, latent 18 + rope 4, softmax top-2 of 7 (greedy), 2 shared experts.
    "v2": ("DeepseekV2Config", dict(
        hidden_size=60, intermediate_size=80, moe_intermediate_size=20, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=18,
        qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=10, n_routed_experts=7,
        num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
        topk_method="greedy", routed_scaling_factor=1.5)),
    # group-limited: top-3 of 8 experts in the best 2 of 4 groups (latent 18 + 16: V2's
    # rope in transformers needs an even latent); widths that are multiples of 16, so the
    # fused elementwise kernels run where they build.
    "v2_groups": ("DeepseekV2Config", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=20, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=18,
        qk_nope_head_dim=12, qk_rope_head_dim=16, v_head_dim=10, n_routed_experts=8,
        num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, topk_method="group_limited_greedy",
        routed_scaling_factor=2.0)),
}


def save_deepseek(kind: str, path, seed: int = 1, models: dict = MODELS,
                  **changes) -> str:
    import transformers
    from transformers import AutoModelForCausalLM
    cls, kw = models[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, cls)(**COMMON, **{**kw, **changes})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name
                    else 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():  # the correction bias chooses, never weighs
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(str(path))
    return str(path)


class SavedModels(dict):
    """kind -> (folder, HF's reference), each saved and run by HF on first use (the fast
    tests need two of the three)."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp = tmp_path_factory

    def __missing__(self, kind: str):
        path = save_deepseek(kind, self.tmp.mktemp(kind))
        self[kind] = (path, hf_reference(path, PROMPT, 16, full_forwards=True))
        return self[kind]


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory):
    return SavedModels(tmp_path_factory)


def check(engine, ref, chunk=None):
    return assert_matches_hf(engine, PROMPT, ref, chunk)


@pytest.mark.parametrize("kind,chunk", [
    ("v3", 37), pytest.param("v2", PAGE, marks=pytest.mark.slow),
    pytest.param("v2_groups", 256, marks=pytest.mark.slow)])
def test_one_stage_matches_hf(kind, chunk, deepseek_models):
    path, ref = deepseek_models[kind]
    with track(Engine(path, dtype="float32", page_size=PAGE, chunked_prefill_size=chunk,
                      threads_per_stage=1)) as engine:
        check(engine, ref, chunk)
        assert_prefix_hit_matches(engine, PROMPT, ref[1], PAGE)


@pytest.mark.parametrize("prefill,backend", [
    ("absorbed", "auto"), pytest.param("decompressed", "sdpa", marks=pytest.mark.slow)])
def test_prefill_forced_down_each_path_matches_hf(prefill, backend, deepseek_models):
    """--mla-prefill-attention forces every chunk down one path (auto mostly decompresses
    these chunks of 37: test_one_stage_matches_hf); decode rows on the latent kernel (auto)
    or in torch (sdpa)."""
    path, ref = deepseek_models["v3"]
    with track(Engine(path, dtype="float32", page_size=PAGE, chunked_prefill_size=37,
                      threads_per_stage=1, mla_prefill_attention=prefill,
                      attention_backend=backend)) as engine:
        check(engine, ref, 37)
        assert_prefix_hit_matches(engine, PROMPT, ref[1], PAGE)


@pytest.mark.parametrize("kind,partition,dynamic", [
    ("v2_groups", "3,1", True), pytest.param("v3", "1,3", False, marks=pytest.mark.slow),
    pytest.param("v2", "2,1", True, marks=pytest.mark.slow)])
def test_pipeline_matches_hf(kind, partition, dynamic, deepseek_models):
    path, ref = deepseek_models[kind]
    kw = {"enable_dynamic_chunking": True} if dynamic else {}
    with track(Engine(path, dtype="float32", page_size=PAGE, chunked_prefill_size=32,
                      pp_size=2, threads_per_stage=1, pp_layer_partition=partition,
                      **kw)) as engine:
        check(engine, ref, None if dynamic else 32)
        assert_prefix_hit_matches(engine, PROMPT, ref[1], PAGE)


@pytest.mark.parametrize("kind", ["v3", "v2_groups"])
def test_the_pool_keeps_the_latent_per_token(kind, deepseek_models):
    """KV bytes per token = layers x (kv_lora_rank + qk_rope_head_dim) x dtype size (an odd
    latent_dim rounds up to even: its halves lie in K and V)."""
    path, _ = deepseek_models[kind]
    stage = single_stage(path, "float32")
    mla, cfg = stage.model.cfg.mla, stage.model.cfg
    cache = stage.cache
    per_token = (cache.k[:, 0].numel() + cache.v[:, 0].numel()) * cache.k.element_size()
    assert per_token == cfg.num_layers * (mla.latent_dim + mla.latent_dim % 2) * 4
    specs = stage.model.family.kv_specs(cfg, range(cfg.num_layers), torch.bfloat16)
    assert sum(s.bytes_per_token for s in specs) == cfg.num_layers * 2 * (
        mla.latent_dim + mla.latent_dim % 2)
    if kind == "v3":
        assert per_token == 4 * (21 + 6 + 1) * 4  # 27 values: V keeps one unused


def _random_latent_layer(heads=3, nope=10, rope=6, v=14, rank=22, seed=0):
    gen = torch.Generator().manual_seed(seed)
    up = LatentUp(torch.randn(heads * (nope + v), rank, generator=gen) * 0.3, heads, nope, v)
    return up, gen


@pytest.mark.parametrize("num_keys,num_queries", [(1, 1), (40, 1), (40, 40), (57, 13)])
def test_absorbed_attention_equals_decompressed(num_keys, num_queries):
    up, gen = _random_latent_layer()
    latent = torch.randn(num_keys, 22 + 6, generator=gen)
    q_nope = torch.randn(num_queries, 3, 10, generator=gen)
    q_pe = torch.randn(num_queries, 3, 6, generator=gen)
    a = absorbed(q_nope, q_pe, latent, up, 0.3)
    d = decompressed(q_nope, q_pe, latent, up, 0.3)
    assert a.shape == d.shape == (num_queries, 3, 14)
    assert (a - d).abs().max().item() < 1e-5


@pytest.mark.parametrize("odd", [False, True])
def test_latents_round_trip_through_k_and_v(odd):
    """Written over K's and V's one head each, read back whole, through paged slots; a
    decode row attends to its sequence's latents only."""
    width = 21 if odd else 28
    half = (width + 1) // 2
    k_cache, v_cache = torch.zeros(64, 1, half), torch.zeros(64, 1, half)
    latent = torch.randn(5, width)
    slots = torch.tensor([3, 4, 17, 40, 41])
    seq = SeqMeta(0, 5, 0, slots, slots, torch.tensor([0, 1, 2]))
    write_latent(k_cache, v_cache, latent, [seq])
    from pipefill.model.mla import read_latent
    assert torch.equal(read_latent(k_cache, v_cache, slots, width, torch.float32), latent)
    up, gen = _random_latent_layer(rank=width - 6)
    q_nope, q_pe = torch.randn(1, 3, 10, generator=gen), torch.randn(1, 3, 6, generator=gen)
    decode = SeqMeta(0, 1, 4, slots[4:], slots, torch.tensor([0, 1, 2]))
    out = latent_attention(q_nope, q_pe, k_cache, v_cache, [decode], up, width, 0.3)
    assert torch.allclose(out, decompressed(q_nope, q_pe, latent, up, 0.3), atol=1e-5)


def test_config_routers_and_refusals(deepseek_models, caplog):
    with open(f"{deepseek_models['v3'][0]}/config.json") as f:
        d = json.load(f)
    family = family_for_hf_config(d)
    assert family.name == "deepseek"
    with caplog.at_level(logging.INFO, logger="pipefill.model.families.deepseek"):
        cfg = family.config_from_hf({**d, "num_nextn_predict_layers": 1})
    assert "skipping 1 multi-token-prediction layer" in caplog.text
    assert cfg.moe.sparse_layers == (False, True, True, True)
    assert (cfg.moe.scoring, cfg.moe.topk_method, cfg.moe.num_groups) == ("sigmoid",
                                                                           "noaux_tc", 2)
    assert cfg.mla.q_lora_rank == 20 and cfg.mla.latent_dim == 27
    # (10 + 6)^-0.5 times (0.1 * 0.8 * ln 4 + 1)^2, as transformers' yarn_apply_mscale.
    import math
    assert cfg.mla.softmax_scale == pytest.approx(16 ** -0.5 * (0.08 * math.log(4) + 1) ** 2)
    for bad, sentence in [({"scoring_func": "softmax"}, "scoring_func 'softmax' is not"),
                          ({"topk_method": "greedy"}, "topk_method 'greedy' is not"),
                          ({"n_group": 3}, "do not split into n_group 3")]:
        with pytest.raises(ValueError, match=sentence):
            family.config_from_hf({**d, **bad})
    with open(f"{deepseek_models['v2_groups'][0]}/config.json") as f:
        d2 = json.load(f)
    cfg2 = family.config_from_hf(d2)
    assert (cfg2.moe.topk_method, cfg2.moe.num_groups, cfg2.moe.topk_groups,
            cfg2.mla.q_lora_rank) == ("group_limited_greedy", 4, 2, None)
    with pytest.raises(ValueError, match="norm_topk_prob is not supported"):
        family.config_from_hf({**d2, "norm_topk_prob": True})


def test_a_quantized_checkpoint_is_refused_with_a_sentence(deepseek_models, tmp_path):
    """An FP8 checkpoint in blocks other than DeepSeek-V3's 128 x 128: refused at load, while
    `pipefill sim` still reads its shapes from the same config.json (the FP8 checkpoints
    pipefill reads: tests/model/test_fp8_checkpoints.py)."""
    from pipefill.model.loader import WeightSource
    with open(f"{deepseek_models['v3'][0]}/config.json") as f:
        d = json.load(f)
    fp8 = {**d, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                        "activation_scheme": "dynamic",
                                        "weight_block_size": [64, 64]}}
    (tmp_path / "config.json").write_text(json.dumps(fp8))
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\] is not read"):
        WeightSource(str(tmp_path))
    assert family_for_hf_config(fp8).config_from_hf(fp8).mla.latent_dim == 27


def test_real_shapes_plan_and_size_the_latent(tmp_path):
    """DeepSeek-V3's and V2-Lite's published shapes (bench make-model): 576 latent values a
    token and layer, dense first layers weighed apart from the MoE ones, and `pipefill sim`
    partitions V3 from its config.json alone."""
    import subprocess
    import sys
    from pipefill.bench.make_model import make_config
    family = family_for_hf_config({"model_type": "deepseek_v3"})
    for like, dense in (("deepseek-v3", 3), ("deepseek-v2-lite", 1)):
        cfg = family.config_from_hf(json.loads(make_config(like).to_json_string()))
        assert cfg.mla.latent_dim == 576 and cfg.moe.sparse_layers.index(True) == dense
        costs = family.layer_costs(cfg)
        assert costs[0] != costs[dense] and len(set(costs[dense:])) == 1
    path = tmp_path / "config.json"
    path.write_text(make_config("deepseek-v3").to_json_string())
    out = subprocess.run([sys.executable, "-m", "pipefill.cli.main", "sim", "--model-config",
                          str(path), "--pp-size", "4", "--input-len", "131072", "--tflops",
                          "400"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "deepseek_v3: 61 layers" in out.stdout and "TTFT" in out.stdout


def test_attention_kernels_step_aside_for_the_latent_cache():
    backend, why = choose_backend("auto", torch.float32, 64, PAGE, torch.device("cpu"),
                                  latent=True)
    assert backend == "sdpa" and "latent KV cache" in why
    with pytest.raises(ValueError, match="avx2 is not available: the model attends from a "
                                         "latent KV cache"):
        choose_backend("avx2", torch.float32, 64, PAGE, torch.device("cpu"), latent=True)


# ---- the latent through the cache tiers and PD (slow: several engines) -----------------------

@pytest.mark.slow
def test_host_tier_and_storage_carry_the_latent(deepseek_models, tmp_path):
    """L2: a pool too small for the workload (evictions to the host tier, loads back,
    preemption) gives the tokens of a run without any cache; L3: a second engine on the same
    storage folder reads the first one's latent pages and decodes the same tokens."""
    from test_hicache import run_engine, storage_run, workload
    path = deepseek_models["v2_groups"][0]
    on, stats = run_engine(path, enable_hierarchical_cache=True)
    off, _ = run_engine(path, disable_radix_cache=True)
    assert on == off and stats["host_loaded_pages"] > 0
    prompts = workload()[:2]
    first, cached, _ = storage_run(path, tmp_path, prompts)
    again, cached_again, stats = storage_run(path, tmp_path, prompts)
    assert again == first and cached == [0, 0] and min(cached_again) >= 96
    assert stats["storage_fetched_pages"] > 0


@pytest.mark.slow
def test_pd_pair_moves_latent_pages(deepseek_models, tmp_path):
    """A prefill Engine and a decode Engine (PP 2 on the prefill): the decode's greedy tokens
    are HF's after the latent pages crossed over; a decode whose latent layout or KV dtype
    differs is refused at start-up with a sentence."""
    from pipefill import PDInfo
    from pipefill.base.platform import free_port
    from pipefill.disagg.launch import write_secret_file
    from test_pd_engine import both
    path, (_, want) = deepseek_models["v3"]
    secret, port = write_secret_file(str(tmp_path)), free_port()
    common = dict(dtype="float32", page_size=PAGE, threads_per_stage=1, chunked_prefill_size=32,
                  max_total_tokens=4096, cluster_secret_file=secret)
    with track(Engine(path, disaggregation_mode="prefill", pp_size=2,
                      disaggregation_bootstrap_port=port, **common)) as prefill, \
            track(Engine(path, disaggregation_mode="decode", **common)) as decode:
        room = [PDInfo(7, "127.0.0.1", port)]
        first, outs, _ = both(lambda: prefill.generate([PROMPT], max_new_tokens=16, pd=room),
                              lambda: decode.generate([PROMPT], max_new_tokens=16, pd=room,
                                                      ignore_eos=True))
        assert not isinstance(first, Exception), first
        assert not isinstance(outs, Exception), outs
        assert outs[0].output_ids == want
        # A decode whose latent layout (kv_lora_rank 17, not 21) or dtype differs from the
        # prefill's is refused at start-up with a sentence.
        other = save_deepseek("v3", tmp_path / "rank17", kv_lora_rank=17)
        for model, dtype in ((other, "float32"), (path, "bfloat16")):
            with pytest.raises(Exception, match="must agree on the latent layout"):
                track(Engine(model, disaggregation_mode="decode",
                             disaggregation_prefill_bootstrap=f"127.0.0.1:{port}",
                             **{**common, "dtype": dtype}))
