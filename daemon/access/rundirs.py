"""The daemon's runtime directories: where its sockets live, its private directory and the wake directory.

gpusnapd runs as root, so a directory that another user can write lets that user swap the daemon's
sockets or plant what the daemon then trusts (a pre-made ``.gpusnapd-private``, a ``wake`` symlink that
the daemon would ``chmod 1777``). The rules:

- a socket's directory, and each directory above it, is owned by root or the daemon's user and is not
  writable by group or others, except a sticky directory (``/tmp``) above one that is the daemon's;
- the daemon creates its private directory (0700) and the wake directory (0755: the agents' default,
  where only the daemon writes, their wake files; world-writable, it would let any user fill the tmpfs
  of ``/run`` that the whole system keeps its runtime state on) and sets their mode only when it made
  them itself; found ones must already be the daemon's real directories with that mode (a wake directory
  of an earlier gpusnapd's, 1777, is narrowed), or the daemon refuses to start and says what to remove.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from gpusnap.daemon.access import safefs
from gpusnap.daemon.api.errors import FailedPreconditionError


def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def check_socket_dir(directory: Path) -> None:
    """Refuse ``directory`` (and its parents) unless only root or the daemon's user can write them.

    Raises:
        FailedPreconditionError: reason ``UNSAFE_SOCKET_DIR``, naming the directory and the fix.
    """
    path = Path(os.path.abspath(directory))
    chain = [*reversed(path.parents), path]
    for i, d in enumerate(chain):
        st = os.lstat(d)
        child_ok = i + 1 < len(chain) and _trusted_owner(os.lstat(chain[i + 1]).st_uid)
        if stat.S_ISLNK(st.st_mode):
            target = d.resolve()
            if _trusted_owner(st.st_uid) and all(_trusted_owner(os.lstat(p).st_uid) for p in (target, *target.parents)):
                continue  # e.g. /var/run -> /run, made by root
        sticky_ok = bool(st.st_mode & stat.S_ISVTX) and child_ok
        open_to_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if not _trusted_owner(st.st_uid) or (open_to_others and not sticky_ok):
            raise FailedPreconditionError(
                f"{d} (on the way to the socket directory {path}) can be written by users other than root, so "
                "they could replace gpusnapd's sockets; use a directory only root can write (e.g. /run/gpusnap) "
                f"or fix it with `chown root {d} && chmod go-w {d}`",
                reason="UNSAFE_SOCKET_DIR",
            )


def make_own_dir(path: Path, mode: int, *, shared: bool = False, narrowed_from: int | None = None) -> None:
    """Create ``path`` with ``mode`` (set past the umask), or accept the daemon's own from an earlier run.

    A found path must be a real directory (no symlink) of root or the daemon's user with exactly ``mode``:
    the daemon never changes the mode of something it did not create, except to narrow an earlier
    gpusnapd's ``narrowed_from`` to ``mode`` (its parent, a socket directory, is one only root writes).
    ``shared``: agents of every user may name it as their wake directory (:func:`safefs.trust_shared_dir`).

    Raises:
        FailedPreconditionError: reason ``UNSAFE_RUNTIME_DIR``.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and _trusted_owner(st.st_uid) and stat.S_IMODE(st.st_mode) == narrowed_from:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                found = os.fstat(fd)
                if (found.st_dev, found.st_ino) == (st.st_dev, st.st_ino):
                    os.fchmod(fd, mode)
            finally:
                os.close(fd)
            st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or not _trusted_owner(st.st_uid) or stat.S_IMODE(st.st_mode) != mode:
            raise FailedPreconditionError(
                f"{path} exists but is not a directory of root with mode {mode:o}, as gpusnapd makes it (someone "
                f"else made it?); remove it (`rm -rf {path}`) and start gpusnapd again",
                reason="UNSAFE_RUNTIME_DIR",
            ) from None
    else:
        os.chmod(path, mode)  # ours: made just now, not a path another user planted
    if shared:
        safefs.trust_shared_dir(path)


def remove_if_empty(path: Path) -> None:
    """Remove the directory ``path`` if it is a real, empty directory (the wake directory at stop)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.rmdir(path)
    except OSError:  # gone, not empty (a worker still waits on it) or not ours to remove
        pass


def socket_answers(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1)
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True


def unlink_if_ours(path: Path, bound: tuple[int, int] | None) -> None:
    """Remove the socket this daemon bound at ``path``, never one another daemon put there since."""
    try:
        st = os.lstat(path)
        if bound is not None and (st.st_dev, st.st_ino) == bound:
            path.unlink()
    except FileNotFoundError:
        pass
