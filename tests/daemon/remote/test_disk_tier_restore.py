"""The disk tier's budget end to end, against the real gateway: two PyTorch CPU workers
(tests/adapters/torch_cpu_worker.py) name 48 MiB of weights each, under a disk-tier budget that holds one
blob. Nothing leaves while nothing is pushed; once one snapshot is pushed its blob goes, ``gpusnap store``
shows it in the remote row, and a restore fetches it back and gives the same tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.adapters import torch_venv
from tests.adapters.test_buffers_cpu import WORKER, Worker
from tests.conftest import DaemonProc, kill_tree, phase_seconds, wait_for
from tests.daemon.remote.fleet import Fleet, cli_json

pytestmark = torch_venv.needs_venv

MIB = 48
WEIGHTS = MIB << 20


class SmallWorker(Worker):
    def __init__(self, node: DaemonProc, tmp: Path, name: str, *args: str):  # noqa: D107
        self.wd = tmp / name
        self.wd.mkdir()
        env = torch_venv.worker_env(node, tmp)
        self.proc = torch_venv.start(WORKER, [str(self.wd), "--mib", str(MIB), *args], env, self.wd / "out")
        wait_for(lambda: (self.wd / "ready").exists() or self.proc.poll() is not None, 120, "worker did not start")
        assert self.proc.poll() is None, (self.wd / "out").read_text()[-3000:]
        self.n = 0


def _tiers(d: DaemonProc) -> dict[str, Any]:
    return {t["name"]: t for t in cli_json(d, "store")["tiers"]}


def test_pushed_blobs_leave_the_disk_tier_and_a_restore_fetches_them_back(fleet: Fleet, tmp_path: Path) -> None:
    d = fleet.node("a", GPUSNAP_DISK_TIER_BYTES=str(WEIGHTS + WEIGHTS // 2))
    first, second = SmallWorker(d, tmp_path, "first"), SmallWorker(d, tmp_path, "second", "--seed", "1")
    pids = [first.proc.pid, second.proc.pid]
    try:
        before = first.generate()
        d.cli("dump", str(first.proc.pid), "--name", "first", check=True)
        d.cli("dump", str(second.proc.pid), "--name", "second", check=True)
        tiers = _tiers(d)
        assert tiers["disk"]["blobs"] == 2 and tiers["disk"]["used_bytes"] > tiers["disk"]["budget_bytes"]
        assert tiers["remote"]["blobs"] == 0, "nothing pushed: nothing leaves"

        cli_json(d, "push", "first")
        wait_for(lambda: _tiers(d)["remote"]["blobs"] == 1, 60, "the pushed blob did not leave the disk tier")
        tiers = _tiers(d)
        assert tiers["disk"]["blobs"] == 1 and tiers["disk"]["used_bytes"] == WEIGHTS
        assert tiers["remote"]["used_bytes"] == WEIGHTS and tiers["remote"]["path"] == fleet.url
        assert "remote" in d.cli("store", check=True).stdout

        restored = cli_json(d, "restore", "first", timeout=300)
        pids.append(restored["pid"])
        assert "fetch-buffers" in phase_seconds(restored), restored["phases"]
        assert first.generate() == before, "the same tokens from weights that came back from the bucket"
        assert json.loads(d.cli("-o", "json", "ls", check=True).stdout)[0]["name"] == "first"
    finally:
        kill_tree(*pids)
