"""fsync helpers shared by the snapshot store and the buffer store."""

from __future__ import annotations

import errno
import os
import secrets
from concurrent.futures import Executor, Future, wait
from pathlib import Path

from gpusnap.daemon.executor import check_wait


def fsync_dir(path: Path) -> None:
    """fsync a directory, so the names created or renamed in it survive a crash."""
    fsync_path(path, os.O_RDONLY | os.O_DIRECTORY)


def fsync_path(path: Path | str, flags: int = os.O_RDONLY) -> None:
    """fsync the file (or, with ``O_DIRECTORY``, the directory) at ``path``."""
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path, pool: Executor) -> None:
    """fsync every regular file and every directory under ``root`` (``root`` included), all at once on
    ``pool`` (gpusnapd's ``fsync`` lane, ``gpusnap.daemon.executor.LaneSizes.fsync``), so the files' data and
    their names are durable once it returns: one round of journal commits instead of one per file. Never
    call it from a task of ``pool``: it waits for ``pool``'s tasks.

    Raises:
        OSError: the first failed fsync (the others still ran); ``ECANCELED`` when gpusnapd's stop dropped
            fsyncs still queued.
        RuntimeError: ``pool`` is shut down (gpusnapd is stopping), or a task of a lane that may not wait on
            ``pool`` called it (``executor.check_wait``).
    """
    check_wait(pool)
    files: list[tuple[str, int]] = []
    for dirpath, _dirs, names in os.walk(root):
        files.append((dirpath, os.O_RDONLY | os.O_DIRECTORY))
        files.extend((os.path.join(dirpath, n), os.O_RDONLY) for n in names)
    futures: list[Future[None]] = []
    try:
        for path, flags in files:
            futures.append(pool.submit(fsync_path, path, flags))
    finally:
        wait(futures)  # none is left running once this returns or raises
    for future in futures:
        if future.cancelled():
            raise OSError(errno.ECANCELED, f"fsyncs under {root} were dropped: gpusnapd is stopping")
        error = future.exception()
        if error is not None:
            raise error


def write_file(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``, durably and atomically (a crash leaves the old file or the new one,
    mode 0600): a temporary file beside it, fsynced, renamed over it, then the directory fsynced."""
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_dir(path.parent)
