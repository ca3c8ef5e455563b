"""File operations gpusnapd performs as root in directories that callers name (control and wake
directories): never through a symlink, never on a name the caller picked, only in directories the
caller owns (or root's).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from gpusnap.daemon.api.errors import InvalidArgumentError, PermissionDeniedError


@contextlib.contextmanager
def open_dir(path: str | Path, owner_uid: int) -> Iterator[int]:
    """An fd of directory ``path`` (not a symlink), owned by ``owner_uid`` or root; closed on exit.

    Raises:
        InvalidArgumentError: not an absolute path to a directory (reason ``BAD_DIRECTORY``).
        PermissionDeniedError: owned by someone else (reason ``NOT_OWNER``).
    """
    if not os.path.isabs(path):
        raise InvalidArgumentError(f"{path!r} is not an absolute path", reason="BAD_DIRECTORY")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidArgumentError(f"{path} is not a directory gpusnapd can use ({exc.strerror})", reason="BAD_DIRECTORY") from exc
    try:
        uid = os.fstat(fd).st_uid
        if uid not in (0, owner_uid):
            raise PermissionDeniedError(
                f"{path} belongs to uid {uid}, not to uid {owner_uid}; use a directory of your own",
                reason="NOT_OWNER",
            )
        yield fd
    finally:
        os.close(fd)


def create(dir_fd: int, name: str, content: str = "") -> None:
    """Create ``name`` in ``dir_fd`` atomically (a fresh temp file, never followed, then renamed)."""
    tmp = f".{name}.tmp"
    remove(dir_fd, tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        os.write(fd, content.encode())
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def remove(dir_fd: int, name: str) -> None:
    """Remove ``name`` from ``dir_fd`` if present (a symlink is removed, not followed)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def exists(dir_fd: int, name: str) -> bool:
    return os.path.lexists(f"/proc/self/fd/{dir_fd}/{name}")
