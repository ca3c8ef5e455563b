"""Break 1: a restore never gives a non-root snapshot's tree a file its owner could not open.

The snapshots are taken by root of a root process and re-owned (tests/reown.py says why and how): the
process holds ``~/d/x``, a file of user A with the same size and mode as root's secret.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest

from gpusnap.daemon.access import file_rights
from gpusnap.daemon.api.errors import PermissionDeniedError
from gpusnap.daemon.api.types import Creds, HostFacts, ProcessFacts, Snapshot
from tests.conftest import WORKLOADS, DaemonProc, Workloads, kill_tree, start_daemon, stop_daemon, wait_for
from tests.reown import reown
from tests.shortdirs import short_dir
from tests.users import User

SECRET = b"TOPSECRET-root-only\n"
HARMLESS = b"harmless-user-data!\n"  # same size as SECRET
assert len(SECRET) == len(HARMLESS)
SYSTEM_PYTHON = "/usr/bin/python3"
"""The holder runs on a Python every user may open (this test's may live under root's home)."""


@dataclass
class Setup:
    base: Path
    home: Path
    secret: Path
    user: User
    snap_dir: Path
    tmp: Path


def _as(user: User, *cmd: str) -> None:
    subprocess.run([*user.argv(), *cmd], check=True)


@pytest.fixture
def reowned(tmp_path: Path, hostile: tuple[User, User], workloads: Workloads) -> Iterator[Setup]:
    a, _ = hostile
    base = short_dir("gpusnap-rights-")
    home = base / "home"
    (home / "d").mkdir(parents=True)
    (home / "d" / "x").write_bytes(HARMLESS)
    os.chmod(home / "d" / "x", 0o600)
    for p in (home, home / "d", home / "d" / "x"):
        os.chown(p, a.uid, a.gid)
    secret = base / "secret"
    secret.write_bytes(SECRET)
    os.chmod(secret, 0o600)
    holder = workloads.spawn([SYSTEM_PYTHON, str(WORKLOADS / "holder.py"), str(home / "d" / "x"), str(home)], cwd=home)
    wait_for(lambda: (home / "ready").exists(), 30, "holder did not start")
    d = start_daemon(tmp_path / "d1")
    try:
        snap = json.loads(d.cli("-o", "json", "dump", str(holder.pid), "--name", "mine", check=True).stdout)
    finally:
        stop_daemon(d)
    holder.wait(timeout=10)
    snap_dir = d.store / "snapshots" / snap["id"]
    reown(snap_dir, a)
    (home / "ready").unlink()
    try:
        yield Setup(base=base, home=home, secret=secret, user=a, snap_dir=snap_dir, tmp=tmp_path)
    finally:
        subprocess.run(["rm", "-rf", str(base)])


@pytest.fixture
def user_daemon(reowned: Setup) -> Iterator[DaemonProc]:
    """A daemon on the re-owned snapshot's store that the test users may call."""
    d = start_daemon(reowned.tmp / "d1", extra_env={"GPUSNAP_SOCKET_GROUP": reowned.user.group})
    assert d.alive(), d.log.read_text()
    yield d
    stop_daemon(d)


def _restore_as(d: DaemonProc, user: User) -> subprocess.CompletedProcess[str]:
    cmd = [*user.argv(), *d.cli_argv, "--socket", str(d.socket), "-o", "json", "restore", "mine"]
    from tests.conftest import _cli_env

    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_cli_env())


def _assert_refused_without_leak(res: subprocess.CompletedProcess[str], s: Setup, phrase: str) -> None:
    assert res.returncode == 6, (res.returncode, res.stderr)  # PERMISSION_DENIED
    assert phrase in res.stderr and str(s.home / "d" / "x") in res.stderr, res.stderr
    assert "bad size" not in res.stderr and "mode" not in res.stderr.replace("model", ""), res.stderr
    assert not any(p.name.startswith("read-") for p in s.home.iterdir())


def test_a_symlink_swapped_in_for_a_held_file_is_refused(
    reowned: Setup, user_daemon: DaemonProc, workloads: Workloads
) -> None:
    s = reowned
    x = s.home / "d" / "x"
    _as(s.user, "mv", str(x), str(s.home / "d" / "x.orig"))
    _as(s.user, "ln", "-s", str(s.secret), str(x))
    _assert_refused_without_leak(_restore_as(user_daemon, s.user), s, "is reached through a symlink")

    # The same with a directory on the way swapped for a link to a root directory holding an "x".
    _as(s.user, "rm", str(x))
    _as(s.user, "mv", str(s.home / "d"), str(s.home / "d.real"))
    rootdir = s.base / "rootdir"
    rootdir.mkdir()
    (rootdir / "x").write_bytes(SECRET)
    os.chmod(rootdir / "x", 0o600)
    _as(s.user, "ln", "-s", str(rootdir), str(s.home / "d"))
    _assert_refused_without_leak(_restore_as(user_daemon, s.user), s, "is reached through a symlink")

    # A different file of the user's own at the path is not the one held either.
    _as(s.user, "rm", str(s.home / "d"))
    _as(s.user, "mkdir", str(s.home / "d"))
    _as(s.user, "cp", str(s.home / "d.real" / "x.orig"), str(x))
    _assert_refused_without_leak(_restore_as(user_daemon, s.user), s, "is not the file the snapshot held")

    # Put back as it was: the owner restores it, and the restored process reads the owner's file.
    _as(s.user, "rm", "-r", str(s.home / "d"))
    _as(s.user, "mv", str(s.home / "d.real"), str(s.home / "d"))
    _as(s.user, "mv", str(s.home / "d" / "x.orig"), str(x))
    res = _restore_as(user_daemon, s.user)
    assert res.returncode == 0, res.stderr
    restored = json.loads(res.stdout)
    workloads.adopt(restored["pid"])
    assert psutil.Process(restored["pid"]).uids().real == s.user.uid
    os.kill(restored["pid"], signal.SIGUSR1)
    wait_for(lambda: (s.home / "read-1").exists(), 10, "restored holder did not read its file")
    assert (s.home / "read-1").read_bytes() == HARMLESS


def test_a_file_the_owner_may_no_longer_open_is_refused(reowned: Setup, user_daemon: DaemonProc) -> None:
    os.chown(reowned.home / "d", 0, 0)  # root takes the directory away: A cannot reach x any more
    os.chmod(reowned.home / "d", 0o700)
    _assert_refused_without_leak(_restore_as(user_daemon, reowned.user), reowned, "is not one uid")


def test_what_a_restored_tree_holds_is_checked_as_its_owner(tmp_path: Path, hostile: tuple[User, User]) -> None:
    """Step 3 (CRIU's post-restore) on a real tree: a process of A that holds root's secret (opened before
    it dropped to A, as CRIU would open a swapped path) is refused; one that holds A's own file passes."""
    a, _ = hostile
    base = short_dir("gpusnap-rights-")
    secret, own = base / "secret", base / "own"
    secret.write_bytes(SECRET)
    os.chmod(secret, 0o600)
    own.write_bytes(HARMLESS)
    os.chown(own, a.uid, a.gid)
    snapshot = Snapshot(
        id="snap-test",
        name="",
        created=datetime.now(UTC),
        labels={},
        source=ProcessFacts(pid=1, comm="", cmdline=(), uid=a.uid, gid=a.gid, tree_pids=(1,), rss_bytes=0, cwd="/"),
        host=HostFacts(
            hostname="", kernel="", machine="", criu_version="", gpusnap_version="", cpu_model="", cpu_flags=()
        ),
        files=(),
        phases=(),
        owner_uid=a.uid,
        owner_creds=Creds(uid=a.uid, gid=a.gid, groups=(a.gid,)),
    )
    script = f"import os,sys,time; fd=os.open(sys.argv[1], os.O_RDONLY); os.setgroups([]); os.setgid({a.gid}); os.setuid({a.uid}); time.sleep(60)"
    procs = []
    try:
        for path in (own, secret):
            p = subprocess.Popen(
                [SYSTEM_PYTHON, "-c", script, str(path)],
                cwd="/",
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs.append(p)
            wait_for(lambda p=p: psutil.Process(p.pid).uids().real == a.uid, 10, "holder did not drop to A")
        file_rights.check_restored(snapshot, procs[0].pid)
        with pytest.raises(
            PermissionDeniedError, match=f"{secret} \\(fd 3 of restored PID {procs[1].pid}\\) is not one uid"
        ):
            file_rights.check_restored(snapshot, procs[1].pid)
    finally:
        kill_tree(*(p.pid for p in procs))
        subprocess.run(["rm", "-rf", str(base)])


def test_each_file_is_checked_with_the_rights_of_the_process_that_held_it(
    tmp_path: Path, hostile: tuple[User, User]
) -> None:
    """Issue 26, item 1: in root's snapshot of a tree whose processes ran as A and as B, each held path is
    checked as its holder ran: A's file is A's to open, B's is B's; the same files held the other way round
    are refused (B may not open A's 0600 file), and a process that ran as root is not checked."""
    import dataclasses

    from gpusnap.daemon.api.types import HeldFile, ProcessCreds

    a, b = hostile
    base = short_dir("gpusnap-rights-")
    try:
        files = {}
        for user in (a, b):
            path = base / f"of-{user.name}"
            path.write_bytes(HARMLESS)
            os.chmod(path, 0o600)
            os.chown(path, user.uid, user.gid)
            files[user.uid] = path
        secret = base / "secret"
        secret.write_bytes(SECRET)
        os.chmod(secret, 0o600)
        os.chmod(base, 0o755)

        def held(pid: int, path: Path) -> HeldFile:
            st = os.stat(path)
            return HeldFile(pid=pid, what="fd 3", path=str(path), dev=st.st_dev, ino=st.st_ino, access=os.R_OK)

        snapshot = Snapshot(
            id="snap-test",
            name="",
            created=datetime.now(UTC),
            labels={},
            source=ProcessFacts(pid=1, comm="", cmdline=(), uid=0, gid=0, tree_pids=(1, 2, 3), rss_bytes=0, cwd="/"),
            host=HostFacts(
                hostname="", kernel="", machine="", criu_version="", gpusnap_version="", cpu_model="", cpu_flags=()
            ),
            files=(),
            phases=(),
            owner_uid=0,
            tree_creds=(ProcessCreds(1, 0, 0), ProcessCreds(2, a.uid, a.gid), ProcessCreds(3, b.uid, b.gid)),
            held_files=(held(1, secret), held(2, files[a.uid]), held(3, files[b.uid])),
        )
        file_rights.check_before_restore(snapshot, private_shm=False)  # each its holder's; root's unchecked
        swapped = dataclasses.replace(snapshot, held_files=(held(2, files[b.uid]), held(3, files[a.uid])))
        with pytest.raises(PermissionDeniedError) as err:
            file_rights.check_before_restore(swapped, private_shm=False)
        assert f"{files[b.uid]} (fd 3 of PID 2) is not one uid {a.uid} may open" in err.value.message
        assert f"{files[a.uid]} (fd 3 of PID 3) is not one uid {b.uid} may open" in err.value.message
        as_a = dataclasses.replace(snapshot, held_files=(held(2, secret),))
        with pytest.raises(PermissionDeniedError):  # root's file, held by A's process: refused
            file_rights.check_before_restore(as_a, private_shm=False)
    finally:
        subprocess.run(["rm", "-rf", str(base)])
