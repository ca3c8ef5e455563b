"""Two unprivileged local users for hostile-user tests, created for one test session and removed after.

Names carry the test session's PID (``gsn<pid>a``/``gsn<pid>b``) so concurrent sessions never share or
remove each other's users. A session holds a lock on ``LOCKS/gsn<pid>`` for as long as its users exist; users
left behind by a session that died are removed when no one holds their lock (a PID alone cannot tell: a session
in another PID namespace, as CI's, has PIDs this one cannot see). Both are in one fresh group (``gsn<pid>``)
that the tests give a daemon as its socket group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import grp
import os
import pwd
import re
import subprocess
from collections.abc import Iterator

from tests.starts import starts

PREFIX = "gsn"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)[ab]?$")


@dataclasses.dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    """The user's own primary group."""
    group: str
    """The shared group of the two test users."""

    def argv(self) -> list[str]:
        """Prefix that runs a command as this user with its groups (setpriv, util-linux)."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups"]


LOCKS = "/tmp/gpusnap-test-users"
"""Where each session's lock lies (a directory every session on this machine shares)."""


def _remove_stale() -> None:
    for entry in [*pwd.getpwall(), *grp.getgrall()]:
        name = str(entry[0])
        m = _NAME_RE.match(name)
        if not m or _held(f"{PREFIX}{m.group(1)}"):
            continue
        tool = "userdel" if isinstance(entry, pwd.struct_passwd) else "groupdel"
        subprocess.run([tool, name], capture_output=True)


def _held(tag: str) -> bool:
    """Whether the session that made ``tag``'s users still runs: it holds their lock."""
    try:
        fd = os.open(os.path.join(LOCKS, tag), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@starts("test users")
@contextlib.contextmanager
def hostile_users() -> Iterator[tuple[User, User]]:
    """Create the two users (and their shared group); remove them on exit."""
    os.makedirs(LOCKS, exist_ok=True)
    tag = f"{PREFIX}{os.getpid()}"
    lock = os.open(os.path.join(LOCKS, tag), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # held until the users are gone
    _remove_stale()
    subprocess.run(["groupadd", tag], check=True, capture_output=True)
    made: list[str] = []
    try:
        for suffix in ("a", "b"):
            name = tag + suffix
            subprocess.run(
                [
                    "useradd",
                    "--no-create-home",
                    "--home-dir",
                    "/nonexistent",
                    "--shell",
                    "/usr/sbin/nologin",
                    "--user-group",
                    "--groups",
                    tag,
                    name,
                ],
                check=True,
                capture_output=True,
            )
            made.append(name)
        users = tuple(User(n, pwd.getpwnam(n).pw_uid, pwd.getpwnam(n).pw_gid, tag) for n in made)
        yield users[0], users[1]
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", tag], capture_output=True)
        os.unlink(os.path.join(LOCKS, tag))
        os.close(lock)
