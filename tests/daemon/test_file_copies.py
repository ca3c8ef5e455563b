"""A snapshot of a worker that writes a log it opened without O_APPEND restores as often as asked, one copy at a
time and as --replicas: the first restore continues the log, every later one a copy of the log as it was at
the dump (``NAME.gpusnap-<operation>[-<i>]``); no byte an earlier copy wrote is overwritten or cut back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import WORKLOADS, DaemonProc, Workloads, _cli_env, start_daemon, stop_daemon, wait_for
from tests.reown import dumped_by_root, reown, user_home
from tests.users import User


def _lines(path: Path) -> list[int]:
    text = path.read_text()
    return [int(n) for n in text[: text.rfind("\n") + 1].split()]


def _counts_on(path: Path, prefix: bytes, beyond: int) -> None:
    """``path`` starts with ``prefix`` and counts on after it, each number once, up to at least ``beyond``."""
    wait_for(lambda: path.exists() and len(_lines(path)) > beyond, 30, f"{path} does not grow")
    assert path.read_bytes().startswith(prefix), f"{path} does not start with the log as dumped"
    got = _lines(path)
    assert got == list(range(len(got))), f"{path} skips or repeats a number: {got}"


def _writer(python: str, log: Path, workloads: Workloads) -> subprocess.Popen[bytes]:
    """workloads/log_writer.py writing ``log`` (in its directory), once it has written a few lines."""
    writer = workloads.spawn([python, str(WORKLOADS / "log_writer.py"), str(log)], cwd=log.parent)
    wait_for(lambda: log.exists() and len(_lines(log)) >= 5, 30, "the writer does not write")
    return writer


def test_a_log_opened_without_append_restores_many_times(
    daemon: DaemonProc, workloads: Workloads, tmp_path: Path
) -> None:
    log = tmp_path / "w.log"
    writer = _writer(sys.executable, log, workloads)
    daemon.cli("dump", str(writer.pid), "--name", "live", "--leave-running", check=True)
    live = json.loads(daemon.cli("-o", "json", "restore", "live", check=True).stdout)  # the source keeps its log
    workloads.adopt(live["pid"])
    [kept] = live["replicas"][0]["file_copies"]
    assert kept["copy"] == f"{log}.gpusnap-{live['operation']}", kept
    daemon.cli("dump", str(writer.pid), "--name", "logger", check=True)
    writer.wait(timeout=10)
    dumped = log.read_bytes()
    last = len(_lines(log)) - 1

    def restore(*args: str) -> dict[str, object]:
        doc = json.loads(daemon.cli("-o", "json", "restore", "logger", *args, check=True).stdout)
        for r in doc["replicas"]:
            workloads.adopt(r["pid"])
        return doc

    first = restore()
    assert first["replicas"][0].get("file_copies", []) == [], "the first restore continues the log itself"
    _counts_on(log, dumped, last + 3)
    later = [restore(), restore("--host-pidns"), restore("--replicas", "2")]  # a copy each
    copies = [(doc, r) for doc in later for r in doc["replicas"]]
    for i, (doc, r) in enumerate(copies):
        suffix = f"-{r['index']}" if len(doc["replicas"]) > 1 else ""
        name = f"{log}.gpusnap-{doc['operation']}{suffix}"
        assert r["file_copies"] == [{"path": str(log), "copy": name, "size_bytes": len(dumped)}], (i, r)
        _counts_on(Path(name), dumped, last + 3)
        assert os.stat(name).st_mode & 0o777 == os.stat(log).st_mode & 0o777
    _counts_on(log, dumped, last + 10)  # the first copy still counts on in the log: nothing overwrote it
    text = subprocess.run(
        [*daemon.cli_argv, "--socket", str(daemon.socket), "restore", "logger"], capture_output=True, text=True
    )
    assert (
        text.returncode == 0
        and f"continues {log} in a copy of its first {len(dumped)} bytes: {log}.gpusnap-op-" in text.stderr
    ), text.stderr
    workloads.adopt(int(text.stdout.split()[0]))


def test_a_users_copies_are_made_with_the_users_rights(
    tmp_path: Path, hostile: tuple[User, User], workloads: Workloads
) -> None:
    """A re-owned snapshot (root cannot dump another user's tree here: tests/reown.py): its second restore's copy
    is the user's; where the user may not create files, the restore is refused, though root could create it."""
    user, _ = hostile
    with user_home(user, "gpusnap-copies-") as home:
        log = home / "w.log"
        snapshot = dumped_by_root(tmp_path, "mine", log, "log_writer.py", str(log), cwd=str(home))
        os.chown(log, user.uid, user.gid)
        reown(snapshot, user)
        dumped = log.read_bytes()
        d = start_daemon(tmp_path / "d1", extra_env={"GPUSNAP_SOCKET_GROUP": user.group})
        try:

            def restore() -> subprocess.CompletedProcess[str]:
                cmd = [*user.argv(), *d.cli_argv, "--socket", str(d.socket), "-o", "json", "restore", "mine"]
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_cli_env())
                if res.returncode == 0:
                    workloads.adopt(json.loads(res.stdout)["pid"])
                return res

            assert restore().returncode == 0
            second = restore()
            assert second.returncode == 0, second.stderr
            [made] = json.loads(second.stdout)["replicas"][0]["file_copies"]
            _counts_on(Path(made["copy"]), dumped, len(dumped.split()) + 3)
            assert os.stat(made["copy"]).st_uid == user.uid, "the copy is the user's"
            os.chmod(home, 0o555)  # the user's own directory, closed to the user: root could still write in it
            refused = restore()
            assert refused.returncode == 4, refused.stderr
            error = json.loads(refused.stdout)["error"]
            assert error["reason"] == "FILE_COPY_FAILED", error
            assert f"uid {user.uid} could not create (Permission denied)" in error["message"], error
            assert sorted(p.name for p in home.iterdir()) == sorted(["w.log", Path(made["copy"]).name])
        finally:
            stop_daemon(d)


def test_files_held_through_two_descriptors_restore_in_place_first_then_through_copies(
    daemon: DaemonProc, workloads: Workloads, tmp_path: Path
) -> None:
    """Issue 26, item 5: one fd with O_APPEND and one without (CRIU's static/file_append), and a writer plus a
    reader of one file. Before, every restore was refused (``FILE_COPY_FAILED``, "different positions"), the
    first in-place one too, and the default dump had ended the worker. Now the first restore continues the
    files themselves and every later one their copies, each descriptor with its own position and flags."""
    work = tmp_path / "two"
    work.mkdir()
    holder = workloads.spawn([sys.executable, str(WORKLOADS / "two_fds.py"), str(work)], cwd=work)
    wait_for(lambda: (work / "ready").exists(), 30, "two_fds.py did not start")
    daemon.cli("dump", str(holder.pid), "--name", "two", check=True)
    holder.wait(timeout=10)
    dumped = {"a_append": (0, True), "a_plain": (0, False), "b_writer": (11, False), "b_reader": (5, False)}

    def poke(pid: int) -> dict[str, Any]:
        """The restored process's report (its descriptors before it writes X and Y into a.log)."""
        report = work / "report-1"  # every restored process counts from the dump's 0
        report.unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR1)
        wait_for(report.exists, 10, f"restored PID {pid} did not report")
        wait_for(lambda: report.read_text().endswith("}"), 10, "half a report")
        doc: dict[str, Any] = json.loads(report.read_text())
        assert {k: (v["pos"], v["append"]) for k, v in doc["before"].items()} == dumped, doc
        assert doc["read"] == "56789", doc
        return doc

    first = json.loads(daemon.cli("-o", "json", "restore", "two", check=True).stdout)
    workloads.adopt(first["pid"])
    assert first["replicas"][0].get("file_copies", []) == [], "the first restore continues the files themselves"
    report = poke(first["pid"])
    assert {v["file"] for v in report["before"].values()} == {str(work / "a.log"), str(work / "b.log")}
    assert (work / "a.log").read_bytes() == b"Xtart\nY", "X at the plain fd's 0, Y appended: two descriptions"
    for args in ((), ("--replicas", "2")):
        doc = json.loads(daemon.cli("-o", "json", "restore", "two", *args, check=True).stdout)
        for r in doc["replicas"]:
            workloads.adopt(r["pid"])
            copies = {c["path"]: c["copy"] for c in r["file_copies"]}
            assert sorted(copies) == [str(work / "a.log"), str(work / "b.log")], r
            report = poke(r["pid"])
            assert {k: v["file"] for k, v in report["before"].items()} == {
                "a_append": copies[str(work / "a.log")],
                "a_plain": copies[str(work / "a.log")],
                "b_writer": copies[str(work / "b.log")],
                "b_reader": copies[str(work / "b.log")],
            }
            assert Path(copies[str(work / "a.log")]).read_bytes() == b"Xtart\nY"
    assert (work / "a.log").read_bytes() == b"Xtart\nY", "a later copy wrote into the file itself"


def test_a_copy_lives_as_long_as_the_tree_that_writes_it(
    daemon: DaemonProc, workloads: Workloads, tmp_path: Path
) -> None:
    """Issue 27, item 4: every later restore of a vLLM snapshot left ``/var/lib/libuuid/clock.txt.gpusnap-op-…``
    and nothing removed it. Now the tree's init removes its copies once the tree has ended: stopped
    (``gpusnap stop``), its root ended, or (a standby) dropped by gpusnapd."""
    log = tmp_path / "w.log"
    writer = _writer(sys.executable, log, workloads)
    daemon.cli("dump", str(writer.pid), "--name", "logger", "--leave-running", check=True)  # every restore copies

    def restored_copy() -> tuple[int, Path]:
        doc = json.loads(daemon.cli("-o", "json", "restore", "logger", check=True).stdout)
        workloads.adopt(doc["pid"])
        [made] = doc["replicas"][0]["file_copies"]
        copy = Path(made["copy"])
        _counts_on(copy, b"", 3)
        return int(doc["pid"]), copy

    def copies() -> list[str]:
        return sorted(p.name for p in tmp_path.glob("w.log.gpusnap-*"))

    pid, stopped = restored_copy()
    daemon.cli("stop", str(pid), check=True)
    wait_for(lambda: not stopped.exists(), 10, "gpusnap stop left the tree's copy")
    pid, ended = restored_copy()
    os.kill(pid, signal.SIGKILL)  # the root ends: its init ends the rest, then removes the copy
    wait_for(lambda: not ended.exists(), 20, "the tree's end left its copy")
    made = json.loads(daemon.cli("-o", "json", "standby", "logger", check=True).stdout)["standbys"][0]
    wait_for(lambda: len(copies()) == 1, 10, "the standby has no copy of its own")
    daemon.cli("drop", made["id"], check=True)
    wait_for(lambda: copies() == [], 10, f"dropping the standby left its copy: {copies()}")
    assert _lines(log)[-1] > 3, "the source still writes its log"
