"""CRIU's link remaps in /dev/shm (``link_remap.N``) never outlive the dump that made them.

A file a process maps under a name since removed but still linked under another (glibc ``sem_open``,
so every multiprocessing lock of vLLM's processes) is dumped by CRIU as a link remap: a new hard link
``link_remap.<file id>`` beside it. CRIU removes it after a dump that leaves the tree running, but
keeps it after one that kills the tree (for a restore on this host), so the next dump of a tree of
the same shape picks the same file id and fails on "Can't link remap ... File exists". gpusnap
carries the name in the snapshot's /dev/shm copy instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import WORKLOADS, DaemonProc, kill_tree, phase_seconds, wait_for

SHM = Path("/dev/shm")


def _remaps() -> set[str]:
    return {p.name for p in SHM.glob("link_remap.*")}


def _start(wd: Path) -> subprocess.Popen[bytes]:
    wd.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(WORKLOADS / "spawn_lock.py"), str(wd)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for((wd / "ready").exists, 20, "spawn_lock did not start")
    return proc


def _count(wd: Path) -> int:
    lines = (wd / "log").read_text().split()
    return int(lines[-1]) if lines else 0


def test_dumps_that_kill_leave_no_link_remap_and_restore(daemon: DaemonProc, tmp_path: Path) -> None:
    before = _remaps()
    pids: list[int] = []
    try:
        snaps = []
        for n in range(2):  # the second tree has the first one's shape: same CRIU file ids
            wd = tmp_path / f"w{n}"
            proc = _start(wd)
            pids.append(proc.pid)
            tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
            dumped = json.loads(daemon.cli("-o", "json", "dump", str(proc.pid), check=True).stdout)
            assert "dev-shm" in phase_seconds(dumped)
            proc.wait(timeout=10)  # a --host-pidns restore needs the tree's PIDs free: reaped, not zombies
            wait_for(lambda tree=tree: not any(map(psutil.pid_exists, tree)), 20, "the dumped tree's PIDs stay taken")
            assert _remaps() == before, "the dump left CRIU's link remap in /dev/shm"
            snaps.append((dumped["id"], wd))
        for (snap, wd), host_pidns in zip(snaps, (False, True), strict=True):
            seen = _count(wd)
            extra = ["--host-pidns"] if host_pidns else []
            restored = json.loads(daemon.cli("-o", "json", "restore", snap, *extra, check=True).stdout)
            pids.append(restored["pid"])
            wait_for(lambda wd=wd, seen=seen: _count(wd) > seen + 5, 20, "the restored tree does not take its lock")
            assert _remaps() == before, "the restore left a link remap in /dev/shm"
    finally:
        kill_tree(*pids)
        time.sleep(0.1)


def test_dev_shm_of_a_child_forked_after_preflight_is_saved(daemon: DaemonProc, tmp_path: Path) -> None:
    """The /dev/shm files saved beside the images are those of the tree as CRIU froze it: a child forked
    after preflight (here while the capture waits for a control-directory worker) was dumped by CRIU, but
    its /dev/shm file was looked for among the preflight tree's only, so the restore had no file to map."""
    cdir = tmp_path / "ctl"
    cdir.mkdir()
    name = f"gsn-late-{tmp_path.name}"
    proc = subprocess.Popen(
        [sys.executable, str(WORKLOADS / "late_shm_child.py"), str(cdir), name],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    pids = [proc.pid]
    try:
        wait_for((cdir / "started").exists, 20, "late_shm_child did not start")
        assert psutil.Process(proc.pid).children() == [], "no child before the capture's preflight"
        op = daemon.cli("dump", str(proc.pid), "--control-dir", str(cdir), "--detach", check=True).stdout.strip()
        wait_for(
            lambda: json.loads(daemon.cli("-o", "json", "ops", check=True).stdout)[0]["phase"] == "wait-ready",
            20,
            "the capture does not wait for the worker",
        )
        (cdir / "go").touch()  # now the worker forks its child
        done = json.loads(daemon.cli("-o", "json", "wait", op, check=True).stdout)
        proc.wait(timeout=10)
        assert "dev-shm" in [p["phase"] for p in done["phases"]], "the child's /dev/shm file was not saved"
        assert not Path(f"/dev/shm/{name}").exists(), "the dump that ended the tree left its /dev/shm file behind"
        (cdir / "log").write_text("")
        restored = json.loads(daemon.cli("-o", "json", "restore", done["snapshot"]["id"], check=True).stdout)
        pids.append(restored["pid"])
        wait_for(lambda: (cdir / "log").read_text().count("ok") > 5, 20, "the restored child lost its memory")
    finally:
        kill_tree(*pids)
        Path(f"/dev/shm/{name}").unlink(missing_ok=True)
