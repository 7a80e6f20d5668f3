"""The sections of the configuration: frozen groups of ServerArgs fields, one per concern, each
handed only to the code that needs it.

ServerArgs (config/args.py) holds every flag as the command line spells it. A section takes the
flags of one concern under shorter names, checks them (with sentences that name the flags), and
derives what follows from them: the layer partition, the KV capacity, the PD mode as an enum.
Each is built once per ServerArgs (its cached properties `layout`, `kernels`, `cache`,
`chunking`, `disagg`, `serving`) and never changes; a variation is a new ServerArgs made with
`replace()`, which derives fresh sections.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

from pipefill.base.partition import partition_layers
from pipefill.base.wire import read_cluster_secret


def _at_least(value, low, flag: str, unit: str = "") -> None:
    if value < low:
        raise ValueError(f"{flag} must be at least {low}{unit}, got {value}")


def _positive(value, flag: str) -> None:
    if not value > 0:
        raise ValueError(f"{flag} must be > 0, got {value}")


@dataclass(frozen=True)
class StageInfo:
    """Distributed identity of one stage process, passed in (layers never ask
    torch.distributed): its stage (rank of size), its layers, and its rank inside the stage's
    tensor-parallel group (ARCHITECTURE.md, 'Tensor parallelism inside a stage')."""
    rank: int
    size: int
    layers: range
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def is_tp_leader(self) -> bool:
        """The rank that talks to the other stages and the front end for its stage."""
        return self.tp_rank == 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


@dataclass(frozen=True)
class Layout:
    """Where the model runs: stage processes, nodes, device, compute dtype, and which layers
    each stage owns."""
    pp_size: int
    tp_size: int                # ranks per stage (tensor parallelism)
    nnodes: int
    node_rank: int
    device: str
    dtype: str                  # "auto" until resolve()
    threads_per_stage: int | None
    async_batch_depth: int      # --pp-async-batch-depth
    dist_init_addr: str | None
    dist_init_timeout: int
    ranges: tuple[range, ...]   # the layer partition, one range per stage; () until resolve()

    @staticmethod
    def of(args) -> "Layout":
        # The partition is computed here, once per ServerArgs, and nowhere else
        # (ARCHITECTURE.md, 'Layer partition').
        ranges = () if args.num_layers is None else tuple(
            partition_layers(args.num_layers, args.pp_size, args.pp_layer_partition,
                             args.layer_costs))
        return Layout(args.pp_size, args.tp_size, args.nnodes, args.node_rank, args.device,
                      args.dtype, args.threads_per_stage, args.pp_async_batch_depth,
                      args.dist_init_addr, args.dist_init_timeout, ranges)

    def __post_init__(self) -> None:
        _at_least(self.pp_size, 1, "--pp-size")
        _at_least(self.tp_size, 1, "--tp-size")
        if self.threads_per_stage is not None:
            _at_least(self.threads_per_stage, 1, "--threads-per-stage")
        _at_least(self.dist_init_timeout, 1, "--dist-init-timeout", " second")
        if self.async_batch_depth < 0:
            raise ValueError("--pp-async-batch-depth must be >= 0")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes) = [0, {self.nnodes})")
        if self.tp_size == 1 and self.pp_size % self.nnodes:
            raise ValueError(f"--pp-size {self.pp_size} must be a multiple of --nnodes "
                             f"{self.nnodes}: every node runs the same number of stages")
        if self.world_size % self.nnodes:
            raise ValueError(f"--pp-size x --tp-size = {self.world_size} processes must be a "
                             f"multiple of --nnodes {self.nnodes}: every node runs as many")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT of node 0")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--dist-init-addr {self.dist_init_addr!r}: expected HOST:PORT")

    def stage(self, rank: int, tp_rank: int = 0) -> StageInfo:
        """One stage process's identity and its stage's layer range."""
        assert self.ranges, "resolve() first: the partition needs the model's layer count"
        return StageInfo(rank, self.pp_size, self.ranges[rank], tp_rank, self.tp_size)

    @property
    def world_size(self) -> int:
        """Stage processes in all: pp_size x tp_size."""
        return self.pp_size * self.tp_size

    def global_rank(self, stage: int, tp_rank: int) -> int:
        """A process's rank in the torch.distributed world. The TP leaders are ranks
        0..pp_size-1, so the pipeline between stages addresses stage s as rank s whatever the
        TP size; the other ranks of stage s follow all the leaders."""
        if tp_rank == 0:
            return stage
        return self.pp_size + stage * (self.tp_size - 1) + tp_rank - 1

    def tp_group_ranks(self, stage: int) -> list[int]:
        """Global ranks of stage `stage`'s TP group, its leader first."""
        return [self.global_rank(stage, t) for t in range(self.tp_size)]

    def local_process(self, stage: int, tp_rank: int) -> int:
        """A process's index among this node's processes: the core set it is pinned to."""
        return stage * self.tp_size + tp_rank - self.node_rank * self.processes_per_node

    def gpu_index(self, stage: int, tp_rank: int) -> int:
        """The CUDA device a stage process uses (--device cuda): its index among this node's
        processes (local_process), one GPU each, so a stage's TP ranks take consecutive GPUs
        and stage s of one rank takes GPU s - (the node's first stage)."""
        return self.local_process(stage, tp_rank)

    def check_gpus(self, visible: int) -> None:
        """Refuses a --device cuda layout that needs more GPUs on this node than `visible`
        (torch.cuda.device_count(), which CUDA_VISIBLE_DEVICES narrows)."""
        if self.device == "cuda" and visible < self.processes_per_node:
            raise ValueError(
                f"--device cuda runs {self.processes_per_node} process(es) on this node "
                f"(--pp-size {self.pp_size} x --tp-size {self.tp_size} over --nnodes "
                f"{self.nnodes}), one GPU each, but {visible} GPU(s) are visible here")

    def node_of(self, stage: int, tp_rank: int) -> int:
        """The node that runs a process. The processes, stage by stage and TP rank by TP rank,
        are dealt to the nodes in equal consecutive blocks: a stage's TP ranks share a node
        when --pp-size is a multiple of --nnodes, and are spread over nodes otherwise
        (ARCHITECTURE.md, 'Tensor parallelism inside a stage')."""
        return (stage * self.tp_size + tp_rank) // self.processes_per_node

    def tp_spans_nodes(self, stage: int) -> bool:
        """Whether stage `stage`'s TP ranks run on more than one node (no shared memory)."""
        return len({self.node_of(stage, t) for t in range(self.tp_size)}) > 1

    @property
    def local_processes(self) -> list[tuple[int, int]]:
        """(stage, TP rank) of this node's processes: the stages' TP leaders first, in stage
        order, then the other TP ranks."""
        mine = [(s, t) for s in range(self.pp_size) for t in range(self.tp_size)
                if self.node_of(s, t) == self.node_rank]
        return sorted(mine, key=lambda p: (p[1] > 0, p))

    @property
    def layer_counts(self) -> list[int]:
        assert self.ranges, "resolve() first: the partition needs the model's layer count"
        return [len(r) for r in self.ranges]

    @property
    def local_ranks(self) -> range:
        """Global stage ranks whose TP leader runs on this node (none on a node that runs
        only other TP ranks)."""
        n, tp = self.processes_per_node, self.tp_size
        return range(-(-self.node_rank * n // tp), -(-(self.node_rank + 1) * n // tp))

    @property
    def max_inflight(self) -> int:
        """Micro-batches stage 0 keeps in flight."""
        return self.pp_size + self.async_batch_depth

    @property
    def processes_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def num_threads(self) -> int:
        """CPU threads of one stage process (each TP rank is one)."""
        if self.threads_per_stage is not None:
            return self.threads_per_stage
        return max(1, len(os.sched_getaffinity(0)) // self.processes_per_node)


@dataclass(frozen=True)
class Kernels:
    """Which kernels a stage runs: attention, the prefill and decode GEMMs, the weights' dtype,
    and the CPU flags kernel selection must treat as absent."""
    attention_backend: str
    prefill_gemm: str
    decode_gemm_max_rows: int
    weight_dtype: str
    hide_cpu_flags: str
    mla_prefill_attention: str = "auto"
    gguf_int8_prefill_max_rows: int = -1

    @staticmethod
    def of(args) -> "Kernels":
        return Kernels(args.attention_backend, args.prefill_gemm, args.decode_gemm_max_rows,
                       args.weight_dtype, args.hide_cpu_flags, args.mla_prefill_attention,
                       args.gguf_int8_prefill_max_rows)

    def __post_init__(self) -> None:
        if self.decode_gemm_max_rows < 0:
            raise ValueError("--decode-gemm-max-rows must be >= 0")
        if self.gguf_int8_prefill_max_rows < -1:
            raise ValueError("--gguf-int8-prefill-max-rows must be >= 0, or -1 (the default)")


@dataclass(frozen=True)
class Cache:
    """The KV cache: pages, dtype, capacity, and the prefix-cache tiers (radix tree in the
    pool, host memory, storage)."""
    page_size: int
    kv_cache_dtype: str
    max_total_tokens: int | None
    max_model_len: int | None      # None until resolve()
    radix: bool                    # not --disable-radix-cache
    hierarchical: bool             # --enable-hierarchical-cache (the host tier)
    hicache_ratio: float
    hicache_size: float | None
    storage_backend: str | None    # --hicache-storage-backend
    storage_dir: str | None
    storage_max_gb: float | None
    mooncake_master: str | None
    write_policy: str
    prefetch_timeout: float

    @staticmethod
    def of(args) -> "Cache":
        return Cache(args.page_size, args.kv_cache_dtype, args.max_total_tokens,
                     args.max_model_len, not args.disable_radix_cache,
                     args.enable_hierarchical_cache, args.hicache_ratio, args.hicache_size,
                     args.hicache_storage_backend, args.hicache_storage_dir,
                     args.hicache_storage_max_gb, args.hicache_mooncake_master,
                     args.hicache_write_policy, args.hicache_prefetch_timeout)

    def __post_init__(self) -> None:
        _at_least(self.page_size, 1, "--page-size")
        if self.hierarchical and not self.radix:
            raise ValueError("--enable-hierarchical-cache needs the radix cache: drop "
                             "--disable-radix-cache")
        if self.storage_backend and not self.radix:
            raise ValueError("--hicache-storage-backend needs the radix cache: drop "
                             "--disable-radix-cache")
        if self.storage_backend == "file" and not self.storage_dir:
            raise ValueError("--hicache-storage-backend file needs --hicache-storage-dir")
        if self.storage_backend == "mooncake" and not self.mooncake_master:
            raise ValueError("--hicache-storage-backend mooncake needs "
                             "--hicache-mooncake-master HOST:PORT")
        if self.storage_max_gb is not None and self.storage_max_gb <= 0:
            raise ValueError("--hicache-storage-max-gb must be positive")
        if self.storage_max_gb is not None and self.storage_backend != "file":
            raise ValueError("--hicache-storage-max-gb caps the file storage tier: it needs "
                             "--hicache-storage-backend file (Mooncake sizes its own store)")
        if self.prefetch_timeout < 0:
            raise ValueError("--hicache-prefetch-timeout must be >= 0")
        if self.hicache_ratio <= 0 or (self.hicache_size is not None and self.hicache_size <= 0):
            raise ValueError("--hicache-ratio and --hicache-size must be positive")

    @property
    def storage_on(self) -> bool:
        """Whether the storage tier (L3) runs."""
        return bool(self.storage_backend) and self.radix

    @property
    def capacity_tokens(self) -> int:
        """KV-cache capacity in tokens per stage (--max-total-tokens, or 4 x max_model_len)."""
        assert self.max_model_len is not None, "resolve() first"
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        return max(4 * self.max_model_len, 65536)


@dataclass(frozen=True)
class Chunking:
    """How long prompts are cut: the first chunk size C0, the step budget, dynamic chunking
    (the cost model's smooth factor, its profile and online calibration), and in which order
    the prompts in prefill take their chunks (the schedule policy)."""
    chunked_prefill_size: int | str   # C0, or "auto"
    max_prefill_tokens: int
    dynamic: bool                     # --enable-dynamic-chunking
    smooth_factor: float | None       # from the environment or 0.75 once resolved
    online_calibration: bool
    profile_cache: str | None
    profile: str                      # background or blocking
    tune_input_len: int | None
    schedule_policy: str = "fcfs"     # fcfs, fair or priority (scheduler/prefill_order.py)

    @staticmethod
    def of(args) -> "Chunking":
        return Chunking(args.chunked_prefill_size, args.max_prefill_tokens,
                        args.enable_dynamic_chunking, args.dynamic_chunking_smooth_factor,
                        args.dynamic_chunking_online_calibration,
                        args.dynamic_chunking_profile_cache, args.dynamic_chunking_profile,
                        args.tune_input_len, args.schedule_policy)

    def __post_init__(self) -> None:
        _at_least(self.max_prefill_tokens, 1, "--max-prefill-tokens")
        c0 = self.chunked_prefill_size
        if c0 != "auto" and c0 < 1:
            raise ValueError("--chunked-prefill-size must be at least 1 (or 'auto')")
        sigma = self.smooth_factor
        if sigma is not None and not 0 <= sigma <= 1:
            raise ValueError(f"--dynamic-chunking-smooth-factor must be in [0, 1], got {sigma}")
        if self.profile not in ("background", "blocking"):
            raise ValueError("--dynamic-chunking-profile must be background or blocking, got "
                             f"{self.profile!r}")
        if self.schedule_policy not in ("fcfs", "fair", "priority"):
            raise ValueError(f"--schedule-policy must be fcfs, fair or priority, got "
                             f"{self.schedule_policy!r}")
        if c0 != "auto" and self.max_prefill_tokens < c0:
            raise ValueError(f"--max-prefill-tokens ({self.max_prefill_tokens}) must be at "
                             f"least --chunked-prefill-size ({c0})")


class DisaggMode(enum.Enum):
    """--disaggregation-mode: a colocated server, or one role of a prefill/decode pair."""
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Disaggregation:
    """Prefill/decode disaggregation: the role, its endpoints, the shared secret (or the
    explicit choice to run without one) and its timeouts."""
    mode: DisaggMode
    bootstrap_port: int
    transfer_backend: str
    prefill_bootstrap: str | None   # a decode's allowed prefills, HOST:PORT[,HOST:PORT...]
    cluster_secret: str | None = field(repr=False)
    cluster_secret_file: str | None
    insecure: bool                  # --disaggregation-insecure
    waiting_timeout: float
    bootstrap_timeout: float
    room_claim_timeout: float
    heartbeat_interval: float
    heartbeat_max_misses: int
    connect_timeout: float

    @staticmethod
    def of(args) -> "Disaggregation":
        return Disaggregation(
            DisaggMode(args.disaggregation_mode), args.disaggregation_bootstrap_port,
            args.disaggregation_transfer_backend, args.disaggregation_prefill_bootstrap,
            args.cluster_secret, args.cluster_secret_file, args.disaggregation_insecure,
            args.disaggregation_waiting_timeout, args.disaggregation_bootstrap_timeout,
            args.disaggregation_room_claim_timeout, args.disaggregation_heartbeat_interval,
            args.disaggregation_heartbeat_max_misses, args.disaggregation_connect_timeout)

    def __post_init__(self) -> None:
        for flag, value in (("waiting-timeout", self.waiting_timeout),
                            ("bootstrap-timeout", self.bootstrap_timeout),
                            ("room-claim-timeout", self.room_claim_timeout),
                            ("heartbeat-interval", self.heartbeat_interval),
                            ("heartbeat-max-misses", self.heartbeat_max_misses),
                            ("connect-timeout", self.connect_timeout)):
            _positive(value, f"--disaggregation-{flag}")
        if not 0 < self.bootstrap_port < 65536:
            raise ValueError("--disaggregation-bootstrap-port must be a TCP port (1-65535)")
        bootstraps = self.prefill_bootstrap
        for item in bootstraps.split(",") if bootstraps is not None else ():
            host, _, port = item.strip().rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--disaggregation-prefill-bootstrap {bootstraps!r}: expected "
                                 "HOST:PORT[,HOST:PORT...] with ports 1-65535")
        if self.enabled and not self.has_secret and not self.insecure:
            raise ValueError(
                f"--disaggregation-mode {self.mode.value} needs the deployment's shared "
                "secret: give both PD servers the same --cluster-secret-file (or "
                "--cluster-secret), or --disaggregation-insecure to run unauthenticated; "
                "`pipefill serve-pd` makes one itself")

    @property
    def enabled(self) -> bool:
        """A PD role (prefill or decode), not a colocated server."""
        return self.mode is not DisaggMode.NULL

    @property
    def has_secret(self) -> bool:
        return self.cluster_secret is not None or self.cluster_secret_file is not None

    def secret(self) -> bytes | None:
        """The key of --cluster-secret / --cluster-secret-file, read now (None: no secret)."""
        return read_cluster_secret(self.cluster_secret, self.cluster_secret_file)

    @property
    def unauthenticated(self) -> bool:
        """A PD role whose bootstrap and KV ports authenticate nobody."""
        return self.enabled and not self.has_secret

    @property
    def insecure_warning(self) -> str | None:
        """What the log at start and /health say about a PD role without a secret."""
        if not self.unauthenticated:
            return None
        return (f"--disaggregation-insecure: this {self.mode.value} server's bootstrap "
                "and KV transfer ports accept anyone who reaches them (no cluster secret)")


@dataclass(frozen=True)
class Serving:
    """`pipefill serve`: where it listens, who may call it, its HTTP limits and timeouts, and
    how it watches and restarts the stages."""
    host: str
    port: int
    api_key: str | None = field(repr=False)
    served_model_name: str | None
    shutdown_timeout: int
    header_read_timeout: float
    body_read_timeout: float
    max_connections: int
    max_queued_requests: int
    stage_restart_timeout: int
    max_stage_restarts: int
    stage_restart_window: int
    stage_stall_timeout: float
    log_prefill_progress_interval: float = 30.0

    @staticmethod
    def of(args) -> "Serving":
        return Serving(args.host, args.port, args.api_key, args.served_model_name,
                       args.shutdown_timeout, args.header_read_timeout, args.body_read_timeout,
                       args.max_connections, args.max_queued_requests,
                       args.stage_restart_timeout, args.max_stage_restarts,
                       args.stage_restart_window, args.stage_stall_timeout,
                       args.log_prefill_progress_interval)

    def __post_init__(self) -> None:
        for flag, value in (("header-read-timeout", self.header_read_timeout),
                            ("body-read-timeout", self.body_read_timeout)):
            if not value > 0:
                raise ValueError(f"--{flag} must be > 0 seconds, got {value}")
        if self.max_connections < 1 or self.max_queued_requests < 0:
            raise ValueError("--max-connections must be at least 1 and --max-queued-requests "
                             f"at least 0, got {self.max_connections} and "
                             f"{self.max_queued_requests}")
        _at_least(self.stage_restart_timeout, 1, "--stage-restart-timeout", " second")
        _at_least(self.stage_restart_window, 1, "--stage-restart-window", " second")
        if self.stage_stall_timeout < 0:
            raise ValueError("--stage-stall-timeout must be >= 0 (0 = off), got "
                             f"{self.stage_stall_timeout}")
        if self.max_stage_restarts < 0:
            raise ValueError("--max-stage-restarts must be >= 0 (0 = never restart)")
        if self.log_prefill_progress_interval < 0:
            raise ValueError("--log-prefill-progress-interval must be >= 0 (0 = off), got "
                             f"{self.log_prefill_progress_interval}")
