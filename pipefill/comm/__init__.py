"""Collectives between the ranks of one stage (tensor parallelism): the all-reduce and
all-gather over shared memory for the CPU ranks of one node (shm.py)."""
