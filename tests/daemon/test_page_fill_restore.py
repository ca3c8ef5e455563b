"""gpusnapd fills a restored tree's private pages on several threads where there are enough of them
(``daemon/drivers/pagefill.py``, ``pagefill.MIN_BYTES``), and the files of its private /dev/shm with them
(``daemon/drivers/privateshm.py``), says so in the restore's events and in ``gpusnap node``, and leaves them to
CRIU and one copy when ``page_fill_threads = -1``. Real gpusnapd, CRIU and workload."""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest

from gpusnap.daemon.drivers import pagefill
from tests.conftest import DaemonProc, Workloads, start_daemon, stop_daemon, wait_for
from tests.starts import starts

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "anon_regions.py"


@starts("workload")
def _dumped(d: DaemonProc, wd: Path, workloads: Workloads, shm: str) -> str:
    """anon_regions.py with twice ``pagefill.MIN_BYTES`` of dirty memory and an 8 MiB /dev/shm segment ``shm``
    (larger than ``privateshm.DEFER_BYTES``), dumped (and ended)."""
    wd.mkdir()
    mb = 2 * pagefill.MIN_BYTES >> 20
    proc = workloads.spawn(
        [sys.executable, str(WORKLOAD), str(wd), "--regions", "2", "--mb", str(mb // 2), "--sparse-mb", "8"]
        + ["--shm-mb", "8", "--shm-name", shm]
    )
    wait_for((wd / "ready").exists, 60, "the workload did not start")
    snap = json.loads(d.cli("-o", "json", "dump", str(proc.pid), check=True).stdout)["id"]
    proc.wait(timeout=30)
    return str(snap)


def _restore_events(d: DaemonProc, snap: str) -> tuple[int, str]:
    """Restore ``snap``; the restored root and what its restore's events said."""
    restored = json.loads(d.cli("-o", "json", "restore", snap, "--private-net", check=True).stdout)
    events = d.cli("wait", restored["operation"], "--events", check=True).stdout
    return int(restored["pid"]), events


def _same_memory(wd: Path, pid: int) -> bool:
    os.kill(pid, signal.SIGUSR1)
    wait_for((wd / "sha_now").exists, 60, "the restored workload did not hash its memory")
    return (wd / "sha_now").read_text() == (wd / "expected_sha").read_text()


@pytest.mark.parametrize("threads", ["0", "-1"], ids=["fill", "off"])
def test_a_restore_fills_its_pages_and_says_so(tmp_path: Path, workloads: Workloads, threads: str) -> None:
    d = start_daemon(tmp_path / "d", extra_env={"GPUSNAP_PAGE_FILL_THREADS": threads})
    try:
        node = d.cli("node", check=True).stdout
        assert ("page fill" in node) and (("off (page_fill_threads = -1)" in node) == (threads == "-1")), node
        shm = f"gsn-fill-{uuid.uuid4().hex[:8]}"
        snap = _dumped(d, tmp_path / "w", workloads, shm)
        saved = d.store / "snapshots" / snap / "images" / "dev-shm" / shm
        pid, events = _restore_events(d, snap)
        workloads.adopt(pid)
        assert ("pages filled:" in events) == (threads == "0"), events
        assert _same_memory(tmp_path / "w", pid)  # the regions and the segment (its bytes copied by the fill)
        copy, kept = os.stat(f"/proc/{pid}/root/dev/shm/{shm}"), saved.stat()
        assert (copy.st_size, copy.st_mode, copy.st_uid, copy.st_mtime_ns) == (
            kept.st_size,
            kept.st_mode,
            kept.st_uid,
            kept.st_mtime_ns,
        )
    finally:
        stop_daemon(d)
