"""Checkpoint and restore of a real process tree through gpusnapd, CRIU and the CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import psutil

from tests.conftest import DaemonProc, Workload, Workloads, wait_for


def _hello(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        return s.recv(100).decode()


def _check_alive_and_intact(w: Workload, root_pid: int) -> None:
    """Counters advance, the child runs, memory hashes to the pattern, the listener answers."""
    parent_before, child_before = w.last("parent.log"), w.last("child.log")
    wait_for(lambda: w.last("parent.log") > parent_before + 3, 10, "parent counter did not advance")
    wait_for(lambda: w.last("child.log") > child_before + 3, 10, "child counter did not advance (pipe broken?)")
    kids = psutil.Process(root_pid).children()
    assert len(kids) == 1 and kids[0].status() != psutil.STATUS_ZOMBIE
    (w.workdir / "sha_now").unlink(missing_ok=True)
    os.kill(root_pid, signal.SIGUSR1)
    wait_for(lambda: (w.workdir / "sha_now").exists(), 20, "memory was not re-hashed")
    assert w.read("sha_now") == w.read("expected_sha")
    assert _hello(int(w.read("port"))).startswith("hello ")


def _inspect(daemon: DaemonProc, ref: str) -> dict:  # type: ignore[type-arg]
    return json.loads(daemon.cli("-o", "json", "inspect", ref, check=True).stdout)  # type: ignore[no-any-return]


def test_round_trip_of_a_process_tree(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "100")
    assert _hello(int(w.read("port"))).startswith("hello ")
    counter_at_dump = w.last("parent.log")

    res = daemon.cli("-o", "json", "dump", str(w.pid), "--name", "tree-100m", "--label", "test=roundtrip", check=True)
    dumped = json.loads(res.stdout)
    assert dumped["id"].startswith("snap-") and dumped["name"] == "tree-100m"
    assert dumped["size_bytes"] > 100 * 2**20, "images must hold the 100 MiB of memory"
    assert w.proc is not None and w.proc.wait(timeout=10) == -signal.SIGKILL, "the source is killed after the dump"
    frozen_at = w.last("parent.log")
    assert frozen_at >= counter_at_dump

    images = {int(i["pid"]): int(i["image_bytes"]) for i in _inspect(daemon, "tree-100m")["process_images"]}
    child = next(p for p in images if p != w.pid)
    assert set(images) == {w.pid, child}, images
    assert min(images.values()) >= 100 * 2**20, (
        f"each process's images hold the 100 MiB (the child's since fork): {images}"
    )
    assert sum(images.values()) <= dumped["size_bytes"]

    listed = json.loads(daemon.cli("-o", "json", "ls", check=True).stdout)
    assert [s["id"] for s in listed] == [dumped["id"]]
    assert listed[0]["labels"] == {"test": "roundtrip"}
    assert len(listed[0]["source"]["tree_pids"]) == 2

    res = daemon.cli("-o", "json", "restore", "tree-100m", check=True)
    restored = json.loads(res.stdout)
    workloads.adopt(restored["pid"])
    assert restored["namespace_pid"] == w.pid, "the tree keeps its PIDs inside its fresh PID namespace"
    assert len(restored["pids"]) == 2
    wait_for(lambda: w.last("parent.log") > frozen_at, 10, "restored parent did not continue its counter")
    assert w.last("parent.log") == frozen_at + 1 or w.last("parent.log") > frozen_at, "counter continues, not restarts"
    assert int(w.read("parent.log").split()[0]) == 1
    _check_alive_and_intact(w, restored["pid"])
    print(
        f"\nMEASURED 100MiB tree: dump phases {dumped['phases']}, restore phases {restored['phases']}, "
        f"image {dumped['size_bytes']} bytes"
    )


def test_counter_continues_exactly(daemon: DaemonProc, workloads: Workloads) -> None:
    """After restore the parent's counter goes on from where it was frozen, with no gap or restart."""
    w = workloads.start("--mem-mb", "8", "--no-listener")
    time.sleep(0.5)
    snap = json.loads(daemon.cli("-o", "json", "dump", str(w.pid), check=True).stdout)["id"]
    frozen = [int(x) for x in w.read("parent.log").split()]
    restored = json.loads(daemon.cli("-o", "json", "restore", snap, check=True).stdout)
    workloads.adopt(restored["pid"])
    wait_for(lambda: w.last("parent.log") > frozen[-1] + 5, 10, "counter did not continue")
    values = [int(x) for x in w.read("parent.log").split()]
    assert values == list(range(1, len(values) + 1)), "every counter value once, in order"


def test_two_restores_of_one_snapshot_do_not_clash(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "8", "--no-listener")
    snap = json.loads(daemon.cli("-o", "json", "dump", str(w.pid), check=True).stdout)["id"]
    first = json.loads(daemon.cli("-o", "json", "restore", snap, check=True).stdout)
    second = json.loads(daemon.cli("-o", "json", "restore", snap, check=True).stdout)
    for r in (first, second):
        workloads.adopt(r["pid"])
    assert first["pid"] != second["pid"]
    assert first["namespace_pid"] == second["namespace_pid"] == w.pid
    assert psutil.Process(first["pid"]).is_running() and psutil.Process(second["pid"]).is_running()


def test_leave_running_keeps_the_source(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "8", "--no-listener", "--no-child")
    daemon.cli("dump", str(w.pid), "--leave-running", check=True)
    before = w.last("parent.log")
    wait_for(lambda: w.last("parent.log") > before + 3, 10, "source stopped after --leave-running dump")


def test_restored_tree_outlives_the_daemon(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "8", "--no-listener", "--no-child")
    snap = json.loads(daemon.cli("-o", "json", "dump", str(w.pid), check=True).stdout)["id"]
    restored = json.loads(daemon.cli("-o", "json", "restore", snap, check=True).stdout)
    workloads.adopt(restored["pid"])
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=20) == 0
    before = w.last("parent.log")
    wait_for(lambda: w.last("parent.log") > before + 3, 10, "restored tree died with the daemon")


def test_dump_inspect_table_output(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "4", "--no-listener", "--no-child")
    res = daemon.cli("dump", str(w.pid), "--name", "tbl", check=True)
    snap_id = res.stdout.strip()
    assert snap_id.startswith("snap-") and "\n" not in snap_id, "table mode prints the id alone on stdout"
    inspect = daemon.cli("inspect", "tbl", check=True).stdout
    assert snap_id in inspect and "CRIU 4." in inspect and "dump" in inspect
    assert f"PID {w.pid}: " in inspect and "in the images" in inspect, "what the images hold of the process"
    assert snap_id in daemon.cli("ls", check=True).stdout
    op_id = daemon.cli("restore", "tbl", "--detach", check=True).stdout.strip()
    assert op_id.startswith("op-")
    waited = daemon.cli("wait", op_id, check=True).stdout
    assert f"{op_id} succeeded: restored as PID " in waited
    workloads.adopt(int(waited.split("restored as PID ")[1].split()[0]))
    assert daemon.cli("rm", "tbl", check=True).stdout.strip() == snap_id
    assert json.loads(daemon.cli("ls", "-o", "json", check=True).stdout) == [], "-o after the command works too"


def test_a_restored_tree_can_be_checkpointed_again(daemon: DaemonProc, workloads: Workloads) -> None:
    """The restored tree lives in its own PID namespace; CRIU is run inside it to capture it again."""
    w = workloads.start("--mem-mb", "8", "--no-listener")
    first = json.loads(daemon.cli("-o", "json", "dump", str(w.pid), check=True).stdout)["id"]
    restored = json.loads(daemon.cli("-o", "json", "restore", first, check=True).stdout)
    workloads.adopt(restored["pid"])
    wait_for(lambda: w.last("parent.log") > 3, 10, "restored tree does not run")
    second = json.loads(daemon.cli("-o", "json", "dump", str(restored["pid"]), check=True).stdout)
    frozen = w.last("parent.log")
    again = json.loads(daemon.cli("-o", "json", "restore", second["id"], check=True).stdout)
    workloads.adopt(again["pid"])
    assert again["namespace_pid"] == w.pid
    wait_for(lambda: w.last("parent.log") > frozen + 3, 10, "twice-restored tree does not run")
    assert len(psutil.Process(again["pid"]).children()) == 1
