"""Progress inside long phases: bytes done, the rate, and the total where one is known, as events of the operation,
so the live display, ``wait --events`` (text or JSON Lines) and the gRPC Watch all carry the same."""

from __future__ import annotations

import json
import re

import pytest

from gpusnap.daemon.client.values import EventType
from tests.conftest import DaemonProc, Workloads


def test_dump_checksum_and_restore_report_bytes_and_rate(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "600", "--random", "--no-listener", "--no-child")
    op = daemon.cli("dump", str(w.pid), "--name", "big", "--detach", check=True).stdout.strip()
    lines = daemon.cli("-o", "json", "wait", op, "--events", check=True).stdout.splitlines()
    events = [json.loads(line) for line in lines]  # JSON Lines: one event a line
    assert events[-1]["type"] == "operation_finished" and events[-1]["operation"]["state"] == "succeeded"
    size = events[-1]["operation"]["snapshot"]["size_bytes"]
    dump = [e for e in events if e["type"] == "progress" and e["phase"] == "dump"]
    moving = [e for e in dump if e["bytes"] > 0]
    assert moving and [e["bytes"] for e in moving] == sorted(e["bytes"] for e in moving), dump
    assert any(e["bytes_per_second"] > 0 for e in moving), json.dumps(dump)
    assert all(not e.get("total_bytes") for e in dump), "a dump's total is not known before it ends"
    assert moving[-1]["bytes"] <= size
    checksum = [e for e in events if e["type"] == "progress" and e["phase"] == "checksum"]
    assert checksum and checksum[-1]["bytes"] == checksum[-1]["total_bytes"] == size, checksum
    [finished] = [e for e in events if e["type"] == "phase_finished" and e["phase"] == "dump"]
    assert finished["bytes"] == size, "the dump phase ends with the images' bytes"

    client = daemon.client()  # the gRPC Watch carries the same
    handle = client.restore("big")
    watched = list(client.watch(handle.id))
    restore = [e for e in watched if e.type is EventType.PROGRESS and e.phase == "restore"]
    assert restore and all(e.total_bytes == size for e in restore), restore
    assert any(0 < e.bytes <= size and e.bytes_per_second > 0 for e in restore), restore
    verify = [e for e in watched if e.type is EventType.PROGRESS and e.phase == "verify"]
    assert verify and verify[-1].bytes == verify[-1].total_bytes <= size, "what verify hashes before CRIU runs"
    workloads.adopt(client.wait(handle.id).restore.pid)

    text = daemon.cli("wait", handle.id, "--events", check=True).stdout  # what a person reads in a log
    line = r"^\d\d:\d\d:\d\d\.\d restore progress [\d.]+ [KM]iB( of [\d.]+ MiB)? at [\d.]+ [KMG]iB/s$"
    assert re.search(line, text, re.M), text
    assert re.search(
        r"^\d\d:\d\d:\d\d\.\d restore phase finished [\d.]+ MiB at [\d.]+ [KMG]iB/s in [\d.]+ s$", text, re.M
    )
    assert re.search(r"^\d\d:\d\d:\d\d\.\d operation finished$", text, re.M), text


def test_the_rate_is_over_the_last_seconds_and_survives_a_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A phase measured from outside can go seconds without a new count (CRIU busy elsewhere); the report after the
    gap still says a rate, over the bytes since the last report before it."""
    from gpusnap.daemon.operations import base

    clock = [100.0]
    monkeypatch.setattr(base.time, "monotonic", lambda: clock[0])
    record = base.OperationRecord(base.OperationKind.RESTORE)
    progress = base.PhaseProgress(record, "restore")
    tick = progress.ticks(total=4 << 30)
    for at, done in ((100.5, 256 << 20), (101.0, 512 << 20), (104.0, 2 << 30), (104.5, 2 << 30)):
        clock[0] = at
        tick(done)
    rates = [e.bytes_per_second for e in record.events if e.type is base.EventType.PROGRESS]
    assert len(rates) == 3, "an unchanged count is not reported again"
    assert rates[0] == pytest.approx((256 << 20) / 0.5) and rates[1] == pytest.approx((512 << 20) / 1.0)
    assert rates[2] == pytest.approx(((2 << 30) - (512 << 20)) / 3.0), "after the gap: since the report before it"
