"""What one user learns of another's snapshots (issue 10): nothing. Every RPC that takes a snapshot id or
name answers another user's snapshot exactly as a missing one (NOT_FOUND, the same message), and the
node's store use shown to a non-root caller is their own. Root sees everything.

The snapshot is root's dump of a root process, re-owned to user A (tests/reown.py says why).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonProc, Workloads, start_daemon, stop_daemon
from tests.reown import reown
from tests.users import User

MISSING_ID = "snap-" + "a" * 26


def _as(d: DaemonProc, user: User, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*user.argv(), *d.cli_argv, "--socket", str(d.socket), *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def a_snapshot(tmp_path: Path, hostile: tuple[User, User], workloads: Workloads) -> Iterator[tuple[DaemonProc, str]]:
    """A daemon whose store holds one snapshot named ``mine`` of user A; (daemon, its id)."""
    a, _ = hostile
    d = start_daemon(tmp_path / "d")
    try:
        w = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
        snap = json.loads(d.cli("-o", "json", "dump", str(w.pid), "--name", "mine", check=True).stdout)
    finally:
        stop_daemon(d)
    reown(d.store / "snapshots" / snap["id"], a)
    d = start_daemon(tmp_path / "d", extra_env={"GPUSNAP_SOCKET_GROUP": a.group})
    try:
        yield d, snap["id"]
    finally:
        stop_daemon(d)


@pytest.mark.parametrize("command", ["inspect", "restore", "rm"])
def test_another_users_snapshot_is_not_found(
    a_snapshot: tuple[DaemonProc, str], hostile: tuple[User, User], command: str
) -> None:
    d, snap_id = a_snapshot
    a, b = hostile
    missing = _as(d, b, command, MISSING_ID)
    assert missing.returncode == 3, missing.stderr
    for ref in (snap_id, f"{a.uid}/mine"):
        res = _as(d, b, command, ref)
        assert res.returncode == missing.returncode, res.stderr
        assert res.stderr.replace(ref, MISSING_ID) == missing.stderr, "another user's snapshot reads as missing"
        assert str(a.uid) not in res.stderr.replace(ref, ""), res.stderr
    assert json.loads(_as(d, a, "-o", "json", "inspect", "mine").stdout)["id"] == snap_id, "the owner still sees it"
    assert json.loads(d.cli("-o", "json", "inspect", snap_id, check=True).stdout)["id"] == snap_id, "root too"


def test_node_shows_a_caller_only_their_own_store_use(
    a_snapshot: tuple[DaemonProc, str], hostile: tuple[User, User]
) -> None:
    d, _ = a_snapshot
    a, b = hostile

    def store(res: subprocess.CompletedProcess[str]) -> dict[str, object]:
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)  # type: ignore[no-any-return]

    root, mine, theirs = (
        store(d.cli("-o", "json", "store")),
        store(_as(d, a, "-o", "json", "store")),
        store(_as(d, b, "-o", "json", "store")),
    )
    assert root["snapshot_count"] == mine["snapshot_count"] == 1
    assert root["store_used_bytes"] == mine["store_used_bytes"] > 0  # type: ignore[operator]
    assert theirs["snapshot_count"] == 0 and theirs["store_used_bytes"] == 0, theirs
    node = _as(d, b, "node")
    words = " ".join(node.stdout.split())  # the store row folds at 80 columns where the store's path is long
    assert node.returncode == 0 and "0 snapshots" in words, node.stdout


def test_a_damaged_snapshot_is_damaged_only_to_its_owner_and_root(
    a_snapshot: tuple[DaemonProc, str], hostile: tuple[User, User]
) -> None:
    d, snap_id = a_snapshot
    a, b = hostile
    (d.store / "snapshots" / snap_id / "manifest.json").write_text("{ damaged")
    missing = _as(d, b, "inspect", MISSING_ID)
    for _ in range(2):  # the first read finds the damage; the second is answered from what it recorded
        res = _as(d, b, "inspect", snap_id)
        assert res.returncode == 3, res.stderr
        assert res.stderr.replace(snap_id, MISSING_ID) == missing.stderr, (
            "another user's damaged snapshot reads as missing"
        )
        mine = _as(d, a, "inspect", snap_id)
        assert mine.returncode == 4 and "manifest" in mine.stderr, mine.stderr
    root = d.cli("inspect", snap_id)
    assert root.returncode == 4 and "manifest" in root.stderr, root.stderr
