"""The registry of model families: which family runs a config.json or a GGUF file.

Adding a family is one file in this folder (a ModelFamily subclass, see model/family.py) and
its instance in FAMILIES (ARCHITECTURE.md, 'Model families')."""
from __future__ import annotations

from pipefill.model.config import ModelConfig
from pipefill.model.family import ModelFamily
from pipefill.model.families.deepseek import DEEPSEEK
from pipefill.model.families.gemma3 import GEMMA3
from pipefill.model.families.llama import LLAMA
from pipefill.model.families.moe import MOE

FAMILIES: tuple[ModelFamily, ...] = (LLAMA, MOE, GEMMA3, DEEPSEEK)


def supported_names() -> str:
    """Every model_type the families run, for error sentences."""
    return ", ".join(t for f in FAMILIES for t in f.hf_model_types)


def family_for_hf_config(hf: dict) -> ModelFamily:
    """The family of a config.json: by model_type, else by its architectures."""
    model_type = hf.get("model_type") or ""
    architectures = hf.get("architectures") or []
    for family in FAMILIES:
        if model_type in family.hf_model_types:
            return family
        if not model_type and set(architectures) & set(family.hf_architectures):
            return family
    named = (f"{model_type!r} (config.json's model_type)" if model_type else
             f"{architectures} (config.json's architectures, no model_type)")
    raise ValueError(f"unsupported architecture {named}: pipefill runs {supported_names()}")


def family_for_gguf(arch: str, path: str, experts: bool = False) -> ModelFamily:
    """The family of a GGUF file by its general.architecture and, where two families list it
    (llama.cpp writes Mixtral as "llama"), whether the file has experts."""
    found = [f for f in FAMILIES if arch in f.gguf_architectures]
    for family in found:
        if len(found) == 1 or family.gguf_experts == experts:
            return family
    runs = ", ".join(a for f in FAMILIES for a in f.gguf_architectures)
    raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported: pipefill runs "
                     f"{runs}")


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family a ModelConfig was read by (its model_type)."""
    for family in FAMILIES:
        if cfg.model_type in family.hf_model_types:
            return family
    raise ValueError(f"unsupported architecture {cfg.model_type!r}: pipefill runs "
                     f"{supported_names()}")
