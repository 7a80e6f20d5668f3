"""Loading a stage tensor by tensor: the same bits as converting the whole stage from float32,
without the stage ever being resident in float32.

* Every weight (and every packed decode copy) equals the previous recipe's bit for bit: all
  tensors read as float32, torch.cat per fused matrix, then .to(weight_dtype).to(dtype);
  safetensors folders of each family with tiny row blocks (so every matrix is read in many
  blocks, the last one short), and the default GGUF (its embedding read in 16 MiB blocks).
* A stage model's logits on these weights equal those on the reference weights.
* A subprocess loads a 45M-parameter model in bf16: its peak RSS grows by less than the
  float32 size of the weights (measured: 106 MiB against 173; the old loader, float32 stage
  and bf16 stage at once: 344), and packing the decode copies grows it by the packed bytes
  and a few MiB only (measured: 56.6 MiB for 55.6 packed; the old packer, a padded and then
  a permuted copy of each matrix, 87: the LM head's extra copy is 31 MiB).
"""
import json
import subprocess
import sys

import pytest
import torch

from conftest import FAMILIES, save_tiny_model
from pipefill.kernels.decode_gemm import BLOCK, pack_weight
from pipefill.model import loader
from pipefill.model.attention import SeqMeta
from pipefill.model.stage_model import ForwardMeta, StageModel
from pipefill.model.loader import WeightSource, load_stage_weights, resolve_model_path

DTYPES = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)]
SPLITS = [(range(0, 4), True, True), (range(0, 2), True, False), (range(2, 4), False, True)]


def reference_weights(source, layers, first, last, dtype, weight_dtype):
    """The previous loader: the whole stage as float32 first, then one conversion per matrix
    -> {field path: tensor}."""
    cfg = source.config

    def mat(*names):
        m = torch.cat([source.load(n) for n in names])
        if weight_dtype is not None and weight_dtype != dtype:
            m = m.to(weight_dtype)
        return m.to(dtype).contiguous()

    out = {}
    for i in layers:
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out |= {f"{i}.input_norm": source.load(p + "input_layernorm.weight"),
                f"{i}.qkv": mat(*(a + f"{x}_proj.weight" for x in "qkv")),
                f"{i}.o_proj": mat(a + "o_proj.weight"),
                f"{i}.post_norm": source.load(p + "post_attention_layernorm.weight"),
                f"{i}.gate_up": mat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                f"{i}.down": mat(p + "mlp.down_proj.weight")}
        if cfg.attention_bias:
            out[f"{i}.qkv_bias"] = mat(*(a + f"{x}_proj.bias" for x in "qkv"))
        if cfg.qk_norm:
            out[f"{i}.q_norm"] = source.load(a + "q_norm.weight")
            out[f"{i}.k_norm"] = source.load(a + "k_norm.weight")
    if first:
        out["embed"] = mat("model.embed_tokens.weight")
    if last:
        out["final_norm"] = source.load("model.norm.weight")
        tied = cfg.tie_word_embeddings or not source.has("lm_head.weight")
        out["lm_head"] = mat("model.embed_tokens.weight" if tied else "lm_head.weight")
    return out


def flat(w, layers) -> dict:
    out = {}
    for i, layer in zip(layers, w.layers):
        out |= {f"{i}.{f}": getattr(layer, f) for f in layer.__dataclass_fields__
                if f != "packed" and getattr(layer, f) is not None}
    out |= {k: getattr(w, k) for k in ("embed", "final_norm", "lm_head")
            if getattr(w, k) is not None}
    return out


def assert_same_bits(ours: dict, ref: dict):
    assert ours.keys() == ref.keys()
    for name, t in ours.items():
        r = ref[name]
        assert (t.dtype, t.shape) == (r.dtype, r.shape), name
        assert t.is_contiguous(), name
        # Compare bit patterns (NaN-safe, and -0.0 != 0.0).
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]
        assert torch.equal(t.view(bits), r.view(bits)), name


def old_pack_weight(weight, weight_dtype):
    """pack_weight as it was: a zero-padded copy, then a permuted contiguous copy."""
    n, k = weight.shape
    nb, kp = -(-n // BLOCK), k + (k & 1)
    w = torch.zeros(nb * BLOCK, kp, dtype=weight_dtype)
    w[:n, :k] = weight
    if weight_dtype == torch.float32:
        return w.view(nb, BLOCK, kp).permute(0, 2, 1).contiguous()
    return w.view(nb, BLOCK, kp // 2, 2).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_weights_equal_the_float32_recipe(tmp_path, monkeypatch, family):
    source = WeightSource(save_tiny_model(family, tmp_path))
    # 5 float32 rows of 64 columns a block: vocab 512 and 192/96-row matrices end short.
    monkeypatch.setattr(loader, "ROW_BLOCK_BYTES", 5 * 64 * 4)
    assert len(source.row_blocks("model.embed_tokens.weight", (512, 64))) == 103
    for dtype, weight_dtype in DTYPES:
        for layers, first, last in SPLITS:
            w = load_stage_weights(source, layers, first, last, dtype, weight_dtype=weight_dtype)
            ref = reference_weights(source, layers, first, last, dtype, weight_dtype)
            assert_same_bits(flat(w, layers), ref)
            if first and last and source.config.tie_word_embeddings:
                assert w.lm_head is w.embed  # one tensor, as before


def test_default_gguf_stage_equals_the_float32_recipe():
    """Q8_0 embedding read in 16 MiB row blocks, Q4_1 matrices, llama q/k row reorder."""
    source = WeightSource(resolve_model_path(None))
    shape = source.shape("model.embed_tokens.weight")
    assert len(source.row_blocks("model.embed_tokens.weight", shape)) > 1
    layers = range(0, 2)
    w = load_stage_weights(source, layers, True, True, torch.bfloat16)
    assert_same_bits(flat(w, layers),
                     reference_weights(source, layers, True, True, torch.bfloat16, None))


def test_packed_copies_equal_the_padded_recipe():
    torch.manual_seed(0)
    for n, k in ((96, 64), (100, 64), (96, 63), (47, 5), (1, 1), (200, 130)):
        for src in (torch.float32, torch.bfloat16):
            for wd in (torch.float32, torch.bfloat16):
                w = torch.randn(n, k).to(src)
                ours, ref = pack_weight(w, wd), old_pack_weight(w, wd)
                assert ours.is_contiguous() and ours.shape == ref.shape, (n, k, src, wd)
                assert torch.equal(ours, ref), (n, k, src, wd)


def prefill_logits(cfg, weights, dtype, tokens):
    model = StageModel(cfg, 0, weights, dtype)
    n = len(tokens)
    cache = [torch.zeros(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
             for _ in range(2)]
    meta = ForwardMeta(torch.arange(n), [SeqMeta(0, n, 0, slice(0, n), slice(0, n),
                                                 torch.zeros(1, dtype=torch.int32))])
    hidden, residual = model.forward(model.embed(torch.tensor(tokens)), None, meta, *cache)
    return model.logits(hidden, residual, torch.arange(n))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logits_equal_on_reference_weights(tmp_path, family):
    from pipefill.model.families.llama import LayerWeights
    from pipefill.model.stage_model import StageWeights
    source = WeightSource(save_tiny_model(family, tmp_path))
    cfg, layers = source.config, range(4)
    ref = reference_weights(source, layers, True, True, torch.bfloat16, None)
    fields = [f for f in LayerWeights.__dataclass_fields__ if f != "packed"]
    ref_w = StageWeights([LayerWeights(**{f: ref.get(f"{i}.{f}") for f in fields})
                          for i in layers], ref["embed"], ref["final_norm"], ref["lm_head"])
    ours = load_stage_weights(source, layers, True, True, torch.bfloat16)
    tokens = [5, 17, 300, 42, 7, 99, 1, 250]
    a = prefill_logits(cfg, ours, torch.bfloat16, tokens)
    b = prefill_logits(cfg, ref_w, torch.bfloat16, tokens)
    assert torch.equal(a, b)


# Runs in a fresh process so that the peak RSS is this load's and nothing else's.
CHILD = r"""
import json, os, sys, torch
from pipefill.bench.memory import proc_status_bytes, reset_peak_rss
from pipefill.kernels.decode_gemm import pack_weight
from pipefill.model.loader import WeightSource, load_stage_weights

pid = os.getpid()
source = WeightSource(sys.argv[1])
if not reset_peak_rss(pid):
    print(json.dumps(None))
    sys.exit()

def growth(build):
    reset_peak_rss(pid)
    before = proc_status_bytes(pid, "VmRSS")
    out = build()
    return out, proc_status_bytes(pid, "VmHWM") - before

cfg = source.config
w, load_peak = growth(lambda: load_stage_weights(source, range(cfg.num_layers), True, True,
                                                 torch.bfloat16))
matrices = [getattr(layer, f) for layer in w.layers for f in ("qkv", "o_proj", "gate_up",
                                                               "down")] + [w.lm_head]
packed, pack_peak = growth(lambda: [pack_weight(m, torch.bfloat16) for m in matrices])
print(json.dumps({"load_peak": load_peak, "pack_peak": pack_peak,
                  "float32_bytes": sum(t.numel() * 4 for t in (*matrices, w.embed)),
                  "packed_bytes": sum(p.nbytes for p in packed)}))
"""


def test_load_and_pack_peak_rss_stay_below_a_float32_stage(tmp_path):
    # 45M parameters (180 MB in float32): the embedding and the untied LM head 16M each.
    path = save_tiny_model("llama", tmp_path, vocab_size=32000, hidden_size=512,
                           intermediate_size=1536, num_attention_heads=8,
                           num_key_value_heads=4)
    proc = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    if m is None:
        pytest.skip("this kernel refuses to reset the peak RSS (/proc/self/clear_refs)")
    mib = {k: round(v / 2**20) for k, v in m.items()}
    # New: bf16 weights (87 MiB) + one 16 MiB float32 block; old: float32 + bf16 stage.
    assert m["load_peak"] < m["float32_bytes"], mib
    # New: the packed copies + one padded 48-row tile; old: + one more LM head (31 MiB).
    assert m["pack_peak"] < m["packed_bytes"] + 12 * 2**20, mib
