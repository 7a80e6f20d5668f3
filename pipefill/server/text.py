"""Turning streamed token ids into text: incremental detokenization (a multi-byte character
split over tokens is held back until complete) and stop strings (text that may be the start of
a stop string is held back until it is not)."""
from __future__ import annotations


class IncrementalDecoder:
    """Decodes a growing list of token ids and returns only the new, complete text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # decoding starts a few tokens back: merges change spacing
        self.read_offset = 0  # text up to here has been returned

    def push(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is left at the end, incomplete characters included."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


class StopChecker:
    """Finds the first stop string in the generated text; never emits text past it."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit now."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        self.held += text
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.held = self.held[:min(hits)], ""
            return out
        keep = max((k for s in self.stops for k in range(1, len(s))
                    if self.held.endswith(s[:k])), default=0)
        out = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


def longest_token_bytes(tokenizer) -> int:
    """The most prompt bytes one token can stand for: the longest vocabulary entry in UTF-8
    (byte-level BPE writes one character per byte, so this over-counts, which is the safe
    side). A prompt longer than max_model_len times this is too long without tokenizing it."""
    get_vocab = getattr(getattr(tokenizer, "hf", None), "get_vocab", None)
    vocab = get_vocab() if get_vocab is not None else {}
    return max((len(token.encode("utf-8", "replace")) for token in vocab), default=64)


class TokenLogprobs:
    """The logprobs of a response's tokens (with echo, the prompt's first), kept once and
    written in both OpenAI shapes; a stream hands out the entries it has not sent yet."""

    def __init__(self):
        self.entries: list[tuple[str, float | None, dict[str, float] | None, int]] = []
        self.num_chars = 0  # text_offset of the next token
        self.num_sent = 0

    def add(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.entries.append((token, logprob, top, self.num_chars))
        self.num_chars += len(token)

    def unsent(self) -> list:
        entries, self.num_sent = self.entries[self.num_sent:], len(self.entries)
        return entries

    @staticmethod
    def completion(entries: list) -> dict:
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}

    @staticmethod
    def chat(entries: list) -> dict:
        return {"content": [
            {"token": t, "logprob": x, "bytes": list(t.encode()),
             "top_logprobs": [{"token": k, "logprob": v, "bytes": list(k.encode())}
                              for k, v in (top or {}).items()]}
            for t, x, top, _ in entries]}
