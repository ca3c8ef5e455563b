"""The operation journal as a log: the last whole line is the entry, a torn line is skipped, the phase file
overlays a running entry's phase, and an unchanged entry is not appended again."""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpusnap.daemon.api.types import OperationKind, OperationState
from gpusnap.daemon.store import journal
from gpusnap.daemon.store.journal import Entry, Journal


def _entry(state: str = "running", phase: str = "", **facts: object) -> Entry:
    return Entry(
        id="op-abcdefghijklmnopqrstuvwxyz",
        kind=OperationKind.CHECKPOINT,
        owner_uid=0,
        state=OperationState(state),
        phase=phase,
        started=datetime(2026, 12, 1, tzinfo=UTC),
        facts=facts,
    )


def test_last_whole_line_wins_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal")
    j.open()
    j.write(_entry(phase="preflight", tree_pids=[1, 2]))
    j.write(_entry(phase="dump", tree_pids=[1, 2], staging="s"))
    path = tmp_path / "journal" / "op-abcdefghijklmnopqrstuvwxyz.json"
    with open(path, "ab") as fh:  # a host crash mid-append: half a line
        fh.write(b'\n{"id": "op-abcdefghijklmnopqrstuvwxyz", "state": "succ')
    (entry,) = j.entries()
    assert entry.facts == {"tree_pids": [1, 2], "staging": "s"} and entry.phase == "dump"
    j.write(_entry(state="failed", phase="dump", tree_pids=[1, 2], staging="s"))  # a recovered op's next version
    (entry,) = Journal(tmp_path / "journal").entries()
    assert entry.state is OperationState.FAILED


def test_unchanged_entry_is_not_appended(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal")
    j.open()
    j.write(_entry(tree_pids=[1]))
    path = tmp_path / "journal" / "op-abcdefghijklmnopqrstuvwxyz.json"
    size = path.stat().st_size
    j.write(_entry(tree_pids=[1]))
    assert path.stat().st_size == size
    j.write(_entry(tree_pids=[1, 2]))
    assert path.stat().st_size > size


def test_phase_file_overlays_running_entries_only(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal")
    j.open()
    j.write(_entry(phase="preflight"))
    j.write_phase("op-abcdefghijklmnopqrstuvwxyz", "checksum")
    assert Journal(tmp_path / "journal").entries()[0].phase == "checksum"
    torn = tmp_path / "journal" / "op-abcdefghijklmnopqrstuvwxyz.phase"
    torn.write_bytes(b"../\x00bad")  # torn or foreign: ignored
    assert j.entries()[0].phase == "preflight"
    j.write_phase("op-abcdefghijklmnopqrstuvwxyz", "publish")
    j.write(_entry(state="succeeded", phase="finish"))  # a durable version supersedes the phase file
    assert not (tmp_path / "journal" / "op-abcdefghijklmnopqrstuvwxyz.phase").exists()
    assert j.entries()[0].phase == "finish"


def test_unreadable_entry_is_removed(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal")
    j.open()
    bad = tmp_path / "journal" / "op-abcdefghijklmnopqrstuvwxy2.json"
    bad.write_bytes(b"\x00" * 64)
    os.sync()
    assert j.entries() == [] and not bad.exists()


def test_trim_while_a_new_entry_is_being_written_keeps_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trims run while other operations run (every JOURNAL_TRIM_EVERY finished ones): one that reads a journal
    file its operation has just created, before the first line is in it, took it for unreadable and removed
    it; the first version, appended to the removed file, was lost (a daemon crash then left that operation
    unrecovered, e.g. its tree frozen)."""
    j = Journal(tmp_path / "journal")
    j.open()
    created, go_on = threading.Event(), threading.Event()
    real_write = os.write

    def slow_first_write(fd: int, data: bytes) -> int:  # the writer stalls between O_CREAT and its first line
        created.set()
        go_on.wait(10)
        return real_write(fd, data)

    monkeypatch.setattr(journal.os, "write", slow_first_write)
    writer = threading.Thread(target=lambda: j.write(_entry(phase="preflight", tree_pids=[7])))
    writer.start()
    assert created.wait(10)
    trimmer = threading.Thread(target=j.trim)
    trimmer.start()
    trimmer.join(0.5)  # a trim that takes the journal's lock waits here for the write
    go_on.set()
    writer.join(10)
    trimmer.join(10)
    monkeypatch.setattr(journal.os, "write", real_write)
    (entry,) = Journal(tmp_path / "journal").entries()
    assert entry.facts == {"tree_pids": [7]}
