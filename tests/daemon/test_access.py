"""Access control: socket permissions and SO_PEERCRED-based ownership checks."""

from __future__ import annotations

import grp
import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest

from gpusnap.daemon.drivers import host
from tests.conftest import DaemonProc, Workloads, start_daemon, stop_daemon, wait_for

NOBODY = 65534  # nobody:nogroup


@pytest.fixture
def open_daemon(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A daemon whose socket group is nogroup, so the unprivileged test user may connect."""
    os.chmod(tmp_path, 0o755)
    d = start_daemon(tmp_path, extra_env={"GPUSNAP_SOCKET_GROUP": "nogroup"})
    assert d.alive(), d.log.read_text()
    yield d
    stop_daemon(d)


def test_socket_mode_and_private_directory(daemon: DaemonProc) -> None:
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o660
    private = daemon.socket.parent / ".gpusnapd-private"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert stat.S_IMODE((daemon.store).stat().st_mode) == 0o700


def test_user_outside_the_group_cannot_connect(daemon: DaemonProc) -> None:
    """The refusal names the group the socket has on this host (none named gpusnap here: only root's), never a
    group the host may not have."""
    res = daemon.cli("ls", user=NOBODY)
    st = daemon.socket.stat()
    group = grp.getgrgid(st.st_gid).gr_name
    said = " ".join(res.stderr.split())
    assert res.returncode == 6 and f"no permission to use {daemon.socket} (mode 0660, group {group})" in said, said
    if st.st_gid == 0:
        assert "only root may" in said and "socket_group in gpusnapd.toml" in said, said
    else:
        assert f"usermod -aG {group} $USER" in said, said


def test_unprivileged_caller_may_only_touch_its_own(open_daemon: DaemonProc, workloads: Workloads) -> None:
    root_tree = workloads.start("--mem-mb", "2", "--no-listener", "--no-child", name="root")
    res = open_daemon.cli("dump", str(root_tree.pid), user=NOBODY)
    assert res.returncode == 6 and "does not belong to uid 65534" in res.stderr
    assert root_tree.proc is not None and root_tree.proc.poll() is None

    root_snap = json.loads(
        open_daemon.cli("-o", "json", "dump", str(root_tree.pid), "--name", "roots", check=True).stdout
    )
    res = open_daemon.cli("restore", "roots", user=NOBODY)
    assert res.returncode == 3 and "no snapshot" in res.stderr, "names are per owner: nobody has no 'roots'"
    res = open_daemon.cli("restore", root_snap["id"], user=NOBODY)
    assert res.returncode == 3 and "no snapshot" in res.stderr, "another's snapshot reads as missing"
    assert open_daemon.cli("rm", root_snap["id"], user=NOBODY).returncode == 3
    assert open_daemon.cli("restore", "0/roots", user=NOBODY).returncode == 3
    assert open_daemon.cli("inspect", root_snap["id"], user=NOBODY).returncode == 3


def _as_nobody(workloads: Workloads, *argv: str) -> subprocess.Popen[bytes]:
    """Run ``argv`` as nobody (setpriv execs it in place: the PID is the command's), killed at the end."""
    return workloads.spawn(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv], cwd="/")


@pytest.mark.parametrize("mode", [0o4755, 0o2755], ids=["setuid-root", "setgid-root"])
def test_unprivileged_caller_may_not_checkpoint_a_privileged_process_of_its_own(
    open_daemon: DaemonProc, workloads: Workloads, mode: int
) -> None:
    """A set-user-ID (or set-group-ID) root program that a user runs has the user's real uid, but root's effective
    and saved ids (and, set-uid, every capability): its restore would give the user's snapshot a root process as
    often as they like. Refused as NOT_OWNER before anything is touched, like another user's process."""
    d = Path(tempfile.mkdtemp(prefix="gsn-setid-", dir="/tmp"))
    try:
        os.chmod(d, 0o755)
        shutil.copy("/bin/sleep", d / "sleep")
        os.chmod(d / "sleep", mode)  # root-owned copy: sleep runs with root's effective uid (gid)
        p = _as_nobody(workloads, str(d / "sleep"), "600")
        wait_for(lambda: psutil.Process(p.pid).name() == "sleep", 10, "set-id sleep did not start")
        ids = psutil.Process(p.pid).uids() if mode & 0o4000 else psutil.Process(p.pid).gids()
        assert (ids.real, ids.effective) == (NOBODY, 0), "the kernel honoured the set-id bit"
        res = open_daemon.cli("dump", str(p.pid), "--leave-running", user=NOBODY)
        assert res.returncode == 6, res.stderr
        assert f"process {p.pid}" in res.stderr and "set-user-ID or set-group-ID" in res.stderr, res.stderr
        assert p.poll() is None, "the refused tree runs on"
    finally:
        shutil.rmtree(d)


def test_unprivileged_caller_round_trips_its_own_process(open_daemon: DaemonProc, workloads: Workloads) -> None:
    own = _as_nobody(workloads, "sleep", "600")
    wait_for(
        lambda: psutil.Process(own.pid).uids().real == NOBODY and psutil.Process(own.pid).name() == "sleep",
        10,
        "unprivileged sleep did not start",
    )
    if not host.has_capability(host.CAP_SYS_RESOURCE):
        res = open_daemon.cli("dump", str(own.pid), user=NOBODY)
        assert res.returncode == 4 and "lacks CAP_SYS_RESOURCE" in res.stderr, res.stderr
        pytest.skip("this machine withholds CAP_SYS_RESOURCE from root, so CRIU cannot dump another user's process")
    mine = json.loads(
        open_daemon.cli("-o", "json", "dump", str(own.pid), "--name", "mine", user=NOBODY, check=True).stdout
    )
    own.wait(timeout=10)
    root_tree = workloads.start("--mem-mb", "2", "--no-listener", "--no-child", name="root")
    open_daemon.cli("dump", str(root_tree.pid), "--name", "roots", check=True)
    listed = json.loads(open_daemon.cli("-o", "json", "ls", user=NOBODY, check=True).stdout)
    assert [s["id"] for s in listed] == [mine["id"]], "a user sees only its own snapshots"
    assert len(json.loads(open_daemon.cli("-o", "json", "ls", check=True).stdout)) == 2, "root sees all"
    restored = json.loads(open_daemon.cli("-o", "json", "restore", "mine", user=NOBODY, check=True).stdout)
    workloads.adopt(restored["pid"])
    assert psutil.Process(restored["pid"]).uids().real == NOBODY
