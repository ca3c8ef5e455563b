"""Faults and concurrency: CRIU killed mid-dump, parallel checkpoints, one operation per tree."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from gpusnap.daemon.api.errors import AbortedError
from gpusnap.daemon.api.types import EventType
from tests.conftest import DaemonProc, Workloads, criu_killed, start_daemon, stop_daemon, wait_for


def test_criu_killed_in_the_middle_of_a_dump(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "1500", "--no-child", "--no-listener")
    with criu_killed(daemon.proc.pid, delay_s=0.15) as killed:  # let CRIU seize the tree and write pages
        res = daemon.cli("-o", "json", "dump", str(w.pid), "--name", "killed")
    assert killed, "CRIU was never seen running"
    assert res.returncode == 5 and "CRIU" in res.stderr, res.stderr  # ABORTED: CRIU died
    assert json.loads(res.stdout)["error"]["reason"] == "CRIU_DIED"
    assert json.loads(res.stdout)["error"]["action"] == "retry"
    assert "CRIU" in res.stderr
    assert json.loads(daemon.cli("-o", "json", "ls", check=True).stdout) == [], "no snapshot listed"
    assert list((daemon.store / "staging").iterdir()) == [], "staging removed"
    assert not list((daemon.store / "snapshots").iterdir())
    assert w.proc is not None and w.proc.poll() is None, "the source is still alive"
    assert psutil.Process(w.pid).status() not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    before = w.last("parent.log")
    wait_for(lambda: w.last("parent.log") > before + 3, 10, "the source does not run after the failed dump")
    # The daemon still works, and the same tree can be captured now.
    daemon.cli("dump", str(w.pid), "--name", "after-kill", check=True)


def test_a_dump_past_its_timeout_is_stopped_safely_never_killed_mid_dump(
    daemon: DaemonProc, workloads: Workloads
) -> None:
    """Issue 26, item 4: a CRIU killed in the middle of a dump leaves its parasite in the source (the blob
    ``/memfd:CRIUMFD`` stays mapped in it). gpusnapd killed CRIU when a dump outran its timeout; now CRIU runs to
    its post-dump, is told no there (it cures and resumes the tree), and the dump fails ``CRIU_TIMEOUT``."""
    w = workloads.start("--mem-mb", "1500", "--no-child", "--no-listener")
    res = daemon.cli("-o", "json", "dump", str(w.pid), "--timeout", "0.5")
    assert res.returncode == 8 and json.loads(res.stdout)["error"]["reason"] == "CRIU_TIMEOUT", res.stderr
    assert "CRIUMFD" not in Path(f"/proc/{w.pid}/maps").read_text(), "CRIU's parasite is left in the source"
    assert "never killed in the middle" in res.stderr, res.stderr
    assert psutil.Process(w.pid).status() not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    before = w.last("parent.log")
    wait_for(lambda: w.last("parent.log") > before + 3, 10, "the source does not run after the failed dump")
    assert json.loads(daemon.cli("-o", "json", "ls", check=True).stdout) == [], "nothing published"


def test_two_checkpoints_of_different_trees(daemon: DaemonProc, workloads: Workloads) -> None:
    a = workloads.start("--mem-mb", "50", "--no-listener")
    b = workloads.start("--mem-mb", "50", "--no-listener")
    client = daemon.client()
    op_a = client.checkpoint(a.pid, name="tree-a")
    op_b = client.checkpoint(b.pid, name="tree-b")
    done_a, done_b = client.wait(op_a.id), client.wait(op_b.id)
    assert {done_a.snapshot.name, done_b.snapshot.name} == {"tree-a", "tree-b"}
    assert sorted(s.name for s in client.list_snapshots()) == ["tree-a", "tree-b"]


def test_second_checkpoint_of_the_same_tree_is_rejected(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "400", "--no-listener")
    child = psutil.Process(w.pid).children()[0].pid
    client = daemon.client()
    first = client.checkpoint(w.pid, name="first")
    with pytest.raises(AbortedError) as err:
        client.checkpoint(child)  # a process of the same tree
    assert err.value.reason == "TREE_BUSY" and first.id in err.value.message
    assert err.value.action.value == "retry" and err.value.metadata["operation_id"] == first.id
    res = daemon.cli("dump", str(w.pid))
    assert res.returncode == 5 and "already part of running operation" in res.stderr
    assert client.wait(first.id).snapshot.name == "first"


def test_watch_streams_phases(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "8", "--no-listener")
    client = daemon.client()
    op = client.checkpoint(w.pid)
    events = list(client.watch(op.id))
    finished = [e.phase for e in events if e.type is EventType.PHASE_FINISHED]
    assert finished == ["preflight", "dump", "checksum", "publish", "finish"]
    assert events[-1].type is EventType.OPERATION_FINISHED
    assert [e.sequence for e in events] == list(range(len(events)))
    checksum = next(e for e in events if e.type is EventType.PHASE_FINISHED and e.phase == "checksum")
    assert checksum.bytes == events[-1].operation.snapshot.size_bytes > 8 * 2**20


def test_staging_leftovers_removed_at_start(daemon: DaemonProc, tmp_path: object) -> None:
    from tests.conftest import start_daemon, stop_daemon

    stop_daemon(daemon)
    leftover = daemon.store / "staging" / "snap-leftoverleftoverleftoverle"
    (leftover / "images").mkdir(parents=True)
    (leftover / "images" / "pages-1.img").write_bytes(b"x" * 100)
    d2 = start_daemon(daemon.store.parent)
    try:
        assert d2.alive(), d2.log.read_text()
        assert not leftover.exists()
        assert json.loads(d2.cli("-o", "json", "ls", check=True).stdout) == []
    finally:
        stop_daemon(d2)


def test_store_in_use_by_another_daemon(daemon: DaemonProc) -> None:
    from tests.conftest import start_daemon, stop_daemon

    d2 = start_daemon(daemon.store.parent)
    try:
        assert d2.proc.wait(timeout=30) == 4, "the documented exit code for 'in use' (docs/errors.md)"
        assert "in use by another gpusnapd" in d2.log.read_text()
    finally:
        stop_daemon(d2)


def test_old_criu_is_refused_at_start(tmp_path: object) -> None:
    from pathlib import Path

    from tests.conftest import start_daemon, stop_daemon

    tmp = Path(str(tmp_path))
    fake = tmp / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    fake.chmod(0o755)
    d = start_daemon(tmp, criu_binary=str(fake))
    try:
        assert d.proc.wait(timeout=30) == 3
        assert "CRIU 3.17.1 is too old" in d.log.read_text()
    finally:
        stop_daemon(d)


def test_sigterm_stops_the_daemon_cleanly(daemon: DaemonProc) -> None:
    os.kill(daemon.proc.pid, signal.SIGTERM)
    assert daemon.proc.wait(timeout=20) == 0
    assert not daemon.socket.exists()


def test_a_stop_during_the_start_stops_the_daemon_cleanly(tmp_path: Path) -> None:
    """Issue 26, item 10: a SIGTERM while gpusnapd builds itself (``systemctl stop`` during the start; here as
    soon as it has locked its store) killed it with no clean-up (exit -15, its socket left): the handlers came
    only after the socket was bound. Now it finishes starting, then stops as on any SIGTERM."""
    lock = tmp_path / "store" / ".lock"
    sent: list[int] = []

    def stop_when_locked() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not sent:
            if lock.exists():
                for p in psutil.process_iter(["cmdline"]):
                    if str(lock.parent) in (p.info["cmdline"] or []) and "gpusnap.daemon.main" in p.info["cmdline"]:
                        os.kill(p.pid, signal.SIGTERM)
                        sent.append(p.pid)
            time.sleep(0.001)

    killer = threading.Thread(target=stop_when_locked)
    killer.start()
    d = start_daemon(tmp_path)
    killer.join()
    try:
        assert sent == [d.proc.pid], sent
        assert d.proc.wait(timeout=30) == 0, d.log.read_text()[-2000:]
        assert not d.socket.exists(), "the socket was left behind"
        assert "daemon.stopped" in d.log.read_text()
    finally:
        stop_daemon(d)


def test_failed_dump_keeps_its_log(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "1500", "--no-child", "--no-listener")
    with criu_killed(daemon.proc.pid, delay_s=0.15):  # in the middle of writing pages
        res = daemon.cli("dump", str(w.pid))
    assert res.returncode == 5
    kept = res.stderr.rsplit("full log: ", 1)[-1].rstrip(")\n")
    assert "/logs/" in kept and os.path.exists(kept), res.stderr


def test_a_dump_that_fills_the_disk_names_a_log_that_exists(tmp_path: Path, workloads: Workloads) -> None:
    """Issue 19 item 7: on a full disk the failed dump's log could not be copied out of its staging
    directory, and the error named the staging copy, which went with the staging directory. The store is a
    24 MiB tmpfs here, and the workload holds 64 MiB."""
    store = tmp_path / "store"
    store.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(store)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    d = start_daemon(tmp_path)
    try:
        assert d.alive(), d.log.read_text()
        w = workloads.start("--mem-mb", "64", "--random", "--no-child", "--no-listener")
        res = d.cli("dump", str(w.pid))
        assert res.returncode != 0 and "full log: " in res.stderr, res.stderr
        kept = res.stderr.rsplit("full log: ", 1)[-1].split(")")[0]
        assert "/logs/" in kept and os.path.exists(kept), res.stderr
        assert "Error" in Path(kept).read_text(errors="replace"), "the log holds CRIU's account of the failure"
        assert psutil.Process(w.pid).status() != psutil.STATUS_STOPPED, "the source runs on"
    finally:
        stop_daemon(d)
        subprocess.run(["umount", "-l", str(store)])


def test_wait_and_watch_end_for_an_operation_finished_before_a_restart(tmp_path: Path, workloads: Workloads) -> None:
    """Issue 19 item 4: ``gpusnap wait`` never returned for an operation that finished before the daemon
    restarted, although GetOperation showed SUCCEEDED."""
    d = start_daemon(tmp_path)
    try:
        w = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
        op_id = d.client().checkpoint(w.pid).id
        d.client().wait(op_id, timeout_s=60)
    finally:
        stop_daemon(d)
    d = start_daemon(tmp_path)
    try:
        res = d.cli("-o", "json", "wait", op_id, timeout=30)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["state"] == "succeeded", res.stdout
        events = list(d.client().watch(op_id))
        assert events and events[-1].type is EventType.OPERATION_FINISHED
    finally:
        stop_daemon(d)
