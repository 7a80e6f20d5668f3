"""`file` L3 backend: one file per page under a directory.

One file per page (not per block of pages) because the page is the unit of everything else:
prefix matching counts leading pages, a request's cached prefix can end at any page, and a
damaged file then costs exactly one page (the request recomputes from there), with no
read-modify-write of shared block files by several stage processes. Pages are ~1-2 MB for
real models, large enough that per-file overhead is small.

Path: DIR/ab/<sha256 of the full key>: the full key (~130 characters) is in the header and
checked on read; 256 fan-out folders keep directories short. Writes go to a temporary file in
the same folder and are renamed into place, so a reader sees a whole file or none; no fsync:
after a crash a torn file fails its checksum and is a miss, which is all a cache needs.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import zlib

import torch

from pipefill.kv.storage_format import _FIXED, byte_view, check_header, header_length

log = logging.getLogger("pipefill.storage")


class FileBackend:
    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self._lock = threading.Lock()
        self._warned = False
        self._usage_bytes = 0
        self._num_files = 0
        self._write_errors = 0
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            self._warn(e)
        self._scan()

    def path(self, key: str) -> str:
        name = hashlib.sha256(key.encode()).hexdigest()
        return os.path.join(self.root, name[:2], name)

    def count_leading(self, keys: list[str]) -> int:
        n = 0
        for key in keys:
            if not os.path.isfile(self.path(key)):
                break
            n += 1
        return n

    def write(self, key: str, header: bytes, payload: memoryview) -> bool:
        path = self.path(key)
        if os.path.isfile(path):
            return False  # already stored (by us, another stage or another server)
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            self._warn(e)
            _remove(tmp)
            return False
        with self._lock:
            self._usage_bytes += len(header) + payload.nbytes
            self._num_files += 1
        return True

    def read_into(self, key: str, out: torch.Tensor) -> bool:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                ok = self._read(f, key, out)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if not ok:  # damaged or foreign: remove it so that the next put writes a good copy
            log.debug("L3 file %s is corrupt, truncated or foreign: removed", path)
            self.discard(key)
        return ok

    def _read(self, f, key: str, out: torch.Tensor) -> bool:
        fixed = f.read(_FIXED.size)
        n = header_length(fixed)
        if n is None:
            return False
        header = fixed + f.read(n - len(fixed))
        crc = check_header(header, key, out)
        if crc is None or os.fstat(f.fileno()).st_size != n + out.nbytes:
            return False
        view = byte_view(out)
        if f.readinto(view) != out.nbytes:
            return False
        return zlib.crc32(view) == crc

    def discard(self, key: str) -> None:
        _remove(self.path(key))

    def usage(self) -> dict:
        with self._lock:
            return {"usage_bytes": self._usage_bytes, "stored_pages": self._num_files,
                    "write_errors": self._write_errors}

    def close(self) -> None:
        pass

    def _scan(self) -> None:
        """Count what a previous run left (usage statistics only)."""
        try:
            for sub in os.scandir(self.root):
                if sub.is_dir() and len(sub.name) == 2:
                    for entry in os.scandir(sub.path):
                        if ".tmp." in entry.name:
                            continue
                        self._usage_bytes += entry.stat().st_size
                        self._num_files += 1
        except OSError:
            pass

    def _warn(self, e: OSError) -> None:
        with self._lock:
            first, self._warned = not self._warned, True
            self._write_errors += 1
        if first:
            log.warning("cannot write L3 pages to --hicache-storage-dir %s (%s); serving goes "
                        "on, pages that cannot be written are recomputed when needed, and "
                        "writes are retried with each new page", self.root, e)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
