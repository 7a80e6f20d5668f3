"""Checks of what a PD decode takes from outside: the bootstrap fields of a request body, the
prefill's answer to a lookup (PrefillInfo) and a room's final metadata (FinalMeta). A peer that
answers garbage must cost the one request a sentence, never the stage that reads it: every
check raises ValueError with a sentence naming the bad field.

msgspec already checked the types of the messages' fields; these checks are about values."""
from __future__ import annotations

import functools
import math
import re

from pipefill.disagg import messages as m
from pipefill.disagg.heads import MAX_KV_HEADS, check_head_map, head_map_of

MAX_HOST_CHARS = 253  # the longest DNS name
# A DNS name, an IPv4 address or an IPv6 address (bracketed or not): no spaces, no control
# characters, nothing a resolver or a log line would take for something else.
_HOST = re.compile(r"^\[?[A-Za-z0-9._:-]+\]?$")
MAX_PREFILL_STAGES = 1024  # a decode opens one connection per prefill stage it overlaps
MAX_SAMPLING_STATE_BYTES = 4  # the prefill sends the request's 4-byte seed (roles.py)


# ---- the request body ----------------------------------------------------------------------

def check_host(host, what: str) -> str:
    """host, if it is a plausible host name or address."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"{what} must be a non-empty host name or address, got {host!r:.80}")
    if len(host) > MAX_HOST_CHARS or not _HOST.match(host):
        raise ValueError(f"{what} {host!r:.80} is not a host name or address (letters, digits, "
                         f"'.', '-', ':' and at most {MAX_HOST_CHARS} characters)")
    return host


def check_port(port, what: str) -> int:
    """port, if it is an integer TCP port (1-65535)."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"{what} must be a TCP port (an integer from 1 to 65535), "
                         f"got {port!r:.80}")
    return port


@functools.lru_cache(maxsize=8)  # the flag's one value, parsed once, not per request
def parse_bootstraps(value: str | None) -> frozenset[tuple[str, int]] | None:
    """--disaggregation-prefill-bootstrap "HOST:PORT[,HOST:PORT...]" as a set of (host, port);
    None when the flag was not given."""
    if value is None:
        return None
    allowed = set()
    for item in value.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--disaggregation-prefill-bootstrap {value!r}: expected "
                             f"HOST:PORT[,HOST:PORT...], got {item.strip()!r}")
        allowed.add((check_host(host, "--disaggregation-prefill-bootstrap host").lower(),
                     check_port(int(port), "--disaggregation-prefill-bootstrap port")))
    return frozenset(allowed)


def check_allowed(host: str, port: int, allowed: frozenset[tuple[str, int]] | None) -> None:
    """A decode started with --disaggregation-prefill-bootstrap takes KV from those prefills
    only: any other bootstrap named by a request could be anyone's."""
    if allowed is not None and (host.lower(), port) not in allowed:
        names = ", ".join(f"{h}:{p}" for h, p in sorted(allowed))
        raise ValueError(f"bootstrap {host}:{port} is not a prefill this decode pairs with "
                         f"(--disaggregation-prefill-bootstrap {names})")


# ---- PrefillInfo ------------------------------------------------------------------------------

def check_prefill_info(info: m.PrefillInfo, num_layers: int) -> list[m.RegisterStage]:
    """The prefill's stages sorted by rank, if the answer describes one whole pipeline: ranks
    0..n-1 once each with the same pipeline size, reachable endpoints, positive shapes and
    layers that tile [0, num_layers)."""
    stages = info.stages
    if not stages:
        raise ValueError("it lists no prefill stage")
    if len(stages) > MAX_PREFILL_STAGES:
        raise ValueError(f"it lists {len(stages)} prefill stages (at most "
                         f"{MAX_PREFILL_STAGES} are taken)")
    ranks = sorted(s.rank for s in stages)
    if ranks != list(range(len(stages))):
        raise ValueError(f"its stage ranks {ranks[:16]} are not 0..{len(stages) - 1} once each")
    stages = sorted(stages, key=lambda s: s.rank)
    for s in stages:
        _check_stage(s, len(stages))
        _check_agrees(s, stages[0])
    check_tiling(stages, num_layers)
    return stages


def _check_stage(s: m.RegisterStage, n: int) -> None:
    if s.pp_size != n:
        raise ValueError(f"stage {s.rank} says the prefill has {s.pp_size} stages, the answer "
                         f"lists {n}")
    check_host(s.endpoint.host, f"stage {s.rank}'s host")
    check_port(s.endpoint.port, f"stage {s.rank}'s port")
    for name in ("page_size", "num_kv_heads", "head_dim", "num_layers"):
        if getattr(s, name) <= 0:
            raise ValueError(f"stage {s.rank}'s {name} is {getattr(s, name)}, not positive")
    if s.num_kv_heads > MAX_KV_HEADS:
        raise ValueError(f"stage {s.rank}'s num_kv_heads is {s.num_kv_heads} (at most "
                         f"{MAX_KV_HEADS} are taken)")
    check_head_map(head_map_of(s.kv_heads, s.num_kv_heads), s.num_kv_heads,
                   f"stage {s.rank}'s kv_heads")
    latent = s.kv_latent
    if latent and (len(latent) != 3 or min(latent) <= 0 or latent[0] != latent[1] + latent[2]):
        raise ValueError(f"stage {s.rank}'s kv_latent {latent!r:.40} is not [latent_dim, "
                         "kv_lora_rank, rope] with latent_dim = kv_lora_rank + rope")


def _check_agrees(s: m.RegisterStage, first: m.RegisterStage) -> None:
    """Every stage describes the same model and KV pages (the decode checks stage 0's against
    its own)."""
    for name in ("model_fingerprint", "num_layers", "page_size", "kv_dtype", "kv_layout",
                 "backend", "num_kv_heads", "head_dim", "kv_latent", "kv_heads"):
        if getattr(s, name) != getattr(first, name):
            raise ValueError(f"stage {s.rank}'s {name} {getattr(s, name)!r:.40} differs from "
                             f"stage 0's {getattr(first, name)!r:.40}")


def check_tiling(stages: list[m.RegisterStage], num_layers: int) -> None:
    """The stages' layer ranges, in rank order, cover [0, num_layers) without gap or overlap."""
    edge = 0
    for s in stages:
        if s.layer_start != edge or s.layer_end <= s.layer_start:
            raise ValueError(f"the prefill stages' layers do not tile the model: stage "
                             f"{s.rank} has [{s.layer_start}, {s.layer_end}), expected to "
                             f"start at {edge}")
        edge = s.layer_end
    if edge != num_layers:
        raise ValueError(f"the prefill stages cover {edge} of the model's {num_layers} layers")


# ---- FinalMeta -------------------------------------------------------------------------------

def check_final_meta(f: m.FinalMeta, *, vocab_size: int, num_prompt_tokens: int,
                     logprobs: int | None) -> None:
    """The first token and its logprobs, if this request can continue from them: a token id
    inside the vocabulary, the request's prompt length, and logprobs shaped as the request
    asked (logprobs: None, or the number of top alternatives)."""
    if f.num_prompt_tokens != num_prompt_tokens:
        raise ValueError(f"its final metadata is for a {f.num_prompt_tokens}-token prompt, this "
                         f"request's has {num_prompt_tokens} tokens")
    _check_token(f.first_token, vocab_size, "first token")
    if logprobs is None:
        if f.logprob is not None or f.top_logprobs is not None:
            raise ValueError("it sent logprobs this request did not ask for")
    else:
        _check_logprob(f.logprob, "the first token's logprob")
        top = f.top_logprobs if f.top_logprobs is not None else []
        if len(top) != logprobs:
            raise ValueError(f"it sent {len(top)} top logprobs, this request asked for "
                             f"{logprobs}")
        for token, logprob in top:
            _check_token(token, vocab_size, "top-logprob token")
            _check_logprob(logprob, f"the top logprob of token {token}")
    if f.sampling_state is not None and len(f.sampling_state) > MAX_SAMPLING_STATE_BYTES:
        raise ValueError(f"its sampling state is {len(f.sampling_state)} bytes, not a "
                         f"{MAX_SAMPLING_STATE_BYTES}-byte seed")


def _check_token(token: int, vocab_size: int, what: str) -> None:
    if not 0 <= token < vocab_size:
        raise ValueError(f"its {what} {token} is outside the vocabulary [0, {vocab_size})")


def _check_logprob(value: float | None, what: str) -> None:
    # A log-softmax is never above 0; rounding may leave a hair over it.
    if value is None or math.isnan(value) or value > 1e-3:
        raise ValueError(f"{what} is {value}, not a log-probability")
