"""What the planner knows of a machine (ARCHITECTURE.md, 'The deployment planner'): each
device's FLOP/s per dtype, memory and its bandwidth, the links within and across nodes, and
how many devices a node holds. Read from a preset, a small JSON or TOML file, or both with
flags on top; every mistake is a ValueError with a sentence.

A file states numbers in the units people quote (TFLOP/s, GB, GB/s, microseconds):

    name = "my-gpu"
    devices_per_node = 8
    memory_gb = 96
    memory_bandwidth_gb_s = 4000
    efficiency = 0.7
    chunk_overhead_ms = 2
    [tflops]
    bfloat16 = 148
    fp8 = 296
    [intra_node]
    bandwidth_gb_s = 450
    latency_us = 3
    [inter_node]
    bandwidth_gb_s = 50
    latency_us = 10

Rates are dense FLOP/s of one device (bfloat16, float16, float32, fp8, int8; a dtype without
one runs at the compute dtype's). A link's bandwidth is one device's, each way; inter_node is
a device's share of its node's network (one node: leave it out, the intra-node link serves).
efficiency (default 1) is the share of the rates prefill reaches, chunk_overhead_ms (default
0) what a chunk costs a stage besides, and devices_are_cores = true lets a rank run on several
devices as threads (CPU cores).
"""
from __future__ import annotations

import json
import math
import os
import tomllib
from dataclasses import dataclass, field, replace

# The dtypes a rate may be given for, with the names people also write.
DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
               "fp16": "float16", "float32": "float32", "fp32": "float32", "fp8": "fp8",
               "fp8_e4m3": "fp8", "int8": "int8"}
BYTES_OF = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class Link:
    """One direction of a device's link: bytes/s it sustains and the seconds a message waits
    before its first byte moves."""
    bandwidth: float
    latency: float

    def seconds(self, num_bytes: float) -> float:
        return self.latency + num_bytes / self.bandwidth


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: dict  # dtype -> FLOP/s of one device (GEMMs at their datasheet or measured peak)
    memory_bytes: float  # per device
    memory_bandwidth: float  # bytes/s per device
    devices_per_node: int
    intra_node: Link  # between two devices of one node (per device, one direction)
    inter_node: Link  # a device's share of its node's network (per device, one direction)
    # The one calibrated constant: the share of `flops` that prefill's GEMMs and attention
    # reach, everything the cost model does not itemize (kernel efficiency, launches, norms
    # and activations, the scheduler) folded into it.
    efficiency: float = 1.0
    # Seconds a chunk costs a stage beside its operations (scheduling, kernel launches, the
    # border's synchronisation): what keeps the search from chunks too small to run well.
    chunk_overhead: float = 0.0
    # CPU cores: a rank may run on several devices as threads (one stage over two cores with
    # two threads is a layout beside two ranks of one thread).
    devices_are_cores: bool = False
    source: str = ""  # where it came from, for the printout

    def rate(self, dtype: str, fallback: str) -> float:
        """FLOP/s one device reaches on `dtype` (else on `fallback`: a CPU without FP8 GEMMs
        runs FP8 weights at its compute dtype's rate), times the efficiency."""
        peak = self.flops.get(dtype) or self.flops.get(fallback)
        if not peak:
            raise ValueError(f"hardware {self.name!r} has no FLOP/s for {fallback} (its tflops "
                             f"table has {', '.join(sorted(self.flops)) or 'nothing'}); add "
                             f"one to the file or with --device-tflops {fallback}=N")
        return peak * self.efficiency

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node


# H20 (NVIDIA's datasheet): 148 dense TFLOP/s bf16, 296 fp8, 96 GB HBM3 at 4.0 TB/s, NVLink
# 900 GB/s (450 each way), 8 per node; the network a 400 Gb/s NIC per GPU (50 GB/s). The
# efficiency is the one constant calibrated, against the published H20 prefill figures as a
# whole (tests/planner/test_planner_published.py: Qwen3-235B-A22B PP8 x TP4 at 128K-1M tokens and
# DeepSeek-V3.1 at TP8, PP4 x TP8 and TP32): 0.85 keeps the largest of the seven errors
# smallest (8%), never fitted per figure. Its chunk overhead, 2 ms a chunk and stage, is an
# estimate of a serving engine's step beside its kernels, not calibrated (it moves the
# published figures by under 1%).
H20 = Hardware(
    name="h20", flops={"bfloat16": 148e12, "float16": 148e12, "fp8": 296e12, "int8": 296e12,
                       "float32": 44e12},
    memory_bytes=96e9, memory_bandwidth=4.0e12, devices_per_node=8,
    intra_node=Link(450e9, 3e-6), inter_node=Link(50e9, 10e-6), efficiency=0.85,
    chunk_overhead=2e-3,
    source="preset h20: datasheet figures, efficiency 0.85 calibrated once on the published "
           "H20 prefills, chunk overhead 2 ms estimated")

PRESETS = {"h20": H20}
# The preset the command line measures on this machine (cli/plan.py, bench/roofline.py).
THIS_CPU = "this-cpu"

FIELDS = {"name", "devices_per_node", "memory_gb", "memory_bandwidth_gb_s", "efficiency",
          "chunk_overhead_ms", "tflops", "intra_node", "inter_node", "devices_are_cores"}
LINK_FIELDS = {"bandwidth_gb_s", "latency_us"}


def positive(value, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {what} must be a positive number, got {value!r}")
    return float(value)


def non_negative(value, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {what} must be a number >= 0, got {value!r}")
    return float(value)


def parse_flops(table, where: str) -> dict:
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{where}: tflops must be a table of dtype = TFLOP/s, e.g. "
                         "{\"bfloat16\": 148, \"fp8\": 296}")
    out = {}
    for name, value in table.items():
        dtype = DTYPE_NAMES.get(str(name).lower())
        if dtype is None:
            raise ValueError(f"{where}: tflops names dtype {name!r}; known: "
                             f"{', '.join(sorted(DTYPE_NAMES))}")
        out[dtype] = positive(value, f"tflops.{name}", where) * 1e12
    return out


def parse_link(table, key: str, where: str) -> Link:
    if not isinstance(table, dict):
        raise ValueError(f"{where}: {key} must be a table with bandwidth_gb_s and latency_us")
    unknown = set(table) - LINK_FIELDS
    if unknown:
        raise ValueError(f"{where}: {key} has unknown keys {', '.join(sorted(unknown))}; it "
                         "takes bandwidth_gb_s and latency_us")
    missing = LINK_FIELDS - set(table)
    if missing:
        raise ValueError(f"{where}: {key} needs {', '.join(sorted(missing))}")
    return Link(positive(table["bandwidth_gb_s"], f"{key}.bandwidth_gb_s", where) * 1e9,
                non_negative(table["latency_us"], f"{key}.latency_us", where) * 1e-6)


def hardware_from_dict(d, where: str) -> Hardware:
    """A Hardware from a parsed file (see the module's docstring for the keys)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a table of hardware facts at the top level")
    unknown = set(d) - FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown keys {', '.join(sorted(unknown))}; a hardware file "
                         f"takes {', '.join(sorted(FIELDS))}")
    missing = {"tflops", "memory_gb", "memory_bandwidth_gb_s", "devices_per_node",
               "intra_node"} - set(d)
    if missing:
        raise ValueError(f"{where}: missing {', '.join(sorted(missing))}")
    per_node = d["devices_per_node"]
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise ValueError(f"{where}: devices_per_node must be a whole number >= 1, "
                         f"got {per_node!r}")
    intra = parse_link(d["intra_node"], "intra_node", where)
    inter = parse_link(d["inter_node"], "inter_node", where) if "inter_node" in d else intra
    efficiency = positive(d.get("efficiency", 1.0), "efficiency", where)
    if efficiency > 1:
        raise ValueError(f"{where}: efficiency {efficiency} is a share of the peak, at most 1")
    overhead = non_negative(d.get("chunk_overhead_ms", 0.0), "chunk_overhead_ms", where)
    return Hardware(name=str(d.get("name", os.path.basename(where))),
                    flops=parse_flops(d["tflops"], where),
                    memory_bytes=positive(d["memory_gb"], "memory_gb", where) * 1e9,
                    memory_bandwidth=positive(d["memory_bandwidth_gb_s"],
                                              "memory_bandwidth_gb_s", where) * 1e9,
                    devices_per_node=per_node, intra_node=intra, inter_node=inter,
                    efficiency=efficiency, chunk_overhead=overhead * 1e-3,
                    devices_are_cores=bool(d.get("devices_are_cores")),
                    source=f"file {where}")


def load_hardware_file(path: str) -> Hardware:
    """A hardware file: TOML when it ends in .toml, else JSON."""
    if not os.path.isfile(path):
        raise ValueError(f"--hardware {path}: no such preset ({', '.join(sorted(PRESETS))}, "
                         f"{THIS_CPU}) or file")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f) if path.endswith(".toml") else json.load(f)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        kind = "TOML" if path.endswith(".toml") else "JSON"
        raise ValueError(f"--hardware {path}: not valid {kind} ({e})") from None
    return hardware_from_dict(data, path)


@dataclass
class Overrides:
    """Flags on top of a preset or a file; None keeps the field."""
    tflops: dict = field(default_factory=dict)  # dtype -> FLOP/s
    memory_gb: float | None = None
    memory_bandwidth_gb_s: float | None = None
    devices_per_node: int | None = None
    intra_node_gb_s: float | None = None
    intra_node_latency_us: float | None = None
    inter_node_gb_s: float | None = None
    inter_node_latency_us: float | None = None
    efficiency: float | None = None
    chunk_overhead_ms: float | None = None

    def apply(self, hw: Hardware) -> Hardware:
        changes = {}
        if self.tflops:
            changes["flops"] = {**hw.flops, **self.tflops}
        if self.memory_gb is not None:
            changes["memory_bytes"] = positive(self.memory_gb, "--device-memory-gb",
                                               "flags") * 1e9
        if self.memory_bandwidth_gb_s is not None:
            changes["memory_bandwidth"] = positive(self.memory_bandwidth_gb_s,
                                                   "--memory-bandwidth-gb-s", "flags") * 1e9
        if self.devices_per_node is not None:
            if self.devices_per_node < 1:
                raise ValueError("--devices-per-node must be at least 1")
            changes["devices_per_node"] = self.devices_per_node
        changes["intra_node"] = self.link(hw.intra_node, self.intra_node_gb_s,
                                          self.intra_node_latency_us, "--intra-node")
        changes["inter_node"] = self.link(hw.inter_node, self.inter_node_gb_s,
                                          self.inter_node_latency_us, "--inter-node")
        if self.efficiency is not None:
            if not 0 < self.efficiency <= 1:
                raise ValueError(f"--efficiency {self.efficiency}: a share of the peak, in "
                                 "(0, 1]")
            changes["efficiency"] = self.efficiency
        if self.chunk_overhead_ms is not None:
            changes["chunk_overhead"] = non_negative(self.chunk_overhead_ms,
                                                     "--chunk-overhead-ms", "flags") * 1e-3
        return replace(hw, **changes)

    @staticmethod
    def link(link: Link, gb_s: float | None, latency_us: float | None, flag: str) -> Link:
        if gb_s is not None:
            link = replace(link, bandwidth=positive(gb_s, f"{flag}-gb-s", "flags") * 1e9)
        if latency_us is not None:
            link = replace(link, latency=non_negative(latency_us, f"{flag}-latency-us",
                                                      "flags") * 1e-6)
        return link


def parse_tflops_flag(text: str) -> dict:
    """--device-tflops 'bf16=148,fp8=296' -> {dtype: FLOP/s}."""
    table = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        try:
            table[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--device-tflops {text!r}: expected DTYPE=TFLOPS pairs separated "
                             "by commas, e.g. bf16=148,fp8=296")
    return parse_flops(table, "--device-tflops")
