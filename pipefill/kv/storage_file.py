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

Temporary files are created with O_CREAT|O_EXCL|O_NOFOLLOW (mode 0600) relative to the fan-out
folder opened with O_NOFOLLOW, so a link planted at a temporary name or a fan-out folder is
never followed: whoever can write the directory must not get us to write elsewhere.

Size cap (`max_bytes`, --hicache-storage-max-gb): several stages and several servers may share
one directory, so the directory itself is the shared state. A lock file (flock) holds a usage
counter; a written page is renamed into place under the lock together with adding its bytes,
and one that would pass the cap first evicts the least recently used pages (access time, set
explicitly on every verified read because many mounts do not update it) down to 90% of the
cap. The counter is re-counted from the files when it is new or damaged and at every eviction,
so pages removed by hand or by a crash never leave it wrong for long.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import secrets
import stat
import threading
import time
import zlib

import torch

from pipefill.kv.storage_format import _FIXED, byte_view, check_header, header_length

log = logging.getLogger("pipefill.storage")

LOCK_NAME = ".pipefill-usage.lock"  # holds the shared usage counter (bytes, decimal)
# Eviction goes down to this share of the cap, so that a full directory is not re-counted on
# every write.
EVICT_TO = 0.9
# A temporary file this old belongs to a writer that died (a live one takes milliseconds).
STALE_TEMP_S = 600.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


class FileBackend:
    def __init__(self, root: str, max_bytes: int | None = None):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._warned = False
        self._usage_bytes = 0
        self._num_files = 0
        self._write_errors = 0
        self._evicted_pages = 0
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            self._warn(e)
        self._scan()
        self._budget = SharedBudget(self.root, max_bytes) if max_bytes is not None else None

    def path(self, key: str) -> str:
        name = hashlib.sha256(key.encode()).hexdigest()
        return os.path.join(self.root, name[:2], name)

    def temp_path(self, key: str) -> str:
        """Where this thread first tries to write `key`."""
        return _temp_path(self.path(key))

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
        size = len(header) + payload.nbytes
        folder, name = os.path.split(path)
        try:
            os.makedirs(folder, exist_ok=True)
            dir_fd = os.open(folder, _DIR_FLAGS)  # a link planted as the folder: ELOOP
        except OSError as e:
            self._warn(e)
            return False
        try:
            stored = self._store(dir_fd, name, header, payload, size)
        except OSError as e:
            self._warn(e)
            return False
        finally:
            os.close(dir_fd)
        if stored:
            with self._lock:
                self._usage_bytes += size
                self._num_files += 1
        return stored

    def _store(self, dir_fd: int, name: str, header: bytes, payload: memoryview,
               size: int) -> bool:
        """Temporary file, then the rename into place; with a cap the rename happens under the
        directory's lock together with counting its bytes, so the counter always equals the
        bytes of the page files (temporary files are nobody's usage yet)."""
        tmp = _write_temp(dir_fd, name, header, payload)
        try:
            def rename() -> None:
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            if self._budget is None:
                rename()
                return True
            stored, evicted = self._budget.admit(size, rename)
            self._count_evicted(evicted)
            return stored
        finally:
            _remove(tmp, dir_fd)  # gone already after a rename

    def read_into(self, key: str, out: torch.Tensor) -> bool:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            ok = False  # a link where a page belongs: never ours
        else:
            with os.fdopen(fd, "rb") as f:
                ok = self._read(f, key, out)
        if not ok:  # damaged or foreign: remove it so that the next put writes a good copy
            log.debug("L3 file %s is corrupt, truncated or foreign: removed", path)
            self.discard(key)
        else:
            _touch(path)  # the LRU clock: a page just read is the last to be evicted
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
        path = self.path(key)
        size = _size(path)
        if _remove(path) and self._budget is not None and size:
            self._budget.release(size)

    def usage(self) -> dict:
        with self._lock:
            out = {"usage_bytes": self._usage_bytes, "stored_pages": self._num_files,
                   "write_errors": self._write_errors, "evicted_pages": self._evicted_pages}
        if self._budget is not None:
            try:
                out["usage_bytes"] = self._budget.used()  # the directory's, all writers
            except OSError:
                pass
        return out

    def close(self) -> None:
        pass

    def _count_evicted(self, n: int) -> None:
        if n:
            with self._lock:
                self._evicted_pages += n

    def _scan(self) -> None:
        """Count what a previous run left (usage statistics only)."""
        try:
            for sub in os.scandir(self.root):
                if sub.is_dir(follow_symlinks=False) and len(sub.name) == 2:
                    for entry in os.scandir(sub.path):
                        if ".tmp." in entry.name:
                            continue
                        self._usage_bytes += entry.stat(follow_symlinks=False).st_size
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


class SharedBudget:
    """The byte cap of one storage directory, shared through the directory by every process
    that writes it: a usage counter in a lock file, changed only under flock."""

    def __init__(self, root: str, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"the storage cap must be positive, got {max_bytes} bytes")
        self.root = root
        self.max_bytes = max_bytes
        self.lock_path = os.path.join(root, LOCK_NAME)

    def admit(self, size: int, commit) -> tuple[bool, int]:
        """Runs `commit` (the rename that adds a page of `size` bytes) under the lock when the
        page fits, evicting least recently used pages first when it would pass the cap.
        -> (whether it was committed, pages evicted)."""
        if size > self.max_bytes:
            return False, 0
        with self._locked() as fd:
            used, evicted = _read_counter(fd), 0
            if used is None:  # a new or damaged counter: count what the directory holds
                used, evicted = evict_lru(self.root, self.max_bytes)
            if used + size > self.max_bytes:
                used, more = evict_lru(self.root, int(self.max_bytes * EVICT_TO) - size)
                evicted += more
            if used + size > self.max_bytes:
                _write_counter(fd, used)
                return False, evicted
            commit()
            _write_counter(fd, used + size)
        return True, evicted

    def release(self, size: int) -> None:
        """A page removed: its bytes are free again."""
        try:
            with self._locked() as fd:
                used = _read_counter(fd)
                if used is not None:
                    _write_counter(fd, max(0, used - size))
        except OSError:
            pass  # the next eviction re-counts the files

    def used(self) -> int:
        with self._locked() as fd:
            used = _read_counter(fd)
        return used if used is not None else 0

    def _locked(self):
        return _FileLock(self.lock_path)


class _FileLock:
    """An exclusive flock on the lock file (created 0600 without following a link); the file
    descriptor is the counter's."""

    def __init__(self, path: str):
        self.path = path
        self.fd = -1

    def __enter__(self) -> int:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:
            os.close(self.fd)
            raise
        return self.fd

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # closing drops the flock


def _read_counter(fd: int) -> int | None:
    """The counter's bytes; None for a new (empty) or damaged counter."""
    raw = os.pread(fd, 32, 0)
    try:
        return max(0, int(raw.decode()))
    except ValueError:
        return None


def _write_counter(fd: int, value: int) -> None:
    data = str(value).encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def evict_lru(root: str, target: int) -> tuple[int, int]:
    """Removes pages, least recently used (oldest access time) first, until the directory
    holds at most `target` bytes of pages; stale temporary files of dead writers go too.
    -> (bytes left, pages removed). The caller holds the directory's lock."""
    pages = []
    now = time.time()
    for path, st in _entries(root):
        if ".tmp." not in os.path.basename(path):
            pages.append((st.st_atime, st.st_size, path))
        elif now - st.st_mtime > STALE_TEMP_S:
            _remove(path)  # not counted either way: a temporary file is nobody's usage yet
    total = sum(size for _, size, _ in pages)
    removed = 0
    for _, size, path in sorted(pages):
        if total <= target:
            break
        if _remove(path):
            total -= size
            removed += 1
    return total, removed


def _entries(root: str):
    """(path, lstat) of every regular file in the fan-out folders."""
    try:
        subs = [e for e in os.scandir(root) if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for sub in subs:
        try:
            entries = list(os.scandir(sub.path))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
            if entry.is_file(follow_symlinks=False):
                yield entry.path, st


def _write_temp(dir_fd: int, name: str, header: bytes, payload: memoryview) -> str:
    """A new file (0600) beside the page, created exclusively without following a link;
    -> its name. A name taken by someone else (a planted link or file) is left alone and a
    random name is used instead."""
    tmp = os.path.basename(_temp_path(name))
    try:
        fd = os.open(tmp, _TEMP_FLAGS, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        tmp = f"{name}.tmp.{os.getpid()}.{secrets.token_hex(8)}"
        fd = os.open(tmp, _TEMP_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
    except OSError:
        _remove(tmp, dir_fd)
        raise
    return tmp


def _temp_path(path: str) -> str:
    return f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"


def _touch(path: str) -> None:
    """Sets the access time to now (the modification time stays)."""
    try:
        st = os.stat(path, follow_symlinks=False)
        os.utime(path, ns=(time.time_ns(), st.st_mtime_ns), follow_symlinks=False)
    except OSError:
        pass  # evicted meanwhile


def _size(path: str) -> int:
    """Bytes of a regular file (0 for anything else: a planted link never counted)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _remove(path: str, dir_fd: int | None = None) -> bool:
    try:
        os.remove(path, dir_fd=dir_fd)
        return True
    except OSError:
        return False
