"""Two unprivileged local users for hostile-user tests, created for one test session and removed after.

Names carry the test session's PID (``gsn<pid>a``/``gsn<pid>b``) so concurrent sessions never share or
remove each other's users; users left behind by a session that died are removed when their PID is gone.
Both are in one fresh group (``gsn<pid>``) that the tests give a daemon as its socket group.
"""

from __future__ import annotations

import contextlib
import dataclasses
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


def _remove_stale() -> None:
    for entry in [*pwd.getpwall(), *grp.getgrall()]:
        name = str(entry[0])
        m = _NAME_RE.match(name)
        if not m or _alive(int(m.group(1))):
            continue
        tool = "userdel" if isinstance(entry, pwd.struct_passwd) else "groupdel"
        subprocess.run([tool, name], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@starts("test users")
@contextlib.contextmanager
def hostile_users() -> Iterator[tuple[User, User]]:
    """Create the two users (and their shared group); remove them on exit."""
    _remove_stale()
    tag = f"{PREFIX}{os.getpid()}"
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
