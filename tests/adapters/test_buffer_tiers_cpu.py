"""Buffer tiers with budgets, end to end: PyTorch CPU workers (tests/adapters/torch_cpu_worker.py) name
256 MiB of weights each. Under a RAM-tier budget that holds one of them, the older blob moves to the disk
tier and a restore served from there gives the same tokens; a capture bigger than every budget is
refused and the worker serves on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.adapters import torch_venv
from tests.adapters.test_buffers_cpu import WEIGHT_BYTES, Worker
from tests.conftest import DaemonProc, kill_tree, start_daemon, stop_daemon, wait_for

pytestmark = torch_venv.needs_venv


def _tiers(d: DaemonProc) -> dict[str, Any]:
    return {t["name"]: t for t in json.loads(d.cli("-o", "json", "store", check=True).stdout)["tiers"]}


def test_a_small_ram_budget_spills_to_disk_and_restores_read_from_there(tmp_path: Path) -> None:
    budget = WEIGHT_BYTES + (WEIGHT_BYTES // 4)
    d = start_daemon(
        tmp_path, extra_env={"GPUSNAP_BUFFER_DIR": str(tmp_path / "ram"), "GPUSNAP_RAM_TIER_BYTES": str(budget)}
    )
    first, second = Worker(d, tmp_path, "first"), Worker(d, tmp_path, "second", "--seed", "1")
    pids = [first.proc.pid, second.proc.pid]
    try:
        before = first.generate()
        d.cli("dump", str(first.proc.pid), "--name", "first", check=True)
        assert _tiers(d)["ram"]["used_bytes"] == WEIGHT_BYTES
        d.cli("dump", str(second.proc.pid), "--name", "second", check=True)
        wait_for(lambda: _tiers(d)["disk"]["blobs"] == 1, 60, "the older blob did not move to the disk tier")
        tiers = _tiers(d)
        assert tiers["ram"]["used_bytes"] == WEIGHT_BYTES <= tiers["ram"]["budget_bytes"] == budget
        assert tiers["disk"]["used_bytes"] == WEIGHT_BYTES and tiers["disk"]["path"] == str(d.store / "buffers")
        table = d.cli("store", check=True).stdout
        assert "ram" in table and "disk" in table and "256.0 MiB" in table

        restored = json.loads(d.cli("-o", "json", "restore", "first", check=True, timeout=300).stdout)
        pids.append(restored["pid"])
        assert first.generate() == before, "the same tokens from weights read off the disk tier"
    finally:
        kill_tree(*pids)
        stop_daemon(d)


def test_a_capture_bigger_than_every_budget_is_refused(tmp_path: Path) -> None:
    d = start_daemon(
        tmp_path,
        extra_env={
            "GPUSNAP_BUFFER_DIR": str(tmp_path / "ram"),
            "GPUSNAP_RAM_TIER_BYTES": str(64 << 20),
            "GPUSNAP_DISK_TIER_BYTES": str(128 << 20),
            "GPUSNAP_RESUME_TIMEOUT": "30",
        },
    )
    w = Worker(d, tmp_path, "w")
    try:
        before = w.generate()
        res = d.cli("dump", str(w.proc.pid))
        assert res.returncode == 9, res.stderr
        assert "more than every buffer tier's budget (ram 64 MiB, disk 128 MiB)" in res.stderr, res.stderr
        assert "--no-offload" in res.stderr
        assert w.generate() == before, "the source serves on with its weights"
        assert json.loads(d.cli("-o", "json", "ls", check=True).stdout) == []
    finally:
        kill_tree(w.proc.pid)
        stop_daemon(d)
