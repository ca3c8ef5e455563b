"""Path resolution that never follows a symlink, at any depth (what openat2's ``RESOLVE_NO_SYMLINKS`` does)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Collection
from pathlib import Path


def walk(
    path: str | Path, *, final_flags: int = os.O_RDONLY, searchable: Callable[[os.stat_result], bool] | None = None
) -> int:
    """Open ``path`` one component at a time from ``/``, never through a symlink; returns the fd of the
    last component, opened with ``final_flags`` (plus ``O_NOFOLLOW | O_CLOEXEC``); the caller closes it.

    Every directory on the way is opened ``O_PATH | O_DIRECTORY | O_NOFOLLOW`` relative to the one
    before (openat2's ``RESOLVE_NO_SYMLINKS``, done per component as Python has no openat2), so a
    component swapped for a symlink at any depth, before or during the walk, fails with ``ELOOP`` or
    ``ENOTDIR`` instead of being followed. ``.`` and ``..`` components are refused.

    ``searchable``: told each directory's ``fstat`` before anything in it is looked up; ``False`` stops the
    walk there with ``EACCES``, as the kernel's path walk does for a user without search permission
    (path_resolution(7)), so a walk done as root on a user's behalf tells nothing of what lies beyond.

    Raises:
        OSError: a component is missing, a symlink (``ELOOP``/``ENOTDIR``), ``.``/``..`` (``EINVAL``), a
            directory ``searchable`` refused (``EACCES``, its ``filename`` the path up to it).
    """
    text = os.fspath(path)
    if not os.path.isabs(text):
        raise OSError(errno.EINVAL, "not an absolute path")
    parts = [p for p in text.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise OSError(errno.EINVAL, "'.' and '..' are not allowed")
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = (final_flags if last else os.O_PATH | os.O_DIRECTORY) | os.O_NOFOLLOW | os.O_CLOEXEC
            if searchable is not None and not searchable(os.fstat(fd)):
                raise OSError(errno.EACCES, "no search permission", "/" + "/".join(parts[:i]))
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
        if not parts and final_flags != os.O_PATH | os.O_DIRECTORY:
            nxt = os.open("/", final_flags | os.O_CLOEXEC)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def permits(st: os.stat_result, want: int, uid: int, gids: Collection[int]) -> bool:
    """Whether ``st``'s mode bits grant ``want`` (``os.R_OK | os.W_OK | os.X_OK`` bits) to user ``uid`` with
    groups ``gids``: the owner's bits, else the group's, else the others', chosen as the kernel chooses
    (path_resolution(7)); ACLs are not consulted, so what only an ACL grants is refused (the safe side)."""
    if st.st_uid == uid:
        shift = 6
    elif st.st_gid in gids:
        shift = 3
    else:
        shift = 0
    have = (st.st_mode >> shift) & 0o7
    return want & ~have == 0


def searchable_by(uid: int, gids: frozenset[int]) -> Callable[[os.stat_result], bool]:
    """``walk``'s ``searchable`` for user ``uid`` with groups ``gids``: a directory's search (execute) bit
    for that user, by :func:`permits`."""
    return lambda st: permits(st, os.X_OK, uid, gids)
