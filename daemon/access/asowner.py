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
answers on. Request (stdin, one JSON object)::

    {"uid": 1000, "gid": 1000, "groups": [1000], "mnt_ns_of": 0,
     "items": [{"path": "/home/u/x", "dev": 2049, "ino": 131, "access": 4}]}   # dev/ino -1: any

Reply (stdout): ``{"problems": [null | "missing" | "symlink" | "replaced" | "denied", …]}``, one per item.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import os
import stat
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from gpusnap.daemon.access.nofollow import permits, walk
from gpusnap.daemon.api.errors import InternalError
from gpusnap.daemon.api.types import Creds

CLONE_NEWNS = 0x00020000


@dataclasses.dataclass(frozen=True)
class Item:
    path: str
    access: int
    """``os.R_OK | os.W_OK | os.X_OK`` bits (0: only that it resolves)."""
    dev: int = -1
    ino: int = -1


def check(creds: Creds, items: Sequence[Item], *, mnt_ns_of: int = 0, timeout_s: float = 60) -> list[str | None]:
    """For each item ``None`` (the user reaches that inode with that access) or what is wrong.

    Args:
        mnt_ns_of: resolve paths in this host PID's mount namespace (0: the daemon's).

    Raises:
        InternalError: the helper failed (reason ``ACCESS_CHECK_FAILED``).
    """
    if not items:
        return []
    req = {
        "uid": creds.uid,
        "gid": creds.gid,
        "groups": list(creds.groups),
        "mnt_ns_of": mnt_ns_of,
        "items": [dataclasses.asdict(i) for i in items],
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        res = subprocess.run(
            [sys.executable, "-m", __name__],
            input=json.dumps(req),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd="/",
        )
        problems: list[str | None] = json.loads(res.stdout)["problems"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
        raise InternalError(
            f"the file-rights check as uid {creds.uid} failed ({type(exc).__name__})", reason="ACCESS_CHECK_FAILED"
        ) from exc
    if len(problems) != len(items):
        raise InternalError("the file-rights check answered the wrong number of items", reason="ACCESS_CHECK_FAILED")
    return problems


def _one(item: dict[str, Any], creds: Creds) -> str | None:
    try:
        fd = walk(item["path"], final_flags=os.O_PATH)
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
    if item["dev"] != -1 and (st.st_dev, st.st_ino) != (item["dev"], item["ino"]):
        return "replaced"
    if not permits(st, int(item["access"]), creds.uid, {creds.gid, *creds.groups}):
        return "denied"
    return None


def main() -> int:
    req = json.loads(sys.stdin.readline())
    creds = Creds(uid=int(req["uid"]), gid=int(req["gid"]), groups=tuple(int(g) for g in req["groups"]))
    if req.get("mnt_ns_of"):
        fd = os.open(f"/proc/{int(req['mnt_ns_of'])}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "setns(mnt)")
        os.close(fd)
        os.chdir("/")
    os.setgroups(list(creds.groups))
    os.setresgid(creds.gid, creds.gid, creds.gid)
    os.setresuid(creds.uid, creds.uid, creds.uid)
    if creds.uid != 0 and os.geteuid() == 0:
        raise SystemExit("could not drop to the owner's uid")
    problems = [_one(item, creds) for item in req["items"]]
    sys.stdout.write(json.dumps({"problems": problems}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
