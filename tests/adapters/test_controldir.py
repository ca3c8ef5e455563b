"""A worker following Dynamo Snapshot's control-directory contract is captured and restored unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import DaemonProc, kill_tree, phase_seconds, wait_for

WORKER = Path(__file__).resolve().parent / "controldir_worker.py"


def _count(wd: Path) -> int:
    text = (wd / "count").read_text() if (wd / "count").exists() else ""
    return int(text) if text else 0


def test_control_dir_worker_round_trip(daemon: DaemonProc, tmp_path: Path) -> None:
    wd, ctl = tmp_path / "w", tmp_path / "ctl"
    wd.mkdir()
    ctl.mkdir()
    env = {**os.environ, "SNAPSHOT_CONTROL_DIR": str(ctl), "MODE": "capture"}
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(wd)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    restored_pid = 0
    try:
        wait_for(lambda: _count(wd) > 3, 20, "worker did not start")
        (wd / "capture").write_text("")
        dumped = json.loads(
            daemon.cli("-o", "json", "dump", str(proc.pid), "--control-dir", str(ctl), check=True).stdout
        )
        assert "wait-ready" in phase_seconds(dumped)
        assert proc.wait(timeout=10) == -9
        frozen = _count(wd)
        restored = json.loads(
            daemon.cli("-o", "json", "restore", dumped["id"], "--env", "MODE=restored", check=True).stdout
        )
        restored_pid = restored["pid"]
        wait_for(lambda: _count(wd) > frozen + 3, 20, "restored worker did not resume on restore-complete")
        assert (wd / "env").read_text() == "restored", "restore-context.json reached the worker"
        assert json.loads((ctl / "restore-context.json").read_text()) == {"version": 1, "env": {"MODE": "restored"}}
    finally:
        kill_tree(proc.pid, restored_pid)


def test_control_dir_worker_that_never_gets_ready(daemon: DaemonProc, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        d = daemon.cli("dump", str(proc.pid), "--control-dir", str(tmp_path / "missing"))
        assert d.returncode == 2 and "control directory" in d.stderr
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
