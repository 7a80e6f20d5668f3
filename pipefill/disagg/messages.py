"""The typed control plane of PD disaggregation: every message between a prefill stage, the
bootstrap service and a decode stage is one of the Structs below, encoded as msgpack with its tag
and decoded against the union of them. A foreign or malformed message fails to decode and is
dropped (and logged, rate-limited), never unpickled.

  prefill stage -> bootstrap : RegisterStage                       -> Ack
  decode        -> bootstrap : Lookup                              -> PrefillInfo | NotReady
  decode stage  -> prefill stage (one TCP connection per pair, both directions):
      DecodeHello (once), RoomBootstrap, DropRoom, Heartbeat
  prefill stage -> decode stage:
      KVChunk (+ raw page bytes with tcp; a notice after the one-sided writes with mooncake),
      FinalMeta, RoomFailed, DropAck, Heartbeat
  prefill front end -> prefill stage: RejectRoom (its own connection, no hello): the HTTP
      server refused the room's request, so the stage answers the room's decodes at once

A room is one request attempt (the router's bootstrap_room, a u64 < 2^63); the decode adds a
random nonce per attempt, echoed by every KVChunk and FinalMeta, so nothing from an earlier
attempt with the same room id can be taken for this one.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, is_dataclass
from typing import Union

import msgspec

log = logging.getLogger(__name__)


class _Msg(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


class Endpoint(msgspec.Struct, array_like=True, frozen=True):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class RegisterStage(_Msg):
    rank: int
    pp_size: int
    layer_start: int  # global layer ids [layer_start, layer_end) of this stage
    layer_end: int
    num_layers: int  # of the whole model
    endpoint: Endpoint  # where decode stages connect for this stage's KV
    page_size: int
    kv_dtype: str  # "bfloat16", "float32", ...
    num_kv_heads: int
    head_dim: int
    model_fingerprint: str
    backend: str  # "tcp" | "mooncake"
    kv_layout: str = "token-major"  # or "amx-packed": pages are moved as opaque bytes
    # A latent-attention model's pages: [latent_dim, kv_lora_rank, qk_rope_head_dim] values a
    # token and layer (latent_layout); [] for per-head keys and values.
    kv_latent: list[int] = []
    # The stage's TP ranks' KV heads (disagg/heads.py): [[0, 1], [2]] for 3 KV heads at TP 2;
    # []: one rank with all num_kv_heads (the model's).
    kv_heads: list[list[int]] = []
    # The stage's layers whose KV lives in window pages (ARCHITECTURE.md, 'Window pages'): they
    # cross only for the pages the decode's window table names; []: every layer's every page.
    window_layers: list[int] = []


class Ack(_Msg):
    ok: bool
    error: str = ""
    retry: bool = False  # a refusal that may pass later (a restarted stage's old self lingers)


class Lookup(_Msg):
    pass


class PrefillInfo(_Msg):
    stages: list[RegisterStage]


class NotReady(_Msg):
    reason: str


class DecodeHello(_Msg):
    """First message of a decode stage on its connection to a prefill stage."""
    decode_id: str  # unique per decode stage process, for logs and the prefill's peer table
    layer_start: int
    layer_end: int
    page_bytes: int  # bytes of one page of one layer of K (or V), every KV head of the model
    mooncake_session: str = ""  # "host:rpc_port" of the decode's Mooncake engine
    k_ptrs: list[int] = []  # per decode layer: base address of its registered K (mooncake)
    v_ptrs: list[int] = []
    # mooncake: pages per layer behind each pointer, and the registered staging region: the
    # prefill writes nowhere else.
    kv_pages: int = 0
    staging_base: int = 0
    staging_bytes: int = 0
    # The decode stage's TP ranks' KV heads (as RegisterStage's): what each rank's pages hold,
    # the order of the pages' bytes in a chunk, and of k_ptrs/v_ptrs (rank after rank).
    kv_heads: list[list[int]] = []
    num_kv_heads: int = 0  # of the decode's model (0: not said)
    window_layers: list[int] = []  # as RegisterStage's, the decode stage's
    # mooncake, with window layers: per window layer (rank after rank), the base address of
    # its registered window K and V, and the window pages behind each ('Window pages');
    # k_ptrs/v_ptrs then hold the other layers only.
    window_k_ptrs: list[int] = []
    window_v_ptrs: list[int] = []
    window_kv_pages: int = 0


class RoomBootstrap(_Msg):
    room: int
    nonce: int  # the decode's id for this attempt of the room
    dst_pages: list[int]  # the decode's page ids for the prompt's pages, in order
    expected_bootstraps: int  # decode stages that will bootstrap this prefill stage for the room
    staging_addr: int = 0  # mooncake: the room's staging region for this stage's layers (0: none)
    # With window layers (RegisterStage.window_layers): the decode's window page for each of
    # dst_pages, -1 where it keeps none; the prefill sends those pages' window layers only.
    dst_window_pages: list[int] = []


class KVChunk(_Msg):
    """Pages [page_offset, page_offset + num_pages) of the request, layers [layer_start,
    layer_end): with tcp, nbytes of page data follow, per layer K then V, per decode TP rank
    (DecodeHello.kv_heads) its pages in order, each with that rank's heads."""
    room: int
    nonce: int
    rank: int  # prefill stage
    chunk_id: int
    page_offset: int
    num_pages: int
    layer_start: int
    layer_end: int
    nbytes: int
    is_last: bool  # the stage has sent every page of the room
    # The request's pages whose window layers' K/V follow the other layers' (last chunk only:
    # exactly the pages of the room's dst_window_pages that are not -1).
    window_pages: list[int] = []


class FinalMeta(_Msg):
    """What decode needs to continue where a colocated server would: the first output token."""
    room: int
    nonce: int
    num_prompt_tokens: int
    first_token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    sampling_state: bytes | None = None  # e.g. the request's generator state, raw bytes


class RoomFailed(_Msg):
    room: int
    nonce: int
    rank: int
    reason: str
    # The HTTP status the decode answers with: 4xx when the prefill refused the request itself
    # (the client's fault: the router does not retry it), 5xx for a fault. Last and defaulted,
    # so a RoomFailed without it still decodes (as a fault).
    status: int = 500


class RejectRoom(_Msg):
    """The prefill's HTTP server refused the request of this room with this status and
    sentence; the request never reached the stages."""
    room: int
    status: int
    reason: str


class DropRoom(_Msg):
    room: int
    nonce: int
    reason: str


class DropAck(_Msg):
    room: int
    nonce: int
    rank: int


class Heartbeat(_Msg):
    sender: str
    rooms: list[int] = []  # rooms the sender holds and is working on (keeps them alive)


Message = Union[RegisterStage, Ack, Lookup, PrefillInfo, NotReady, DecodeHello, RoomBootstrap,
                KVChunk, FinalMeta, RoomFailed, RejectRoom, DropRoom, DropAck, Heartbeat]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message | None:
    """The message, or None (logged) for anything that is not one of ours."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        log.debug("not a disaggregation message: %s", e)
        return None


def latent_layout(model_config) -> list[int]:
    """What a latent-attention (MLA) model's KV pages hold per token and layer:
    [latent_dim, kv_lora_rank, qk_rope_head_dim]; [] for a model with per-head K and V."""
    mla = getattr(model_config, "mla", None)
    return [] if mla is None else [mla.latent_dim, mla.kv_lora_rank, mla.qk_rope_head_dim]


def describe_kv(latent: list[int], kv_dtype: str) -> str:
    """A sentence's words for a side's KV pages (latent_layout and dtype)."""
    if not latent:
        return f"per-head keys and values in {kv_dtype}"
    return (f"a latent of {latent[0]} {kv_dtype} values a token (kv_lora_rank {latent[1]} + "
            f"rope {latent[2]})")


def model_fingerprint(model_config) -> str:
    """A short hash of the architecture facts (a dataclass or dict): prefill and decode must run
    the same model. It does not hash the weights: two checkpoints of one architecture match."""
    d = asdict(model_config) if is_dataclass(model_config) else dict(model_config)
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
