"""Restored trees are listed (`gpusnap ls --running`) and stopped (`gpusnap stop PID|OPERATION`): each process gets
SIGTERM, so the tree shuts down cleanly; a user lists and stops only trees that run as them, root any."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from tests.conftest import WORKLOADS, DaemonProc, Workloads, _cli_env, start_daemon, stop_daemon, wait_for
from tests.reown import dumped_by_root, reown, user_home
from tests.users import User


def _gone(*pids: int) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def _json(res: subprocess.CompletedProcess[str]) -> Any:
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_restored_trees_are_listed_and_stopped_cleanly(
    daemon: DaemonProc, workloads: Workloads, tmp_path: Path
) -> None:
    wd = tmp_path / "w"
    wd.mkdir()
    source = workloads.spawn([sys.executable, str(WORKLOADS / "on_term.py"), str(wd)])
    wait_for(lambda: (wd / "ready").exists(), 30, "the workload did not start")
    snap = _json(daemon.cli("-o", "json", "dump", str(source.pid), "--name", "stoppable"))["id"]
    single = _json(daemon.cli("-o", "json", "restore", "stoppable"))
    fan = _json(daemon.cli("-o", "json", "restore", "stoppable", "--replicas", "2"))
    for r in [single, *fan["replicas"]]:
        workloads.adopt(r["pid"])

    def running() -> list[dict[str, Any]]:  # root sees every restored tree of the host: this test's only
        return [t for t in _json(daemon.cli("-o", "json", "ls", "--running")) if t["snapshot_id"] == snap]

    trees = {t["pid"]: t for t in running()}
    assert sorted(trees) == sorted([single["pid"], *(r["pid"] for r in fan["replicas"])]), trees
    one = trees[single["pid"]]
    assert (one["snapshot_name"], one["operation_id"], one["uid"], one["process_count"]) == (
        "stoppable",
        single["operation"],
        0,
        2,
    ), one
    assert psutil.Process(one["init_pid"]).name() == "gpusnap-init" and one["init_pid"] != one["pid"]
    table = daemon.cli("ls", "--running", check=True).stdout
    assert str(single["pid"]) in table and single["operation"] in table, table
    assert max(len(line) for line in table.splitlines()) <= 80, table

    stopped = _json(daemon.cli("-o", "json", "stop", str(single["pid"])))["stopped"]
    assert [t["pid"] for t in stopped] == [single["pid"]] and _gone(single["pid"], one["init_pid"])
    assert sorted((wd / "term.log").read_text().splitlines()) == ["child got SIGTERM", "parent got SIGTERM"]
    assert single["pid"] not in [t["pid"] for t in running()]

    text = daemon.cli("stop", fan["operation"], check=True).stdout  # every copy of a fan-out
    assert text.count("stopped PID") == 2 and _gone(*(r["pid"] for r in fan["replicas"])), text
    again = daemon.cli("stop", str(single["pid"]))
    assert again.returncode == 3 and "gpusnap ls --running" in again.stderr, again.stderr


def test_users_list_and_stop_only_their_own_trees(
    tmp_path: Path, hostile: tuple[User, User], workloads: Workloads
) -> None:
    """A re-owned snapshot (root cannot dump another user's tree here: tests/reown.py), restored twice by A."""
    a, b = hostile
    with user_home(a, "gpusnap-trees-") as home:
        snapshot = dumped_by_root(tmp_path, "mine", home / "ready", "on_term.py", str(home), cwd=str(home))
        reown(snapshot, a)
        os.chown(home / "term.log", a.uid, a.gid)
        d = start_daemon(tmp_path / "d1", extra_env={"GPUSNAP_SOCKET_GROUP": a.group})
        try:

            def cli(user: User | None, *args: str) -> subprocess.CompletedProcess[str]:
                cmd = [*(user.argv() if user else []), *d.cli_argv, "--socket", str(d.socket), "-o", "json", *args]
                return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_cli_env())

            first, second = (_json(cli(a, "restore", "mine")) for _ in range(2))
            for r in (first, second):
                workloads.adopt(r["pid"])
                assert psutil.Process(r["pid"]).uids().real == a.uid
            assert _json(cli(b, "ls", "--running")) == [], "another user's trees are not listed"
            refused = cli(b, "stop", str(first["pid"]))
            assert refused.returncode == 3 and json.loads(refused.stdout)["error"]["reason"] == "TREE_NOT_FOUND"
            refused = cli(b, "stop", first["operation"])
            assert refused.returncode == 3 and psutil.Process(first["pid"]).is_running(), "B stopped A's tree"
            mine = _json(cli(a, "ls", "--running"))
            assert [t["pid"] for t in mine] == [first["pid"], second["pid"]] and {t["uid"] for t in mine} == {a.uid}
            assert [t["pid"] for t in _json(cli(a, "stop", str(first["pid"])))["stopped"]] == [first["pid"]]
            assert _gone(first["pid"]) and psutil.Process(second["pid"]).is_running()
            assert _json(cli(None, "stop", second["operation"]))["stopped"][0]["uid"] == a.uid, "root stops any"
            assert _gone(second["pid"])
        finally:
            stop_daemon(d)
