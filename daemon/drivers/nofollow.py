"""Path resolution that never follows a symlink, at any depth (what openat2's ``RESOLVE_NO_SYMLINKS`` does)."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def walk(path: str | Path, *, final_flags: int = os.O_RDONLY) -> int:
    """Open ``path`` one component at a time from ``/``, never through a symlink; returns the fd of the
    last component, opened with ``final_flags`` (plus ``O_NOFOLLOW | O_CLOEXEC``); the caller closes it.

    Every directory on the way is opened ``O_PATH | O_DIRECTORY | O_NOFOLLOW`` relative to the one
    before (openat2's ``RESOLVE_NO_SYMLINKS``, done per component as Python has no openat2), so a
    component swapped for a symlink at any depth, before or during the walk, fails with ``ELOOP`` or
    ``ENOTDIR`` instead of being followed. ``.`` and ``..`` components are refused.

    Raises:
        OSError: a component is missing, a symlink (``ELOOP``/``ENOTDIR``), ``.``/``..`` (``EINVAL``).
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
