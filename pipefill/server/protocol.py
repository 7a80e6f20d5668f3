"""OpenAI request bodies, validated strictly (wrong types are a 400, not a silent coercion);
unknown fields are accepted and ignored, as OpenAI clients send many.

The bounds in the published schema (`_doc`) are documentation: the checks themselves live in
SamplingParams.validate, check_prompt and the server's make_job, which word their own 400s."""
from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 16  # StopChecker looks for every stop string after every token
MAX_STOP_CHARS = 256
MAX_JSON_DEPTH = 64  # ours need 5; json.loads recurses per level (RecursionError near 1,000)


def loads_body(raw: bytes) -> Any:
    """Strict JSON: UTF-8, nesting bounded before parsing, no NaN/Infinity (literals, or
    numbers too large for a float). ValueError with a sentence."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the request body is not valid UTF-8: {e}") from None
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"the request body nests {depth} levels deep; at most "
                         f"{MAX_JSON_DEPTH} are accepted")
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise ValueError(f"the request body is not valid JSON: {e}") from None


def _no_constant(name: str):
    raise ValueError(f"the request body contains {name}, which is not a JSON number; "
                     "send finite numbers only")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"the number {literal[:40]} in the request body is too large for a "
                         "float; send finite numbers only")
    return value


_ESCAPES = re.compile(r"\\.", re.S)
_STRINGS = re.compile(r'"[^"]*"')  # after escapes are gone; linear: one unmatched quote at most
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def json_depth(text: str) -> int:
    """The deepest nesting of brackets outside strings, without recursion (regexes and one
    cumulative sum: a 10 MB body takes milliseconds)."""
    bare = _STRINGS.sub("", _ESCAPES.sub("", text)).encode("utf-8", "replace")
    steps = bare.translate(None, _NOT_BRACKETS).translate(_STEPS)
    if not steps:
        return 0
    steps = np.frombuffer(steps, dtype=np.int8)
    return int(np.cumsum(steps, dtype=np.int64).max())


def _doc(description: str, **bounds: Any) -> Any:
    return {"description": description, "json_schema_extra": bounds}


_STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = Field(None, **_doc("Tokens to generate at most", minimum=1))
    temperature: float = Field(1.0, **_doc("0 = greedy", minimum=0))
    top_p: float = Field(1.0, **_doc("Nucleus mass", exclusiveMinimum=0, maximum=1))
    top_k: int = Field(-1, **_doc("-1 = the whole vocabulary; 0 is not allowed", minimum=-1))
    seed: int | None = None
    stop: str | list[str] | None = Field(None, **_doc(
        f"Up to {MAX_STOP_STRINGS} stop strings of up to {MAX_STOP_CHARS} characters",
        maxItems=MAX_STOP_STRINGS, maxLength=MAX_STOP_CHARS))
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, **_doc("Choices per request: only 1", minimum=1, maximum=1))
    ignore_eos: bool = False
    priority: int = Field(0, **_doc("With --schedule-policy priority: larger is served first "
                                    "(64-bit)"))

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, **_doc("Tokens to generate at most", minimum=1))
    logprobs: int | None = Field(None, **_doc("Top logprobs per token", minimum=0, maximum=20))
    echo: bool = False


class ContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, **_doc("Overrides max_tokens", minimum=1))
    logprobs: bool = False
    top_logprobs: int | None = Field(None, **_doc("With logprobs", minimum=0, maximum=20))


class ErrorDetail(BaseModel):
    message: str = Field(description="A sentence that says what is wrong")
    type: str = Field(description="invalid_request_error, authentication_error or server_error")
    param: str | None = None
    code: int = Field(description="The HTTP status")


class ErrorResponse(BaseModel):
    """Every error the API returns, in OpenAI's shape."""
    error: ErrorDetail
