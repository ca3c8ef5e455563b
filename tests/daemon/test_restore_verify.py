"""A restore runs only verified images, with the page data checked while CRIU restores (issue 25, item 1).

Real gpusnapd, real CRIU. The workload (workloads/shm_counter.py) appends a line to its log every 50 ms and
counts in a /dev/shm segment; its dump ends it, so any line written after the dump comes from a restored task.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.store import checksum
from tests.conftest import WORKLOADS, DaemonProc, kill_tree, start_daemon, stop_daemon, wait_for


def _dump_counter(d: DaemonProc, wd: Path) -> tuple[str, str]:
    """Start shm_counter in ``wd``, dump it (which ends it); returns the snapshot's id and the segment's name."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = f"gsn-verify-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        [sys.executable, str(WORKLOADS / "shm_counter.py"), str(wd), name, str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for((wd / "ready").exists, 20, "shm_counter did not start")
    wait_for(lambda: len((wd / "log").read_text().splitlines()) > 3, 20, "shm_counter does not count")
    snap = json.loads(d.cli("-o", "json", "dump", str(proc.pid), check=True).stdout)["id"]
    proc.wait(timeout=20)
    return snap, name


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def _images(d: DaemonProc, snap: str) -> Path:
    return d.store / "snapshots" / snap / "images"


def _restore_fails(d: DaemonProc, snap: str) -> tuple[str, GpusnapError]:
    """Restore ``snap``, which must fail; returns the phase it failed in and its error."""
    c = d.client()
    op = c.restore(snap, private_network=True)
    with pytest.raises(GpusnapError) as err:
        c.wait(op.id)
    return c.get_operation(op.id).phase, err.value


@pytest.mark.parametrize("target", ["pages", "dev-shm"])
def test_damaged_page_data_is_refused_at_pre_resume_and_no_task_runs(
    daemon: DaemonProc, tmp_path: Path, target: str
) -> None:
    """The page images (and a private /dev/shm's files) are hashed while CRIU restores; the tasks wait at
    CRIU's pre-resume, and one flipped byte kills them before any ran an instruction."""
    snap, name = _dump_counter(daemon, tmp_path)
    images = _images(daemon, snap)
    if target == "pages":
        damaged = max(
            (p for p in images.iterdir() if checksum.RAW_PAGES.fullmatch(p.name)), key=lambda p: p.stat().st_size
        )
        _flip(damaged, damaged.stat().st_size // 2)
    else:
        damaged = images / "dev-shm" / name
        _flip(damaged, 0)  # the counter: the restored task would read it first
    lines = len((tmp_path / "log").read_text().splitlines())
    phase, err = _restore_fails(daemon, snap)
    assert (err.reason, phase) == ("IMAGE_CHECKSUM", "restore"), (err.reason, phase, err.message)
    assert damaged.name in err.message
    assert list((images.parent).glob("restore-*.log")), "CRIU ran (the page data was checked meanwhile)"
    time.sleep(1.0)  # a task that ran would have written a line every 50 ms
    assert len((tmp_path / "log").read_text().splitlines()) == lines, "a restored task ran"
    _flip(damaged, damaged.stat().st_size // 2 if target == "pages" else 0)  # undamaged again: it restores
    restored = json.loads(daemon.cli("-o", "json", "restore", snap, check=True).stdout)
    try:
        wait_for(lambda: len((tmp_path / "log").read_text().splitlines()) > lines + 5, 20, "the restore does not run")
    finally:
        kill_tree(restored["pid"])


def test_damaged_metadata_image_is_refused_before_criu_runs(daemon: DaemonProc, tmp_path: Path) -> None:
    snap, _ = _dump_counter(daemon, tmp_path)
    images = _images(daemon, snap)
    core = next(images.glob("core-*.img"))
    _flip(core, core.stat().st_size - 1)
    phase, err = _restore_fails(daemon, snap)
    assert (err.reason, phase) == ("IMAGE_CHECKSUM", "verify"), (err.reason, phase, err.message)
    assert core.name in err.message
    assert not list(images.parent.glob("restore-*.log")), "CRIU ran on a damaged image"


@pytest.fixture
def ram_daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    """gpusnapd with its store on a tmpfs of its own: a RAM store, root's and closed to others. (Not under
    /dev/shm: a private /dev/shm is mounted over it in the restore's mount namespace.)"""
    ram = tmp_path / "ram"
    ram.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g,mode=0700", "tmpfs", str(ram)], check=True)
    try:
        d = start_daemon(ram)
        assert d.alive(), d.log.read_text()
        yield d
        stop_daemon(d)
        assert "Traceback" not in d.log.read_text(), d.log.read_text()[-4000:]
    finally:
        subprocess.run(["umount", "-l", str(ram)], check=False)


def _verify_bytes(d: DaemonProc, snap: str) -> tuple[int, int]:
    """Restore ``snap``; returns the bytes its ``verify`` phase hashed before CRIU and the restored root PID."""
    c = d.client()
    op = c.wait(c.restore(snap, private_network=True).id)
    assert op.restore is not None
    return next(p.bytes for p in op.phases if p.phase == "verify"), op.restore.pid


def test_ram_store_is_verified_once_and_hashed_again_when_a_file_changed(
    ram_daemon: DaemonProc, tmp_path: Path
) -> None:
    d = ram_daemon
    snap, _ = _dump_counter(d, tmp_path)
    images = _images(d, snap)
    pids = []
    try:
        hashed, pid = _verify_bytes(d, snap)
        pids.append(pid)
        assert hashed == 0, "every file was hashed at publish, on the RAM store: none again"
        kill_tree(pids.pop())
        core = next(images.glob("core-*.img"))
        st = core.stat()
        os.utime(core, ns=(st.st_atime_ns, st.st_mtime_ns))  # same bytes and mtime, a new ctime
        hashed, pid = _verify_bytes(d, snap)
        pids.append(pid)
        assert hashed == core.stat().st_size, "only the file whose status changed was hashed again"
        kill_tree(pids.pop())
        _flip(core, core.stat().st_size - 1)
        phase, err = _restore_fails(d, snap)
        assert (err.reason, phase) == ("IMAGE_CHECKSUM", "verify"), (err.reason, phase, err.message)
    finally:
        kill_tree(*pids)
