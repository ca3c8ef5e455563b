"""Issue 26, items 2 and 3: standbys and the park ladder inside per-user bounds.

- Item 2: with a standby memory budget set, user A's park priority of 1000 dropped root's standbys to make
  room for A's; and A's rule on its own snapshot, set after root's, replaced root's.
- Item 3: ``standby --count N`` and sequential ``restore --replicas N`` gave one user any number of trees
  (each with a namespace init of root's); their memory counted only when made, not as it grew; the ladder
  made A's keep-warm standbys as root (root's operation slots); one user could fill the node's park rules.

A's snapshot is root's dump of a root process re-owned to A (root lacks CAP_SYS_RESOURCE here:
tests/reown.py); root's is root's own. Real gpusnapd, real CRIU, real users.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import DaemonProc, _cli_env, start_daemon, stop_daemon, wait_for
from tests.reown import dumped_by_root, reown, user_home
from tests.users import User

MIB = 1 << 20


@dataclass
class Setup:
    tmp: Path
    home: Path
    user: User


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory, hostile: tuple[User, User]) -> Iterator[Setup]:
    """``a-worker`` (A's: a re-owned root dump) and ``r-worker`` (root's), of workloads/grower.py, in one store."""
    a, _ = hostile
    tmp = tmp_path_factory.mktemp("bounds")
    with user_home(a, "gpusnap-bounds-") as home:
        held = home / "held"
        held.write_bytes(b"A's file\n")
        os.chown(held, a.uid, a.gid)
        mine = dumped_by_root(tmp, "a-worker", home / "ready", "grower.py", str(held), str(home), cwd=str(home))
        reown(mine, a)
        (home / "ready").unlink()
        roots = home.parent / "root"
        roots.mkdir()
        (roots / "held").write_bytes(b"root's file\n")
        dumped_by_root(tmp, "r-worker", roots / "ready", "grower.py", str(roots / "held"), str(roots))
        yield Setup(tmp=tmp, home=home, user=a)


def _daemon(s: Setup, **config: int) -> DaemonProc:
    env = {"GPUSNAP_SOCKET_GROUP": s.user.group, **{f"GPUSNAP_{k.upper()}": str(v) for k, v in config.items()}}
    d = start_daemon(s.tmp / "d1", extra_env=env)
    assert d.alive(), d.log.read_text()
    return d


def _as_a(d: DaemonProc, s: Setup, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [*s.user.argv(), *d.cli_argv, "--socket", str(d.socket), "-o", "json", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_cli_env())


def _reason(res: subprocess.CompletedProcess[str]) -> str:
    return str(json.loads(res.stdout)["error"]["reason"]) if res.stdout.strip().startswith("{") else res.stderr


def _refused(res: subprocess.CompletedProcess[str], reason: str) -> None:
    """``res`` failed RESOURCE_EXHAUSTED (exit 9) for ``reason``."""
    assert (res.returncode, _reason(res)) == (9, reason), res.stderr


def _json(res: subprocess.CompletedProcess[str]) -> Any:
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _clean_up(d: DaemonProc, s: Setup) -> None:
    """Drop every standby and stop every restored tree (they outlive the daemon), and end A's processes."""
    if d.alive():
        ids = [sb["id"] for sb in json.loads(d.cli("-o", "json", "standbys", check=True).stdout)]
        if ids:
            d.cli("drop", *ids)
        for tree in json.loads(d.cli("-o", "json", "ls", "--running", check=True).stdout):
            d.cli("stop", str(tree["pid"]))
    stop_daemon(d)
    for p in psutil.process_iter(["uids"]):
        if p.info["uids"] and p.info["uids"].real == s.user.uid:
            p.kill()


def test_a_users_priority_takes_no_standby_room_from_roots_and_roots_rule_stands(snapshots: Setup) -> None:
    s = snapshots
    d = _daemon(s)
    try:
        _json(d.cli("-o", "json", "standby", "r-worker", "--count", "4"))
        used = _json(d.cli("-o", "json", "node"))["standby_host_memory_bytes"]
        [a_size] = [x["size_bytes"] for x in _json(d.cli("-o", "json", "ls")) if x["name"] == "a-worker"]
        assert used > 0
    finally:
        stop_daemon(d)  # the standbys stay: a budget they fill, with no room for one of A's
    d = _daemon(s, park_standby_ram_bytes=used + a_size // 2)
    try:
        assert _as_a(d, s, "park", "set", "a-worker", "--priority", "1000").returncode == 0
        res = _as_a(d, s, "standby", "a-worker")
        _refused(res, "PARK_BUDGET")
        assert len(_json(d.cli("-o", "json", "standbys"))) == 4, "A's priority dropped root's standbys"

        # Root's rule on A's snapshot stands over A's, whenever A sets its own.
        a_snapshot = f"{s.user.uid}/a-worker"
        assert d.cli("park", "set", a_snapshot, "--priority", "-5").returncode == 0
        assert _as_a(d, s, "park", "set", "a-worker", "--priority", "7").returncode == 0
        [row] = [w for w in _json(d.cli("-o", "json", "park"))["workloads"] if w["name"] == "a-worker"]
        assert row["policy"]["priority"] == -5, row
    finally:
        _clean_up(d, s)


def _grow(pid: int) -> None:
    """Make restored grower ``pid`` allocate 64 MiB more, and wait until it holds them."""
    before = psutil.Process(pid).memory_info().rss
    os.kill(pid, signal.SIGUSR1)
    wait_for(lambda: psutil.Process(pid).memory_info().rss > before + 60 * MIB, 20, f"PID {pid} did not grow")


def test_a_users_trees_are_bounded_by_count_and_by_live_memory(snapshots: Setup) -> None:
    s = snapshots
    d = _daemon(s, max_trees_per_caller=3)
    try:
        res = _as_a(d, s, "standby", "a-worker", "--count", "4")
        _refused(res, "TOO_MANY_TREES")
        _json(_as_a(d, s, "standby", "a-worker", "--count", "2"))
        res = _as_a(d, s, "restore", "a-worker", "--replicas", "2", "--no-standby")
        _refused(res, "TOO_MANY_TREES")
        grower = _json(_as_a(d, s, "restore", "a-worker", "--no-standby"))["pid"]
        res = _as_a(d, s, "restore", "a-worker", "--no-standby")
        _refused(res, "TOO_MANY_TREES")
        assert f"uid {s.user.uid}" in res.stderr and "gpusnap stop" in res.stderr, res.stderr
        roots = _json(d.cli("-o", "json", "restore", f"{s.user.uid}/a-worker", "--no-standby"))["pid"]  # root: no bound
        _json(_as_a(d, s, "drop", *[sb["id"] for sb in _json(_as_a(d, s, "standbys"))]))
        d.cli("stop", str(roots), check=True)
    except BaseException:
        _clean_up(d, s)
        raise
    stop_daemon(d)  # A's restored grower runs on
    # Memory, measured live: a tree that grew after it was counted counts as it is now, its init included.
    d = _daemon(s, max_tree_memory_per_caller=160 * MIB)
    try:
        _grow(grower)
        second = _json(_as_a(d, s, "restore", "a-worker", "--no-standby"))["pid"]
        _grow(second)
        res = _as_a(d, s, "restore", "a-worker", "--no-standby")
        _refused(res, "TREE_MEMORY_LIMIT")
        doc = json.loads(res.stdout)["error"]
        assert int(doc["metadata"]["used_bytes"]) > 128 * MIB, doc  # both grown trees, measured now
    finally:
        _clean_up(d, s)


def test_the_ladder_makes_a_users_keep_warm_standbys_as_that_user(snapshots: Setup) -> None:
    s = snapshots
    d = _daemon(s, park_interval_s=1)
    try:
        before = {op["id"] for op in _json(_as_a(d, s, "ops"))}  # (the journal keeps earlier tests' operations)
        assert _as_a(d, s, "park", "set", "a-worker", "--keep-warm", "1").returncode == 0
        wait_for(lambda: len(_json(_as_a(d, s, "standbys"))) == 1, 60, "the ladder made no standby for A")
        mine = [op for op in _json(_as_a(d, s, "ops")) if op["kind"] == "standby" and op["id"] not in before]
        assert mine, "the ladder's standby of A's snapshot is not A's operation (it ran as root)"
        assert _as_a(d, s, "park", "set", "a-worker", "--keep-warm", "0").returncode == 0
    finally:
        _clean_up(d, s)


def test_one_user_cannot_fill_the_nodes_park_rules_and_root_may_delete_theirs(snapshots: Setup) -> None:
    s = snapshots
    d = _daemon(s, max_policies_per_caller=8)
    try:
        had = len(_json(_as_a(d, s, "park"))["policies"])  # (the tests before left some)
        for n in range(8 - had):
            assert _as_a(d, s, "park", "set", "--label", f"k{n}=v", "--priority", "-1").returncode == 0
        res = _as_a(d, s, "park", "set", "--label", "k8=v", "--priority", "-1")
        _refused(res, "TOO_MANY_POLICIES")
        assert d.cli("park", "set", "--label", "k8=v", "--priority", "-1").returncode == 0, "root may still set"
        assert d.cli("park", "unset", "--label", "k0=v").returncode == 0, "root may delete A's rule"
        rules = _json(_as_a(d, s, "park"))["policies"]
        assert len(rules) == 7 and all(r["owner_uid"] == s.user.uid for r in rules), rules
    finally:
        _clean_up(d, s)
