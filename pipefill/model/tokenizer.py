"""Tokenizers for Hugging Face folders and GGUF files, behind one small interface.

GGUF byte-level BPE vocabularies are rebuilt from the file's metadata with the pre-tokenizer the
vocabulary was trained with (SmolLM splits digits one by one); other GGUF tokenizer kinds go
through transformers' own GGUF conversion.
"""
from __future__ import annotations

import os

# Pre-tokenizer splits by `tokenizer.ggml.pre`, written from the published tokenizer.json files.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")
_REGEX_PRE = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
              "qwen2": _QWEN2_SPLIT}


NO_TEMPLATE = ("this model has no chat template; use /v1/completions, or start pipefill with "
               "--chat-template FILE")


class Tokenizer:
    """encode / decode / chat template over a transformers fast tokenizer."""

    def __init__(self, hf_tokenizer, eos_token_ids: tuple[int, ...]):
        self.hf = hf_tokenizer
        extra_eos = (hf_tokenizer.eos_token_id,) if hf_tokenizer.eos_token_id is not None else ()
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids + extra_eos))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not self.has_chat_template:
            raise ValueError(NO_TEMPLATE)
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template writes the special tokens itself: add none on top.
        return self.hf.encode(self.apply_chat_template(messages), add_special_tokens=False)


def load_tokenizer(source, chat_template: str | None = None) -> Tokenizer | None:
    """Tokenizer of a WeightSource; None for a folder without tokenizer files (token-id
    prompts still work). chat_template: a template file (--chat-template) that replaces the
    model's own."""
    tok = _load_tokenizer(source)
    if tok is not None and chat_template is not None:
        tok.hf.chat_template = read_chat_template(chat_template)
    return tok


def read_chat_template(path: str) -> str:
    """The text of a --chat-template file, or a ValueError naming the flag."""
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--chat-template {path}: cannot read it ({e.strerror})") from None


def _load_tokenizer(source) -> Tokenizer | None:
    model_file, eos_token_ids = source.path, source.config.eos_token_ids
    if source.gguf is not None:
        return Tokenizer(_gguf_tokenizer(source.gguf), eos_token_ids)
    names = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(model_file, n)) for n in names):
        return None
    from transformers import AutoTokenizer
    return Tokenizer(AutoTokenizer.from_pretrained(model_file), eos_token_ids)


def _gguf_tokenizer(f):
    if f.field("tokenizer.ggml.model") != "gpt2":
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(os.path.dirname(f.path) or ".",
                                             gguf_file=os.path.basename(f.path))
    return _byte_level_bpe(f)


def _byte_level_bpe(f):
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    tokens = f.field("tokenizer.ggml.tokens")
    types = f.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in f.field("tokenizer.ggml.merges")]
    raw = RawTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                  ignore_merges=False))
    pre = f.field("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _REGEX_PRE)
    if pre in _REGEX_PRE:
        raw.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"), byte_level])
    elif pre in _DIGIT_SPLIT_PRE:
        raw.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        raw.pre_tokenizer = byte_level
    raw.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched whole in text, as in the original.
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if kind in (3, 4)]
    raw.add_special_tokens(special)

    def token(key):
        i = f.field(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and i < len(tokens) else None

    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=token("bos_token_id"),
                                  eos_token=token("eos_token_id"),
                                  unk_token=token("unknown_token_id"),
                                  pad_token=token("padding_token_id"))
    tok.chat_template = f.field("tokenizer.chat_template")
    if f.field("tokenizer.ggml.add_bos_token", False) and tok.bos_token_id is not None:
        bos = tok.bos_token
        from tokenizers import processors
        raw_post = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                 special_tokens=[(bos, tok.bos_token_id)])
        tok.backend_tokenizer.post_processor = raw_post
    return tok
