"""A snapshot store on /dev/shm (a RAM store): a restore into a private /dev/shm still finds its images.

The private /dev/shm a restore mounts would hide a store under the host's /dev/shm from CRIU and the helper;
the helper carries the store over for CRIU's run and drops it before the tree runs (``criu_exec``), so the
tree's /dev/shm holds only its own files. Real gpusnapd, CRIU and the page fill.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonProc, kill_tree, start_daemon, stop_daemon, wait_for
from tests.daemon.test_restore_verify import _dump_counter
from tests.shortdirs import short_dir
from tests.starts import starts


@pytest.fixture
@starts("gpusnapd")
def ram_daemon() -> Iterator[DaemonProc]:
    d = start_daemon(short_dir("gpusnap-ramstore-", 0o700, parent="/dev/shm"))
    assert d.alive(), d.log.read_text()
    yield d
    stop_daemon(d)


def test_a_store_on_dev_shm_restores_into_a_private_dev_shm(ram_daemon: DaemonProc, tmp_path: Path) -> None:
    snap, name = _dump_counter(ram_daemon, tmp_path)
    restored = json.loads(ram_daemon.cli("-o", "json", "restore", snap, "--private-net", check=True).stdout)
    try:
        root = Path(f"/proc/{restored['pid']}")
        assert sorted(os.listdir(root / "root" / "dev" / "shm")) == [name]  # its segment, not the store
        assert str(ram_daemon.store) not in (root / "mountinfo").read_text()
        counted = len((tmp_path / "log").read_text().splitlines())
        wait_for(
            lambda: len((tmp_path / "log").read_text().splitlines()) > counted, 20, "the restored tree does not run"
        )
    finally:
        kill_tree(restored["pid"])
