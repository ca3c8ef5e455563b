"""Issue 26, item 7: a standby whose tree was stopped or killed is no standby.

Root keeps a standby of its snapshot of user A's tree. The tree's processes are A's, so A can kill them; the
standby then stayed "ready", and root's next restore of the snapshot failed ``STANDBY_LOST`` instead of
restoring from the images. The same after ``gpusnap stop`` of the standby's tree. Now such a standby is
dropped and the restore restores from the images.

The snapshot is root's dump of a root process whose images are re-owned to A, left root's (tests/reown.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import psutil

from tests.conftest import Workloads, start_daemon, stop_daemon, wait_for
from tests.reown import dumped_by_root, reown, user_home
from tests.users import User


def test_a_standby_whose_tree_its_user_killed_or_root_stopped_is_dropped_and_restores_from_the_images(
    tmp_path: Path, hostile: tuple[User, User], workloads: Workloads
) -> None:
    a, _ = hostile
    with user_home(a, "gpusnap-lost-") as home:
        held = home / "held"
        held.write_bytes(b"A's file\n")
        os.chown(held, a.uid, a.gid)
        snap = dumped_by_root(tmp_path, "w", home / "ready", "grower.py", str(held), str(home), cwd=str(home))
        reown(snap, a, owner=False)
        d = start_daemon(tmp_path / "d1")
        try:

            def standby() -> dict[str, object]:
                made = json.loads(d.cli("-o", "json", "standby", "w", check=True).stdout)["standbys"][0]
                workloads.adopt(made["pid"])
                assert psutil.Process(made["pid"]).uids().real == a.uid
                return made  # type: ignore[no-any-return]

            def restore() -> dict[str, object]:
                res = d.cli("-o", "json", "restore", "w")
                assert res.returncode == 0, res.stderr  # before: STANDBY_LOST, the standby kept "ready"
                doc: dict[str, object] = json.loads(res.stdout)
                workloads.adopt(int(doc["pid"]))  # type: ignore[call-overload]
                return doc

            killed = standby()
            subprocess.run([*a.argv(), "kill", "-KILL", str(killed["pid"])], check=True)  # A ends its own process
            wait_for(lambda: not psutil.pid_exists(int(killed["pid"])), 10, "A could not kill the standby's root")  # type: ignore[call-overload]
            doc = restore()
            assert doc.get("standby_id") is None, "a dead standby was activated"
            assert json.loads(d.cli("-o", "json", "standbys", check=True).stdout) == []
            d.cli("stop", str(doc["pid"]), check=True)

            stopped = standby()
            d.cli("stop", str(stopped["pid"]), check=True)  # its tree stopped: the standby goes with it
            assert json.loads(d.cli("-o", "json", "standbys", check=True).stdout) == []
            doc = restore()
            assert doc.get("standby_id") is None
            d.cli("stop", str(doc["pid"]), check=True)
        finally:
            stop_daemon(d)
