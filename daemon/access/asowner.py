"""Can a given user open these paths? Answered by a helper process that *is* that user.

gpusnapd is root, so it cannot ask the kernel on a user's behalf in-process (``setfsuid`` is per thread,
but supplementary groups are not). :func:`check` starts ``python -m gpusnap.daemon.access.asowner``,
which optionally enters a mount namespace (a restored tree's, while it is still root), drops to the
user's uid, gid and groups for good (``setresgid``/``setresuid``), and then for each path:

- resolves it from ``/`` one component at a time with ``O_NOFOLLOW`` (``access.nofollow.walk``), so the
  kernel checks search permission on every directory as that user and no symlink is followed;
- compares the inode it reaches (``st_dev``, ``st_ino``) with the expected one;
- checks the wanted access against the inode's mode bits for that user's uid, gid and groups
  (owner, then group, then other, as in path_resolution(7); ACLs are not consulted, so a file that
  only an ACL opens is refused, the safe side).

Everything it reports is something that user could have found out alone, so callers may pass its
answers on. It reads a :class:`Request` on stdin and writes a :class:`Reply` on stdout, both through the saved
documents' one codec (``gpusnap.daemon.store.documents``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import stat
import subprocess
import sys
from collections.abc import Sequence
from typing import Literal

from gpusnap.daemon.access.nofollow import permits, walk
from gpusnap.daemon.api.errors import InternalError
from gpusnap.daemon.api.types import Creds
from gpusnap.daemon.drivers.owner_child import become
from gpusnap.daemon.store import documents

CLONE_NEWNS = 0x00020000

Problem = Literal["missing", "symlink", "replaced", "denied"]


@dataclasses.dataclass(frozen=True)
class Item:
    path: str
    access: int
    """``os.R_OK | os.W_OK | os.X_OK`` bits (0: only that it resolves)."""
    dev: int = -1
    ino: int = -1
    """The inode expected there (-1: any)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """What the helper checks, as whom, and in which mount namespace (``mnt_ns_of``: a host PID's; 0: its own)."""

    creds: Creds
    items: tuple[Item, ...]
    mnt_ns_of: int = 0


@dataclasses.dataclass(frozen=True)
class Reply:
    """One answer per item: ``None`` (that user reaches that inode with that access) or what is wrong."""

    problems: tuple[Problem | None, ...]


def check(creds: Creds, items: Sequence[Item], *, mnt_ns_of: int = 0, timeout_s: float = 60) -> list[Problem | None]:
    """For each item ``None`` (the user reaches that inode with that access) or what is wrong.

    Args:
        mnt_ns_of: resolve paths in this host PID's mount namespace (0: the daemon's).

    Raises:
        InternalError: the helper failed (reason ``ACCESS_CHECK_FAILED``).
    """
    if not items:
        return []
    req = Request(creds=creds, items=tuple(items), mnt_ns_of=mnt_ns_of)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        res = subprocess.run(
            [sys.executable, "-m", __name__],
            input=documents.encode(req) + b"\n",
            capture_output=True,
            timeout=timeout_s,
            env=env,
            cwd="/",
        )
        problems = list(documents.decode(res.stdout, Reply).problems)
    except (OSError, subprocess.SubprocessError, documents.DocumentError) as exc:
        raise InternalError(
            f"the file-rights check as uid {creds.uid} failed ({type(exc).__name__})", reason="ACCESS_CHECK_FAILED"
        ) from exc
    if len(problems) != len(items):
        raise InternalError("the file-rights check answered the wrong number of items", reason="ACCESS_CHECK_FAILED")
    return problems


def _one(item: Item, creds: Creds) -> Problem | None:
    try:
        fd = walk(item.path, final_flags=os.O_PATH)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return "missing"
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EINVAL):
            return "symlink"
        return "denied"
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    if item.dev != -1 and (st.st_dev, st.st_ino) != (item.dev, item.ino):
        return "replaced"
    if not permits(st, item.access, creds.uid, {creds.gid, *creds.groups}):
        return "denied"
    return None


def main() -> int:
    req = documents.decode(sys.stdin.buffer.readline(), Request)
    if req.mnt_ns_of:
        fd = os.open(f"/proc/{req.mnt_ns_of}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "setns(mnt)")
        os.close(fd)
        os.chdir("/")
    become(req.creds)
    sys.stdout.buffer.write(documents.encode(Reply(tuple(_one(item, req.creds) for item in req.items))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
