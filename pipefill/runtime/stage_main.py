"""A stage process's entry point (`python -m pipefill.runtime.stage_main`, the start message on
stdin). A module of its own: `pipefill` imports worker.py, and running an already-imported module
with -m makes runpy warn at every stage start."""
import sys

from pipefill.runtime.worker import decode_stage_start, stage_entry

if __name__ == "__main__":
    start = decode_stage_start(sys.stdin.buffer.read())
    stage_entry(start.args, start.model_file, start.rank, start.addrs, start.tp_rank)
