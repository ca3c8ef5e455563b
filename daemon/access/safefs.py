"""File operations gpusnapd performs as root in directories that callers name (control and wake
directories): never through a symlink in any component, never on a name the caller picked, only in
directories the caller owns.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
from collections.abc import Iterator
from pathlib import Path

from gpusnap.daemon.access.nofollow import searchable_by, walk
from gpusnap.daemon.api.errors import InvalidArgumentError, PermissionDeniedError

_shared_dirs: set[tuple[int, int]] = set()
"""(st_dev, st_ino) of directories the daemon made itself for every user (its wake directory)."""


def trust_shared_dir(path: str | Path) -> None:
    """Let :func:`open_dir` with ``shared_ok`` accept ``path``, a directory the daemon created for all."""
    st = os.lstat(path)
    _shared_dirs.add((st.st_dev, st.st_ino))


@contextlib.contextmanager
def open_dir(path: str | Path, owner_uid: int, *, shared_ok: bool = False) -> Iterator[int]:
    """An fd of directory ``path`` owned by ``owner_uid``, reached without following any symlink; closed on exit.

    ``shared_ok`` also accepts a directory the daemon made for everyone (:func:`trust_shared_dir`).

    The walk (done as root) stops, as the owner's own would, at a directory ``owner_uid`` may not search,
    so no answer tells a caller whether anything exists below a directory it cannot search.

    Raises:
        InvalidArgumentError: not an absolute path to a directory, or a symlink in any component (reason
            ``BAD_DIRECTORY``).
        PermissionDeniedError: the directory is not ``owner_uid``'s, or a directory on the way is one
            ``owner_uid`` may not search (reason ``NOT_OWNER``).
    """
    try:
        fd = walk(
            path,
            final_flags=os.O_RDONLY | os.O_DIRECTORY,
            searchable=searchable_by(owner_uid, _groups(owner_uid)) if owner_uid else None,
        )
    except PermissionError as exc:
        raise PermissionDeniedError(
            f"{path} is not a directory uid {owner_uid} can reach (it may not search {exc.filename}); "
            "use a directory of your own",
            reason="NOT_OWNER",
        ) from exc
    except OSError as exc:
        why = "a component is a symlink" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else exc.strerror
        raise InvalidArgumentError(
            f"{path} is not a directory gpusnapd can use ({why}); name a real directory of yours, without symlinks",
            reason="BAD_DIRECTORY",
        ) from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != owner_uid and not (shared_ok and (st.st_dev, st.st_ino) in _shared_dirs):
            raise PermissionDeniedError(
                f"{path} is not owned by uid {owner_uid}; use a directory of your own",
                reason="NOT_OWNER",
            )
        yield fd
    finally:
        os.close(fd)


def _groups(uid: int) -> frozenset[int]:
    """The groups of user ``uid`` by the user database (``getgrouplist(3)``); none for an unknown uid."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return frozenset()
    return frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))


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
