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

from tests.conftest import WORKLOADS, DaemonProc, kill_tree, wait_for

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
            assert "dev-shm" in dumped["phases"]
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
