"""The model family registry and interface (pipefill/model/family.py, model/families/): an
unknown architecture is a sentence naming what runs, every known one finds its family, the
weights layout names exactly a checkpoint's tensors, and the KV spec is per layer."""
import json

import pytest
import torch
from safetensors import safe_open

from conftest import FAMILIES, save_tiny_model
from pipefill.kv.cache import stacked_kv_shape
from pipefill.model.families import (FAMILIES as REGISTERED, family_for_gguf,
                                     family_for_hf_config, family_of)
from pipefill.model.family import KVSpec
from pipefill.model.families.llama import LLAMA
from pipefill.model.loader import WeightSource, tensor_names

RUNS = "pipefill runs llama, mistral, qwen2, qwen3"


def test_unknown_model_type_is_a_sentence_naming_what_runs():
    with pytest.raises(ValueError, match=f"unsupported architecture 'gpt2' .*model_type.*{RUNS}"):
        family_for_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_unknown_architectures_without_model_type_are_a_sentence():
    with pytest.raises(ValueError, match=f"unsupported architecture \\['GPT2LMHeadModel'\\] "
                                         f".*architectures.*{RUNS}"):
        family_for_hf_config({"architectures": ["GPT2LMHeadModel"]})


def test_unknown_gguf_architecture_is_a_sentence():
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' in m.gguf is not supported: "
                                         "pipefill runs llama, qwen2, qwen3"):
        family_for_gguf("gpt2", "m.gguf")


def test_a_folder_of_an_unknown_architecture_is_refused_before_reading_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ValueError, match=f"unsupported architecture 'mamba'.*{RUNS}"):
        WeightSource(str(tmp_path))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_known_model_types_and_architectures_find_the_llama_family(model_type):
    assert family_for_hf_config({"model_type": model_type}) is LLAMA
    arch = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    assert family_for_hf_config({"architectures": [arch[model_type] + "ForCausalLM"]}) is LLAMA
    assert family_for_gguf("qwen2", "m.gguf") is LLAMA and LLAMA in REGISTERED


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_layout_names_exactly_the_checkpoint_tensors(tmp_path, family):
    source = WeightSource(save_tiny_model(family, tmp_path))
    cfg = source.config
    assert family_of(cfg) is source.family is LLAMA
    with safe_open(f"{tmp_path}/model.safetensors", framework="pt") as st:
        stored = set(st.keys())
    assert set(tensor_names(cfg, range(cfg.num_layers), True, True)) == stored
    # A stage reads only its own layers.
    middle = tensor_names(cfg, range(1, 3), False, False)
    assert {n.split(".")[2] for n in middle} == {"1", "2"}


def test_kv_spec_reports_each_layers_shape(tmp_path):
    source = WeightSource(save_tiny_model("qwen3", tmp_path))
    specs = source.family.kv_specs(source.config, range(1, 4), torch.bfloat16)
    assert specs == [KVSpec(num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)] * 3
    assert all(s.window is None for s in specs)
    assert sum(s.bytes_per_token for s in specs) == 3 * 2 * 2 * 16 * 2  # layers, K+V, H, D, B
    assert stacked_kv_shape(specs) == (2, 16, torch.bfloat16)


def test_the_cache_refuses_layers_of_different_kv_shapes_with_a_sentence():
    specs = [KVSpec(2, 64, torch.bfloat16), KVSpec(1, 128, torch.bfloat16)]
    with pytest.raises(ValueError, match="keep K/V of 2 shapes.*one shape per stage"):
        stacked_kv_shape(specs)
