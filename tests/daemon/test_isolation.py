"""Restored copies are isolated: private /dev/shm per restore, and private networks with --private-net."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.conftest import WORKLOADS, DaemonProc, kill_tree, phase_seconds, wait_for


def _counts(log: Path) -> dict[str, list[int]]:
    by_ns: dict[str, list[int]] = defaultdict(list)
    for line in log.read_text().splitlines():
        ns, _, n = line.partition(" ")
        if n:
            by_ns[ns].append(int(n))
    return by_ns


def test_copies_and_source_run_side_by_side(daemon: DaemonProc, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = f"gpusnap-test-{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, str(WORKLOADS / "shm_counter.py"), str(tmp_path), name, str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    pids: list[int] = [proc.pid]
    try:
        wait_for((tmp_path / "ready").exists, 20, "worker did not start")
        dumped = json.loads(daemon.cli("-o", "json", "dump", str(proc.pid), "--leave-running", check=True).stdout)
        assert "dev-shm" in phase_seconds(dumped)
        for _ in range(2):  # two copies beside the running source: same port, same shm name
            restored = json.loads(daemon.cli("-o", "json", "restore", dumped["id"], "--private-net", check=True).stdout)
            pids.append(restored["pid"])
        wait_for(
            lambda: (
                len(_counts(tmp_path / "log")) == 3 and min(len(v) for v in _counts(tmp_path / "log").values()) > 20
            ),
            30,
            "three counters (source and two copies) did not all run",
        )
        for ns, values in _counts(tmp_path / "log").items():
            tail = values[-15:]
            assert tail == list(range(tail[0], tail[0] + len(tail))), f"{ns}: counter shared with another copy: {tail}"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the source still owns the host's port
    finally:
        kill_tree(*pids)
        Path("/dev/shm", name).unlink(missing_ok=True)


def test_private_net_refused_with_host_pidns(daemon: DaemonProc, tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        snap = json.loads(daemon.cli("-o", "json", "dump", str(proc.pid), check=True).stdout)["id"]
        res = daemon.cli("restore", snap, "--private-net", "--host-pidns")
        assert res.returncode == 2 and "--private-net" in res.stderr
    finally:
        kill_tree(proc.pid)


def test_restore_onto_a_taken_port_is_refused(daemon: DaemonProc, workloads: object) -> None:
    from tests.conftest import Workloads

    assert isinstance(workloads, Workloads)
    w = workloads.start("--mem-mb", "2", "--no-child")
    snap = json.loads(daemon.cli("-o", "json", "dump", str(w.pid), "--leave-running", check=True).stdout)["id"]
    port = w.read("port")
    res = daemon.cli("restore", snap)
    assert res.returncode == 4 and f":{port}" in res.stderr and "--private-net" in res.stderr, res.stderr
    restored = json.loads(daemon.cli("-o", "json", "restore", snap, "--private-net", check=True).stdout)
    workloads.adopt(restored["pid"])
