"""A saved /dev/shm file is copied once per restore, and a dump that ends its tree leaves none on the host.

Real gpusnapd and CRIU. workloads/shm_counter.py holds its segment open for writing (``SharedMemory``),
so a restore continues it as "a file the tree writes"; in a private /dev/shm it is the restore's own fresh
copy, which must not be copied again (issue 25, item 1: 2 GiB of tmpfs for a 1 GiB segment).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import DaemonProc, kill_tree
from tests.daemon.test_restore_verify import _dump_counter


def test_a_restored_dev_shm_file_is_copied_once_and_the_ended_source_leaves_none(
    daemon: DaemonProc, tmp_path: Path
) -> None:
    snap, name = _dump_counter(daemon, tmp_path)
    assert not Path("/dev/shm", name).exists(), "the dump that ended the source left its /dev/shm file on the host"
    pids = []
    try:
        for _ in range(2):  # the first restore continues files in place; every later one used to copy them
            restored = json.loads(daemon.cli("-o", "json", "restore", snap, "--private-net", check=True).stdout)
            pids.append(restored["pid"])
            shm = Path(f"/proc/{restored['pid']}/root/dev/shm")
            assert sorted(os.listdir(shm)) == [name], "the segment was copied again beside itself"
            assert restored.get("file_copies", []) == []
            used = os.statvfs(shm)
            assert (used.f_blocks - used.f_bfree) * used.f_frsize <= 2 * 4096, "more tmpfs than one 4 KiB segment"
    finally:
        kill_tree(*pids)
