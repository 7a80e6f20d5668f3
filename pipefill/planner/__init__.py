"""The deployment planner (ARCHITECTURE.md, 'The deployment planner'): the PP × TP layout, C0
and σ for a model on a machine, with predicted TTFT, per-device memory and link load. Pure
Python over the chunking room's simulator; `pipefill plan` is its command line.

    hardware.py  what a machine is: presets, JSON/TOML files, flag overrides
    costs.py     the per-operation cost model of one layout (FLOPs, bytes, all-reduces)
    search.py    layouts of the devices, each's best (C0, σ), simulated and ranked
"""
from pipefill.planner.costs import Layout, LayoutCosts, Precision
from pipefill.planner.hardware import (PRESETS, THIS_CPU, Hardware, Link, Overrides,
                                       load_hardware_file, parse_tflops_flag)
from pipefill.planner.search import Plan, evaluate, layouts, search

__all__ = ["Hardware", "Layout", "LayoutCosts", "Link", "Overrides", "PRESETS", "Plan",
           "Precision", "THIS_CPU", "evaluate", "layouts", "load_hardware_file",
           "parse_tflops_flag", "search"]
