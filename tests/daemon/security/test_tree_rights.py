"""Issue 26, item 1: a snapshot's rights are those of the user its tree ran as, whoever took and restores it.

An orchestrator (root) dumps user A's worker: the snapshot is root's to list and restore, but every path
the restore acts on for the tree is acted on with A's rights. Before, root's restore of such a snapshot
acted as root: after A swapped ``~/d`` for a symlink into a root directory, A's restored process held
root's 0600 file; after A swapped ``~/s``, root's service socket was replaced by A's listener; a file copy
was made by root.

Root lacks CAP_SYS_RESOURCE here, so CRIU cannot dump A's process: root's process is dumped and its images
re-owned to A, the snapshot left root's as root's dump of A's tree records it (tests/reown.py). Each case
runs on a manifest that records every process's rights, and on one that does not (as gpusnap wrote them
before): both get the same treatment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import DaemonProc, Workloads, start_daemon, stop_daemon, wait_for
from tests.daemon.security.root_service import root_service
from tests.reown import dumped_by_root, reown
from tests.shortdirs import short_dir
from tests.users import User

SECRET = b"TOPSECRET-root-only\n"
HARMLESS = b"harmless-user-data!\n"  # same size as SECRET


@dataclass
class Setup:
    base: Path
    home: Path
    user: User
    tmp: Path


def _as(user: User, *cmd: str) -> None:
    subprocess.run([*user.argv(), *cmd], check=True)


@pytest.fixture(params=["recorded", "older-manifest"])
def roots_snapshot_of_users_tree(
    request: pytest.FixtureRequest, tmp_path: Path, hostile: tuple[User, User]
) -> Iterator[Setup]:
    """Root's snapshot ``a-worker`` of a tree that ran as A, holding ``~/d/x``, listening on ``~/s/api.sock``
    and writing ``~/d/log``."""
    a, _ = hostile
    base = short_dir("gpusnap-tree-")
    home = base / "home"
    (home / "d").mkdir(parents=True)
    (home / "s").mkdir()
    (home / "d" / "x").write_bytes(HARMLESS)
    os.chmod(home / "d" / "x", 0o600)
    try:
        snap = dumped_by_root(
            tmp_path,
            "a-worker",
            home / "ready",
            "user_paths.py",
            str(home / "d" / "x"),
            str(home / "s" / "api.sock"),
            str(home / "d" / "log"),
            str(home),
            cwd=str(home),
        )
        reown(snap, a, owner=False, tree_creds=request.param == "recorded")
        (home / "ready").unlink()
        for p in (home, home / "d", home / "s", home / "d" / "x", home / "d" / "log", home / "s" / "api.sock"):
            os.chown(p, a.uid, a.gid, follow_symlinks=False)
        yield Setup(base=base, home=home, user=a, tmp=tmp_path)
    finally:
        subprocess.run(["rm", "-rf", str(base)])


def _root_dir(s: Setup, name: str) -> Path:
    """A directory of root's, readable by all, that A may not write."""
    d = s.base / name
    d.mkdir(mode=0o755)
    return d


def _restore(d: DaemonProc, workloads: Workloads) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    res = d.cli("-o", "json", "restore", "a-worker")
    doc = json.loads(res.stdout) if res.stdout.strip().startswith("{") else {}
    if res.returncode == 0:
        workloads.adopt(int(doc["pid"]))  # type: ignore[call-overload]
    return res, doc


def test_roots_restore_of_a_users_tree_acts_with_the_users_rights(
    roots_snapshot_of_users_tree: Setup, workloads: Workloads
) -> None:
    s = roots_snapshot_of_users_tree
    d = start_daemon(s.tmp / "d1")
    try:
        assert d.alive(), d.log.read_text()
        (manifest,) = (d.store / "snapshots").glob("*/manifest.json")
        assert json.loads(manifest.read_text())["owner_uid"] == 0, "root's snapshot"

        # 1. ~/d swapped for a link to a root directory holding root's 0600 "x" (and a "log"): refused.
        rootdir = _root_dir(s, "rootdir")
        for name in ("x", "log"):
            (rootdir / name).write_bytes(SECRET)
            os.chmod(rootdir / name, 0o600)
        _as(s.user, "mv", "-T", str(s.home / "d"), str(s.home / "d.real"))
        _as(s.user, "ln", "-s", str(rootdir), str(s.home / "d"))
        res, doc = _restore(d, workloads)
        assert res.returncode == 6, (res.returncode, res.stderr)  # PERMISSION_DENIED
        assert doc["error"]["reason"] == "FILE_NOT_PERMITTED", doc  # type: ignore[index]
        assert "is reached through a symlink" in res.stderr and f"uid {s.user.uid}" in res.stderr, res.stderr
        assert sorted(os.listdir(rootdir)) == ["log", "x"], "a file copy was made in root's directory"
        _as(s.user, "rm", str(s.home / "d"))
        _as(s.user, "mv", "-T", str(s.home / "d.real"), str(s.home / "d"))

        # 2. ~/s swapped for a link to a directory where root's service listens on api.sock: root's socket
        # stays root's and answers; the restore is refused (A may not bind there).
        service = _root_dir(s, "service")
        with root_service(service / "api.sock") as intact:
            _as(s.user, "mv", "-T", str(s.home / "s"), str(s.home / "s.real"))
            _as(s.user, "ln", "-s", str(service), str(s.home / "s"))
            try:
                res, doc = _restore(d, workloads)
                intact()
                assert res.returncode != 0 and "api.sock" in res.stderr, (res.returncode, res.stderr)
            finally:
                _as(s.user, "rm", str(s.home / "s"))
                _as(s.user, "mv", "-T", str(s.home / "s.real"), str(s.home / "s"))

        # 3. Put back, with the log grown meanwhile: root's restore succeeds, the tree runs as A, reads A's
        # file, listens on A's path, and continues a copy of the log that A made.
        _as(s.user, "sh", "-c", f"echo more >> {s.home / 'd' / 'log'}")
        res, doc = _restore(d, workloads)
        assert res.returncode == 0, res.stderr
        pid = int(doc["pid"])  # type: ignore[call-overload]
        assert psutil.Process(pid).uids().real == s.user.uid
        copies = doc["replicas"][0]["file_copies"]  # type: ignore[index]
        assert [c["path"] for c in copies] == [str(s.home / "d" / "log")], doc  # type: ignore[union-attr,index]
        copy = Path(copies[0]["copy"])  # type: ignore[index]
        assert (os.stat(copy).st_uid, copy.parent) == (s.user.uid, s.home / "d"), "the copy is not A's"
        assert os.lstat(s.home / "s" / "api.sock").st_uid == s.user.uid
        os.kill(pid, signal.SIGUSR1)
        wait_for(lambda: (s.home / "read-1").exists(), 10, "the restored process did not read its file")
        assert (s.home / "read-1").read_bytes() == HARMLESS
    finally:
        stop_daemon(d)
