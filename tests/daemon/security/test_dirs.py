"""Directories root writes into or serves from: symlinks at any depth, other users' directories, planted
runtime directories, another daemon's sockets (issue 10, breaks 3 and 5, and the agent-socket takeover)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.access import safefs
from gpusnap.daemon.api.errors import InvalidArgumentError, PermissionDeniedError
from gpusnap.daemon.workers import controldir
from tests.conftest import start_daemon, stop_daemon
from tests.shortdirs import short_dir
from tests.users import User


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory every user may search (pytest's tmp_path sits below root's 0700 directory, where a
    user's own walk, and so gpusnapd's walk for the user, stops)."""
    d = Path(tempfile.mkdtemp(prefix="gpusnap-dirs-"))
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_symlink_in_a_middle_component_is_not_followed(open_tmp: Path, hostile: tuple[User, User]) -> None:
    """Break 3: `--control-dir ~/l/x` with `~/l` swapped for a link to a root directory."""
    a, _ = hostile
    tmp_path = open_tmp
    home = tmp_path / "home"
    (home / "real" / "x").mkdir(parents=True)
    os.chown(home / "real" / "x", a.uid, a.gid)
    rootdir = tmp_path / "rootdir"
    (rootdir / "x").mkdir(parents=True)  # root's, the attacker's target
    (home / "l").symlink_to(rootdir)
    with pytest.raises(InvalidArgumentError, match="symlink"):
        controldir.write_context(home / "l" / "x", a.uid, {"LD_PRELOAD": "/evil.so"}, [])
    with pytest.raises(InvalidArgumentError, match="symlink"):
        controldir.write_context(home / "l" / "x", 0, {"LD_PRELOAD": "/evil.so"}, [])
    assert list((rootdir / "x").iterdir()) == [], "nothing was written through the link"
    controldir.write_context(home / "real" / "x", a.uid, {"A": "1"}, [])
    assert (home / "real" / "x" / controldir.RESTORE_CONTEXT).is_file()
    with pytest.raises(InvalidArgumentError):
        with safefs.open_dir(str(home / "real" / ".." / "real" / "x"), a.uid):
            pass


def test_no_answer_tells_what_lies_below_a_directory_the_caller_cannot_search(
    open_tmp: Path, hostile: tuple[User, User]
) -> None:
    """gpusnapd walks a caller's --control-dir (and wake directory) as root: below root's 0700 directory,
    a missing path, a file, a symlink and a directory (the caller's own, even) once got four different
    answers (no such file / symlink / not owned), an existence oracle for any path the caller cannot
    stat. Now the walk stops where the caller's own would, with one answer for all."""
    a, _ = hostile
    private = open_tmp / "private"
    (private / "dir").mkdir(parents=True)
    os.chmod(private, 0o700)
    (private / "file").write_text("secret")
    (private / "link").symlink_to("/etc")
    os.chown(private / "dir", a.uid, a.gid)
    answers = set()
    for name in ("missing", "file", "link", "dir"):
        with pytest.raises(PermissionDeniedError) as exc:
            controldir.check_dir(str(private / name), a.uid)
        assert exc.value.reason == "NOT_OWNER"
        answers.add(exc.value.message.replace(f"/{name} is", "/NAME is"))
    assert answers == {
        f"{private}/NAME is not a directory uid {a.uid} can reach (it may not search {private}); "
        "use a directory of your own"
    }
    os.chmod(private, 0o711)  # searchable: the caller could now stat these itself, and is told
    controldir.check_dir(str(private / "dir"), a.uid)
    with pytest.raises(InvalidArgumentError, match="No such file"):
        controldir.check_dir(str(private / "missing"), a.uid)
    os.chown(private, a.uid, a.gid)
    os.chmod(private, 0o611)  # the owner's bits count for the owner, not others'
    with pytest.raises(PermissionDeniedError, match="may not search"):
        controldir.check_dir(str(private / "dir"), a.uid)
    os.chown(private / "dir", 0, 0)
    controldir.check_dir(str(private / "dir"), 0)  # root's own walk is not limited


def test_only_the_callers_own_directory_is_accepted(tmp_path: Path, hostile: tuple[User, User]) -> None:
    """Break 3: a root-owned directory (or another user's) is no longer a valid control directory."""
    a, b = hostile
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(PermissionDeniedError):
        controldir.signal_file(d, a.uid, controldir.RESTORE_COMPLETE)
    os.chown(d, b.uid, b.gid)
    with pytest.raises(PermissionDeniedError):
        controldir.signal_file(d, a.uid, controldir.RESTORE_COMPLETE)
    assert not (d / controldir.RESTORE_COMPLETE).exists()


def _sock_dir(mode: int = 0o755) -> Path:
    return short_dir("gpusnap-sock-", mode)


def _refused(tmp_path: Path, socket_dir: Path, reason: str) -> str:
    env = {"GPUSNAP_AGENT_SOCKET": str(socket_dir / "agent.sock")}
    d = start_daemon(tmp_path, extra_env=env, socket_dir=socket_dir)
    try:
        assert d.proc.wait(timeout=60) != 0, "gpusnapd must refuse to start"
    finally:
        d.proc.kill()
        d.proc.wait()
    log = d.log.read_text()
    assert reason in log, log
    return log


def test_daemon_refuses_a_socket_directory_others_can_write(tmp_path: Path, hostile: tuple[User, User]) -> None:
    """Break 5: socket directory owned by a user, or writable by everyone (not sticky)."""
    a, _ = hostile
    owned = _sock_dir()
    os.chown(owned, a.uid, a.gid)
    _refused(tmp_path / "1", owned, "UNSAFE_SOCKET_DIR")
    _refused(tmp_path / "2", _sock_dir(0o777), "UNSAFE_SOCKET_DIR")


def test_daemon_never_adopts_or_chmods_a_planted_runtime_directory(tmp_path: Path) -> None:
    """Break 5: a pre-made `.gpusnapd-private` is not adopted; a `wake` link's target is not made 1777."""
    planted = _sock_dir()
    (planted / ".gpusnapd-private").mkdir(mode=0o755)
    os.chmod(planted / ".gpusnapd-private", 0o755)
    _refused(tmp_path / "1", planted, "UNSAFE_RUNTIME_DIR")
    assert stat.S_IMODE((planted / ".gpusnapd-private").stat().st_mode) == 0o755

    linked = _sock_dir()
    target = tmp_path / "etc-like"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    (linked / "wake").symlink_to(target)
    _refused(tmp_path / "2", linked, "UNSAFE_RUNTIME_DIR")
    assert stat.S_IMODE(target.stat().st_mode) == 0o755, "the link's target kept its mode"


def test_the_wake_directory_is_not_world_writable(tmp_path: Path, hostile: tuple[User, User]) -> None:
    """Issue 19 item 7: the agents' wake directory beside the agent socket was 1777, and by default it is
    /run/gpusnap/wake, on the tmpfs of /run: any user could fill the tmpfs the system keeps its runtime
    state on. It is 0755 now (only gpusnapd writes there: the wake files); an earlier gpusnapd's 1777
    one is narrowed, not refused."""
    user, _ = hostile
    d = start_daemon(tmp_path / "d")
    try:
        assert d.alive(), d.log.read_text()
        wake = d.agent_socket.parent / "wake"
        assert stat.S_IMODE(wake.stat().st_mode) == 0o755 and wake.stat().st_uid == 0
        res = subprocess.run([*user.argv(), "touch", str(wake / "filler")], capture_output=True, text=True)
        assert res.returncode != 0 and not (wake / "filler").exists(), "a user cannot write there"
    finally:
        stop_daemon(d)
    earlier = _sock_dir()
    (earlier / "wake").mkdir()
    os.chmod(earlier / "wake", 0o1777)  # as an earlier gpusnapd made it
    d = start_daemon(tmp_path / "e", socket_dir=earlier)
    try:
        assert d.alive(), d.log.read_text()
        assert stat.S_IMODE((earlier / "wake").stat().st_mode) == 0o755
    finally:
        stop_daemon(d)


def test_a_second_daemon_neither_takes_over_nor_deletes_the_agent_socket(tmp_path: Path) -> None:
    first = start_daemon(tmp_path / "first")
    try:
        assert first.alive(), first.log.read_text()
        ino = first.agent_socket.stat().st_ino
        second = start_daemon(tmp_path / "second", extra_env={"GPUSNAP_AGENT_SOCKET": str(first.agent_socket)})
        try:
            assert second.proc.wait(timeout=60) != 0
        finally:
            stop_daemon(second)
        assert "SOCKET_IN_USE" in second.log.read_text()
        assert first.agent_socket.stat().st_ino == ino, "the first daemon's agent socket is untouched"
        res = subprocess.run(
            ["python3", "-c", f"import socket; s=socket.socket(socket.AF_UNIX); s.connect({str(first.agent_socket)!r})"]
        )
        assert res.returncode == 0
    finally:
        stop_daemon(first)


def test_a_refused_start_leaves_no_agent_socket_behind(tmp_path: Path) -> None:
    """Issue 19 item 7: a daemon refused after it had bound its agent socket (here: its API socket is
    another daemon's) exited leaving ``agent.sock`` (and the wake directory) behind."""
    first = start_daemon(tmp_path / "first")
    try:
        assert first.alive(), first.log.read_text()
        agent_dir = short_dir("gpusnap-agent-")
        second = start_daemon(
            tmp_path / "second",
            socket_dir=first.socket.parent,
            extra_env={"GPUSNAP_AGENT_SOCKET": str(agent_dir / "agent.sock")},
        )
        try:
            assert second.proc.wait(timeout=60) == 4, second.log.read_text()
        finally:
            if second.alive():  # (not stop_daemon: its socket directory is the first daemon's)
                second.proc.kill()
                second.proc.wait()
        assert "SOCKET_IN_USE" in second.log.read_text()
        assert os.listdir(agent_dir) == [], "neither agent.sock nor wake is left"
        first.client().node_info()  # the first daemon serves on
        os.rmdir(agent_dir)
    finally:
        stop_daemon(first)


def test_two_daemons_with_api_sockets_in_one_directory_each_answer_their_own(tmp_path: Path) -> None:
    """Issue 19 item 5: the private gRPC socket was always ``<dir>/.gpusnapd-private/grpc.sock``, so a second
    daemon unlinked the first's and bound its own: calls to the first reached the second, which refused
    them ("the connection closed before its call could be attributed to a caller"). Now each daemon's
    private socket is named after its public one."""
    first = start_daemon(tmp_path / "first", socket_name="a.sock")
    try:
        assert first.alive(), first.log.read_text()
        second = start_daemon(
            tmp_path / "second",
            socket_dir=first.socket.parent,
            socket_name="b.sock",
            extra_env={"GPUSNAP_AGENT_SOCKET": str(first.socket.parent / "agent-b.sock")},
        )
        try:
            assert second.alive(), second.log.read_text()
            for d in (first, second):
                res = d.cli("-o", "json", "node", check=True)
                assert json.loads(res.stdout)["store_path"] == str(d.store), res.stdout
        finally:
            second.proc.terminate()  # not stop_daemon: it removes the socket directory they share
            second.proc.wait(timeout=30)
        assert first.cli("ls").returncode == 0, "the first daemon still answers once the second is gone"
    finally:
        stop_daemon(first)
