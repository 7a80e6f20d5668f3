"""KV tensors in files under /dev/shm, so that the leader of a tensor-parallel PD stage can read
and write its peers' pages (ARCHITECTURE.md, 'KV heads across TP sizes').

    empty = SharedEmpty("stage0")         # torch.empty's place when the cache is built
    cache = KVCache(..., empty=empty)      # its K and V now live in two files
    ... every rank's empty.files reach the leader, which maps them (map_shared) ...
    empty.unlink()                         # once the leader holds its mappings

A file is sparse, as torch.empty's memory is untouched: pages become resident when written.
The names are removed as soon as the leader has mapped them, so nothing stays in /dev/shm once
the stage is up, whatever happens later.
"""
from __future__ import annotations

import math
import os
import secrets

import torch

from pipefill.base.platform import dtype_name

SHM_DIR = "/dev/shm"


def shm_free_bytes(folder: str = SHM_DIR) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


class SharedEmpty:
    """torch.empty whose tensors live in files under `folder` (CPU only). files: (path, shape,
    dtype name) of each, in creation order."""

    def __init__(self, tag: str, folder: str = SHM_DIR, processes: int = 1):
        """processes: how many processes of the node fill `folder` alike (each checks the
        room for all of them: the files are sparse, so free space shrinks only as they fill)."""
        self.folder, self.processes = folder, processes
        self.prefix = f"pipefill-kv-{os.getpid()}-{secrets.token_hex(4)}-{tag}"
        self.files: list[tuple[str, list[int], str]] = []
        self.nbytes = 0

    def __call__(self, shape, dtype: torch.dtype, device=None) -> torch.Tensor:
        assert device is None or torch.device(device).type == "cpu", "shared KV is CPU memory"
        numel = math.prod(shape)
        self.nbytes += numel * dtype.itemsize
        free, need = shm_free_bytes(self.folder), self.nbytes * self.processes
        # Writing past a full tmpfs kills the process (SIGBUS): a sentence instead, up front.
        if need > free:
            raise ValueError(f"under PD with --tp-size the KV pools live in {self.folder}: "
                             f"about {need / 2**30:.1f} GiB for {self.processes} stage "
                             f"process(es) of this node, but it has {free / 2**30:.1f} GiB "
                             f"free: lower --max-total-tokens or give {self.folder} more room")
        path = os.path.join(self.folder, f"{self.prefix}-{len(self.files)}")
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(*shape)
        self.files.append((path, list(shape), dtype_name(dtype)))
        return tensor

    def unlink(self) -> None:
        for path, _, _ in self.files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def map_shared(path: str, shape: list[int], dtype: str) -> torch.Tensor:
    """Another process's SharedEmpty tensor, mapped here (writes reach it, and its reach us)."""
    if math.prod(shape) == 0:  # no bytes, no file (a stage without window layers' window KV)
        return torch.empty(shape, dtype=getattr(torch, dtype))
    if not os.path.exists(path):
        raise RuntimeError(f"the shared KV file {path} is gone (its TP rank exited?)")
    return torch.from_file(path, shared=True, size=math.prod(shape),
                           dtype=getattr(torch, dtype)).view(*shape)
