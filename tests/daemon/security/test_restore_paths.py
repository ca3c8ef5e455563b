"""Issue 19, items 1 and 2: a non-root restore never makes root bind, unlink, chown or create by a user's path.

CRIU restores a bound unix socket by path, as root, following symlinks in the directory part
(``stat`` → ``unlinkat`` → ``bind`` → ``fchownat`` → ``fchmodat``, criu/sk-unix.c), and creates a
deleted file (a ghost) at its old path. For a non-root snapshot gpusnap binds those sockets itself with
the owner's rights and hands them to CRIU, and moves the ghosts into a directory of root's
(``daemon/drivers/criu_userpaths.py``), so the owner's restore can touch only what the owner could.

The snapshots are taken by root of root processes and re-owned (tests/reown.py says why and how): one
listens on ``~/s/api.sock`` and holds an accepted connection to it (which carries that name too), the
other holds a deleted file and sits in a deleted directory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import DaemonProc, Workloads, _cli_env, start_daemon, stop_daemon, wait_for
from tests.daemon.security.root_service import root_service
from tests.reown import SYSTEM_PYTHON, dumped_by_root, reown
from tests.shortdirs import short_dir
from tests.users import User

HERE = Path(__file__).parent
RESTORES = 200
"""Restores against the flipping directory (issue 19: at least 200)."""


@dataclass
class Setup:
    base: Path
    home: Path
    user: User
    tmp: Path
    snapshot: str


def _as(user: User, *cmd: str) -> None:
    subprocess.run([*user.argv(), *cmd], check=True)


@pytest.fixture(scope="module")
def reowned(tmp_path_factory: pytest.TempPathFactory, hostile: tuple[User, User]) -> Iterator[Setup]:
    a, _ = hostile
    tmp = tmp_path_factory.mktemp("sockets")
    base = short_dir("gpusnap-socks-")
    home = base / "home"
    (home / "s").mkdir(parents=True)
    snapshot = dumped_by_root(tmp, "sock", home / "ready", "unix_listener.py", str(home / "s" / "api.sock"), str(home))
    reown(snapshot, a)
    (home / "ready").unlink()
    for p in (home, home / "s", home / "s" / "api.sock"):
        os.chown(p, a.uid, a.gid)
    try:
        yield Setup(base=base, home=home, user=a, tmp=tmp, snapshot=snapshot.name)
    finally:
        subprocess.run(["rm", "-rf", str(base)])


@pytest.fixture
def user_daemon(reowned: Setup, workloads: Workloads) -> Iterator[DaemonProc]:
    """A daemon on the re-owned snapshot's store that the test users may call."""
    d = start_daemon(reowned.tmp / "d1", extra_env={"GPUSNAP_SOCKET_GROUP": reowned.user.group})
    assert d.alive(), d.log.read_text()
    yield d
    stop_daemon(d)
    for p in psutil.process_iter(["uids"]):  # whatever a refused or killed restore may have left
        if p.info["uids"] and p.info["uids"].real == reowned.user.uid:
            p.kill()


def _restore_as(d: DaemonProc, user: User) -> subprocess.CompletedProcess[str]:
    cmd = [*user.argv(), *d.cli_argv, "--socket", str(d.socket), "-o", "json", "restore", "sock"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_cli_env())


def _fingerprint(path: Path) -> list[int]:
    st = os.lstat(path)
    return [st.st_ino, st.st_uid, st.st_mode]


def _root_dir(s: Setup, name: str) -> Path:
    """A directory of root's, readable by all, that the user may not write."""
    d = s.base / name
    d.mkdir(mode=0o755)
    return d


def test_a_directory_flipped_to_a_symlink_during_restores_never_lets_root_touch_another_file(
    reowned: Setup, user_daemon: DaemonProc
) -> None:
    """Item 1: ``~/s`` is exchanged with a symlink to root's directory in a tight loop while the user
    restores 200 times; root's 0600 file named like the socket must keep its inode, owner and mode."""
    s = reowned
    victim_dir = _root_dir(s, "victim")
    victim = victim_dir / "api.sock"
    victim.write_bytes(b"root only\n")
    os.chmod(victim, 0o600)
    watched = {str(victim): _fingerprint(victim), str(victim_dir): _fingerprint(victim_dir)}
    _as(s.user, "ln", "-sfn", str(victim_dir), str(s.home / "link"))
    flipper = subprocess.Popen(  # niced: it flips on whatever CPU the restores leave idle (CI has 2 cores)
        [
            "nice",
            "-n",
            "19",
            *s.user.argv(),
            SYSTEM_PYTHON,
            str(HERE / "flip_dir.py"),
            str(s.home / "s"),
            str(s.home / "link"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        res = subprocess.run(
            [
                *s.user.argv(),
                sys.executable,
                str(HERE / "restore_loop.py"),
                str(user_daemon.socket),
                "sock",
                str(RESTORES),
                json.dumps(watched),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            env=_cli_env(),
        )
        assert flipper.poll() is None, flipper.stderr.read() if flipper.stderr else ""
    finally:
        flipper.kill()
        flipper.wait()
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["broken"] is None, out
    assert out["restores"] == RESTORES, out
    assert sorted(os.listdir(victim_dir)) == ["api.sock"], "root's directory got an entry"
    assert victim.read_bytes() == b"root only\n"
    print(out)
    # Put back: the directory is the real one again, and the owner's restore works.
    if (s.home / "s").is_symlink():
        _as(s.user, "mv", "-T", str(s.home / "s"), str(s.home / "s.tmp"))
        _as(s.user, "mv", "-T", str(s.home / "link"), str(s.home / "s"))
        _as(s.user, "mv", "-T", str(s.home / "s.tmp"), str(s.home / "link"))
    assert out["restored"] > 0, "no restore through the real directory succeeded"


def test_a_restore_cannot_replace_roots_socket_with_the_users_listener(
    reowned: Setup, user_daemon: DaemonProc, workloads: Workloads
) -> None:
    """Item 2: ``~/s`` is swapped for a symlink to a directory where a root service listens on
    ``api.sock``; the user's restore must leave root's socket in place, root's, and answering."""
    s = reowned
    service_dir = _root_dir(s, "service")
    with root_service(service_dir / "api.sock") as intact:
        _as(s.user, "mv", "-T", str(s.home / "s"), str(s.home / "s.real"))
        _as(s.user, "ln", "-s", str(service_dir), str(s.home / "s"))
        try:
            res = _restore_as(user_daemon, s.user)
            if res.returncode == 0:
                workloads.adopt(json.loads(res.stdout)["pid"])
            intact()
            assert res.returncode != 0, "the restore bound its socket in root's directory"
            assert "api.sock" in res.stderr, res.stderr
        finally:
            _as(s.user, "rm", str(s.home / "s"))
            _as(s.user, "mv", "-T", str(s.home / "s.real"), str(s.home / "s"))

    # Put back as it was: the owner restores it, and the restored tree listens on its own path again.
    res = _restore_as(user_daemon, s.user)
    assert res.returncode == 0, res.stderr
    pid = json.loads(res.stdout)["pid"]
    workloads.adopt(pid)
    sock = s.home / "s" / "api.sock"
    assert os.lstat(sock).st_uid == s.user.uid
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(str(sock))  # the restored listener's backlog takes it
    inos = {c.laddr for c in psutil.Process(pid).net_connections(kind="unix")}
    assert str(sock) in inos, inos


class _Inotify:
    """Names created in one directory (inotify(7) ``IN_CREATE``), read after the fact."""

    IN_CREATE, IN_NONBLOCK = 0x100, 0o4000

    def __init__(self, path: Path):
        import ctypes

        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(self.IN_NONBLOCK)
        assert self.fd >= 0 and self._libc.inotify_add_watch(self.fd, str(path).encode(), self.IN_CREATE) >= 0

    def created(self) -> list[str]:
        import struct

        names = []
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return names
        off = 0
        while off < len(data):
            _wd, _mask, _cookie, size = struct.unpack_from("iIII", data, off)
            names.append(data[off + 16 : off + 16 + size].rstrip(b"\0").decode())
            off += 16 + size
        return names

    def close(self) -> None:
        os.close(self.fd)


def test_ghosts_are_never_created_in_a_directory_the_user_swapped_in(
    tmp_path: Path, hostile: tuple[User, User], workloads: Workloads
) -> None:
    """A deleted file and a deleted working directory come back as ghosts; with ``~/g/d`` swapped for a
    symlink to root's directory, CRIU created ``x.cr.N.ghost`` and the directory ``sub`` (the user's,
    chowned) there as root. Now nothing is created there and the restored tree reads its own data."""
    a, _ = hostile
    base = short_dir("gpusnap-ghosts-")
    top = base / "g"
    (top / "d").mkdir(parents=True)
    try:
        snapshot = dumped_by_root(tmp_path, "ghosts", top / "ready", "ghosts.py", str(top))
        reown(snapshot, a)
        (top / "ready").unlink()
        for p in (top, top / "d"):
            os.chown(p, a.uid, a.gid)
        rootdir = _root_dir(Setup(base=base, home=top, user=a, tmp=tmp_path, snapshot=""), "etc")
        _as(a, "mv", "-T", str(top / "d"), str(top / "d.real"))
        _as(a, "ln", "-s", str(rootdir), str(top / "d"))
        watch = _Inotify(rootdir)
        d = start_daemon(tmp_path / "d1", extra_env={"GPUSNAP_SOCKET_GROUP": a.group})
        try:
            res = subprocess.run(
                [*a.argv(), *d.cli_argv, "--socket", str(d.socket), "-o", "json", "restore", "ghosts"],
                capture_output=True,
                text=True,
                timeout=120,
                env=_cli_env(),
            )
            if res.returncode == 0:
                workloads.adopt(json.loads(res.stdout)["pid"])
            created = watch.created()
            watch.close()
            assert created == [], f"root created {created} in its directory for the user"
            assert res.returncode == 0, res.stderr
            pid = json.loads(res.stdout)["pid"]
            assert psutil.Process(pid).uids().real == a.uid
            os.kill(pid, signal.SIGUSR1)
            wait_for(lambda: (top / "read-1").exists(), 10, "restored holder did not read its ghost")
            assert (top / "read-1").read_bytes() == b"ghost data\n"
            assert os.readlink(f"/proc/{pid}/cwd").endswith("(deleted)")
        finally:
            stop_daemon(d)
    finally:
        subprocess.run(["rm", "-rf", str(base)])
