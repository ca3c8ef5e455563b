"""Fan-out: one restore call brings back N copies, each progressing in its own network and context."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import InvalidArgumentError
from tests.adapters.test_agent_roundtrip import _start
from tests.conftest import DaemonProc, Workloads, kill_tree, phase_seconds, wait_for

ASK = "import socket,sys; s=socket.create_connection(('127.0.0.1', int(sys.argv[1])), 5); print(s.recv(64).decode())"


def _netns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _hello(pid: int, port: str) -> int:
    """Ask the copy ``pid`` for its counter, on 127.0.0.1:``port`` inside its own network namespace."""
    out = subprocess.run(
        ["nsenter", "-t", str(pid), "-n", sys.executable, "-c", ASK, port],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    word, counter = out.split()
    assert word == "hello"
    return int(counter)


def test_replicas_each_run_on_their_own_network(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "16")
    port = w.read("port")
    dumped = json.loads(daemon.cli("-o", "json", "dump", str(w.pid), "--name", "fan", check=True).stdout)
    res = daemon.cli("-o", "json", "restore", "fan", "--replicas", "3")
    assert res.returncode == 0, res.stderr
    restored = json.loads(res.stdout)
    copies = restored["replicas"]
    for c in copies:
        workloads.adopt(c["pid"])
    assert [c["index"] for c in copies] == [0, 1, 2]
    pids = [c["pid"] for c in copies]
    assert len(set(pids)) == 3 and restored["pid"] == pids[0]
    assert all(len(c["pids"]) == 2 for c in copies), "parent and child in every copy"
    assert {c["namespace_pid"] for c in copies} == {w.pid}, "each copy has the original PIDs in its own namespace"
    nets = {_netns(p) for p in pids}
    assert len(nets) == 3 and _netns(os.getpid()) not in nets, "one private network namespace per copy"
    assert {"restore#0", "validate#0", "restore#2", "validate#2"} <= set(phase_seconds(restored))
    assert "verify" in phase_seconds(restored), "the images are verified once for all copies"

    first = [_hello(p, port) for p in pids]  # every copy answers on the same port, in its own namespace
    time.sleep(1.5)
    later = [_hello(p, port) for p in pids]
    assert all(b > a for a, b in zip(first, later, strict=True)), f"every copy progresses: {first} -> {later}"
    assert min(first) >= int(w.read("parent.log").split()[0]), "they carry on from the snapshot"
    assert dumped["id"] == restored["snapshot_id"]


def test_replicas_get_their_own_restore_context(daemon: DaemonProc, tmp_path: Path) -> None:
    toy = _start(daemon, tmp_path)
    pids: list[int] = []
    try:
        before = toy.generate()
        daemon.cli("dump", str(toy.proc.pid), "--name", "toyfan", check=True)
        restored = json.loads(
            daemon.cli(
                "-o",
                "json",
                "restore",
                "toyfan",
                "--replicas",
                "2",
                "--set",
                "port=80{i}",
                "--set",
                "node=n-{i}",
                "--env",
                "TOY_PORT=90{i}",
                check=True,
            ).stdout
        )
        pids = [c["pid"] for c in restored["replicas"]]
        lines = [json.loads(x) for x in (toy.workdir / "contexts.jsonl").read_text().splitlines()]
        assert sorted((x["values"]["port"], x["values"]["node"], x["TOY_PORT"]) for x in lines) == [
            ("800", "n-0", "900"),
            ("801", "n-1", "901"),
        ]
        assert len({x["netns"] for x in lines}) == 2, "each copy resumed in its own network namespace"
        assert {"resume-worker#0", "resume-worker#1"} <= set(phase_seconds(restored)), "each copy's canary passed"
        wait_for(lambda: all(Path(f"/proc/{p}").exists() for p in pids), 5, "copies gone")
        assert toy.generate() == before, "a copy serves the capture-time tokens"
    finally:
        kill_tree(toy.proc.pid, *pids)


def test_bad_replica_counts(daemon: DaemonProc) -> None:
    res = daemon.cli("restore", "x", "--replicas", "0")
    assert res.returncode == 2 and "--replicas" in res.stderr
    with pytest.raises(InvalidArgumentError) as err:  # the daemon checks too, before anything else
        daemon.client().restore("snap-aaaaaaaaaaaaaaaaaaaaaaaaaa", replicas=65)
    assert err.value.reason == "INVALID_REPLICAS"
    with pytest.raises(InvalidArgumentError, match="drop --host-pidns"):
        daemon.client().restore("snap-aaaaaaaaaaaaaaaaaaaaaaaaaa", replicas=2, host_pid_namespace=True)
