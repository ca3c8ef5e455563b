"""drivers.filecopies: the copy a restore gives a tree of a file it writes at its own position."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from gpusnap.daemon.api.types import Creds, FileCopy
from gpusnap.daemon.drivers import filecopies
from gpusnap.daemon.store import documents


def _spec(log: Path, size: int, in_place: bool, flags: int = os.O_WRONLY) -> filecopies.CopySpec:
    copy = filecopies.FileToCopy(
        path=str(log),
        key=str(log)[1:],
        reopen=False,
        copy="w.log.gpusnap-op-x",
        size=size,
        pos=size,
        flags=flags,
        owner=Creds(uid=0, gid=0),
    )
    return filecopies.CopySpec(in_place=in_place, files=(copy,))


def test_a_grown_file_gets_a_copy_of_its_dumped_bytes_at_its_position(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_bytes(b"dumped\nwritten later\n")
    os.chmod(log, 0o640)
    made = filecopies.make(_spec(log, 7, in_place=True, flags=os.O_WRONLY | os.O_NONBLOCK))
    [(key, fd)] = made.inherit
    copy = tmp_path / "w.log.gpusnap-op-x"
    assert key == str(log)[1:] and made.copies == [FileCopy(str(log), str(copy), 7)]
    assert copy.read_bytes() == b"dumped\n" and os.stat(copy).st_mode & 0o777 == 0o640
    assert os.lseek(fd, 0, os.SEEK_CUR) == 7
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    assert flags & os.O_ACCMODE == os.O_WRONLY and flags & os.O_NONBLOCK
    made.close_fds()
    assert log.read_bytes() == b"dumped\nwritten later\n", "the file itself is left as it is"
    made.discard()
    assert not copy.exists()


def test_in_place_leaves_a_file_as_dumped_to_criu_and_a_copy_otherwise(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_bytes(b"dumped\n")
    assert filecopies.make(_spec(log, 7, in_place=True)).inherit == []
    made = filecopies.make(_spec(log, 7, in_place=False))  # another restore continues the file itself
    assert (tmp_path / "w.log.gpusnap-op-x").read_bytes() == b"dumped\n"
    made.close_fds()


def test_a_file_cut_back_is_refused_and_a_taken_name_never_overwritten(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_bytes(b"dump")
    with pytest.raises(filecopies.Refused) as shrunk:
        filecopies.make(_spec(log, 7, in_place=True))
    assert shrunk.value.reason == "FILE_SHRUNK" and "is 4 bytes, 7 at the dump" in str(shrunk.value)
    log.write_bytes(b"dumped\nand more\n")
    (tmp_path / "w.log.gpusnap-op-x").write_bytes(b"someone's")
    with pytest.raises(filecopies.Refused) as taken:
        filecopies.make(_spec(log, 7, in_place=True))
    assert taken.value.reason == "FILE_COPY_FAILED" and "(File exists)" in str(taken.value)
    assert (tmp_path / "w.log.gpusnap-op-x").read_bytes() == b"someone's"


def test_discard_removes_only_the_copy_it_made(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_bytes(b"dumped\nmore\n")
    made = filecopies.make(_spec(log, 7, in_place=False))
    made.close_fds()
    copy = tmp_path / "w.log.gpusnap-op-x"
    copy.rename(tmp_path / "moved")  # the copy lives on under another name; its own name is another file's
    copy.write_bytes(b"another file now")
    made.discard()
    assert copy.read_bytes() == b"another file now" and (tmp_path / "moved").read_bytes() == b"dumped\n"


def test_the_ledger_reaches_the_reaper_and_removes_the_copies_as_their_owner(tmp_path: Path) -> None:
    """What the restore's namespace init hands the reaper (``--copies-fd``) reads back as the ledger made, and
    removes the copies."""
    log = tmp_path / "w.log"
    log.write_bytes(b"dumped\nmore\n")
    made = filecopies.make(_spec(log, 7, in_place=False))
    made.close_fds()
    ledger = documents.decode(documents.encode(made.ledger()), filecopies.Ledger)
    assert ledger == made.ledger() and ledger.copies[0].owner == Creds(uid=0, gid=0)
    filecopies.remove(ledger)
    assert not (tmp_path / "w.log.gpusnap-op-x").exists() and log.exists()
