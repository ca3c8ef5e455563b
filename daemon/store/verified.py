"""Image files verified once: what this daemon hashed on a root-only RAM file system is not hashed again.

A file on a tmpfs (or ramfs) changes only through a write to it, and in a store directory only root may
write: the store's root is root's and mode 0700 (``store.SnapshotStore``). A write through ``write(2)``,
``truncate(2)`` or a rename over it changes the file's size, mtime or ctime, or its inode; only a write
through a shared mapping of the file by a root process leaves them as they were (shmem files have no
``page_mkwrite``, so such a write updates neither time). So when an image file on such a store has the same
device, inode, size, mtime and ctime as when this daemon last hashed it, and the manifest records the digest
it computed then, a restore need not hash it again: :meth:`VerifiedOnce.trusted`. What the daemon hashed:
every file at publish (``SnapshotStore.describe_images``), and every file a restore verified (a pulled
snapshot's on its first restore), each only when its status was the same before and after the hash.

The mapped write is what the background re-check is for: after a restore that trusted a file, the daemon
hashes it again off the restore path (:meth:`VerifiedOnce.recheck`: one chunk on the ``digest`` lane at a
time, so restores' own digests never queue behind it, and at most once per :data:`RECHECK_AFTER_S` per file).
A mismatch is logged (``store.image_changed``) and the file loses its trust: the next restore hashes it and
refuses it (``IMAGE_CHECKSUM``). Nothing is remembered across a restart of the daemon. docs/security.md
("Image integrity") states what each path guarantees.

On a store on disk nothing is trusted: a disk (or what is under it) can change bytes without a write
through the kernel, and every restore hashes every file.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path

import structlog

from gpusnap.daemon.store import checksum

log = structlog.get_logger(__name__)

TMPFS_MAGIC = 0x01021994
RAMFS_MAGIC = 0x858458F6
"""``statfs(2)``'s ``f_type`` of a tmpfs and of a ramfs (linux/magic.h)."""
RECHECK_AFTER_S = 600.0
"""A trusted file is hashed again in the background after a restore that trusted it, at most this often."""

_libc = ctypes.CDLL(None, use_errno=True)


def fs_type(path: Path) -> int:
    """``statfs(2)``'s ``f_type`` of the file system holding ``path``.

    Raises:
        OSError: ``statfs`` failed.
    """
    buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on x86_64 and aarch64); f_type first
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def root_only_ram(path: Path) -> bool:
    """Whether ``path`` is a directory of root's, closed to everyone else (no group or other bits), on a
    tmpfs or ramfs."""
    try:
        st = path.stat()
        kind = fs_type(path)
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and st.st_mode & 0o077 == 0 and kind in (TMPFS_MAGIC, RAMFS_MAGIC)
    )


@dataclasses.dataclass(frozen=True)
class Status:
    """What identifies a file's content on a RAM file system: where it is, its size and change times."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> Status:
        """``path``'s status (raises OSError as ``stat``)."""
        st = path.stat()
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclasses.dataclass
class _Hashed:
    status: Status
    digest: str
    at: float
    """``time.monotonic()`` of the hash."""
    rechecking: bool = False


class VerifiedOnce:
    """The files this daemon hashed on a root-only RAM store (module docstring); disabled elsewhere.

    Args:
        pool: the pool the background re-checks hash on (gpusnapd's ``digest`` lane).
    """

    def __init__(self, pool: Executor):
        self.enabled = False
        """Whether trust is kept: :meth:`use_store`."""
        self.pool = pool
        self._hashed: dict[tuple[int, int], _Hashed] = {}
        self._lock = threading.Lock()

    def use_store(self, root: Path) -> None:
        """Keep trust only when the store's ``root`` is on a tmpfs or ramfs, root's, closed to others."""
        self.enabled = root_only_ram(root)

    def remember(self, before: Status, path: Path, digest: str) -> None:
        """Record that ``path``, whose status was ``before`` when its hash began, has ``digest``; kept only
        when its status is still ``before`` (nothing wrote it meanwhile)."""
        if not self.enabled:
            return
        try:
            if Status.of(path) != before:
                return
        except OSError:
            return
        with self._lock:
            self._hashed[(before.dev, before.ino)] = _Hashed(before, digest, time.monotonic())

    def trusted(self, status: Status, digest: str) -> bool:
        """Whether a file with ``status`` is one this daemon hashed to ``digest`` and has not changed since."""
        if not self.enabled:
            return False
        with self._lock:
            known = self._hashed.get((status.dev, status.ino))
        return known is not None and known.status == status and known.digest == digest

    def recheck(self, path: Path, status: Status, on_done: Callable[[bool], None] | None = None) -> None:
        """Hash trusted ``path`` (status ``status``) again in the background, unless it was hashed less than
        :data:`RECHECK_AFTER_S` ago or is being hashed; a mismatch drops its trust and is logged. ``on_done``
        (tests) gets whether it was hashed to the remembered digest."""
        key = (status.dev, status.ino)
        with self._lock:
            known = self._hashed.get(key)
            if known is None or known.rechecking or time.monotonic() - known.at < RECHECK_AFTER_S:
                return
            known.rechecking = True
        _Recheck(self, path, key, known, on_done).next()

    def force_due(self) -> None:
        """Make every file due for a re-check (tests)."""
        with self._lock:
            for known in self._hashed.values():
                known.at -= RECHECK_AFTER_S

    def _finish(self, path: Path, key: tuple[int, int], known: _Hashed, digest: str | None) -> bool:
        try:
            same = digest == known.digest and Status.of(path) == known.status
        except OSError:
            same = False
        with self._lock:
            known.rechecking = False
            if same:
                known.at = time.monotonic()
            elif self._hashed.get(key) is known:
                del self._hashed[key]
        if not same and digest is not None:
            log.error("store.image_changed", path=str(path), detail="it no longer has the digest it was published with")
        return same


class _Recheck:
    """One background re-hash, a chunk at a time: each chunk is queued when the one before is done."""

    def __init__(
        self,
        owner: VerifiedOnce,
        path: Path,
        key: tuple[int, int],
        known: _Hashed,
        on_done: Callable[[bool], None] | None,
    ):
        self.owner, self.path, self.key, self.known, self.on_done = owner, path, key, known, on_done
        self.offsets = list(range(0, known.status.size, checksum.CHUNK_BYTES))
        self.chunks: list[bytes] = []

    def next(self) -> None:
        if len(self.chunks) == len(self.offsets):
            self._end(checksum.combine(self.chunks))
            return
        try:
            job = self.owner.pool.submit(checksum.hash_chunk, self.path, self.offsets[len(self.chunks)])
        except RuntimeError:  # the daemon is stopping
            self._end(None)
            return
        job.add_done_callback(self._chunk)

    def _chunk(self, job: Future[bytes]) -> None:
        if job.cancelled() or job.exception() is not None:
            self._end(None)
            return
        self.chunks.append(job.result())
        self.next()

    def _end(self, digest: str | None) -> None:
        same = self.owner._finish(self.path, self.key, self.known, digest)
        if self.on_done is not None:
            self.on_done(same)
