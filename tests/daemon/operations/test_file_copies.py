"""operations.file_copies: which files a restore gives the tree copies of, and what it asks the helper."""

from __future__ import annotations

import dataclasses
import os
from datetime import UTC, datetime

from gpusnap.daemon.api.types import Creds, HeldFile, HostFacts, ProcessFacts, Snapshot
from gpusnap.daemon.drivers.filecopies import CopySpec, FileToCopy
from gpusnap.daemon.operations import file_copies

W, R = os.W_OK, os.R_OK


def _snapshot(*held: HeldFile) -> Snapshot:
    return Snapshot(
        id="snap-test",
        name="",
        created=datetime.now(UTC),
        labels={},
        source=ProcessFacts(pid=1, comm="", cmdline=(), uid=1000, gid=1000, tree_pids=(1,), rss_bytes=0, cwd="/"),
        host=HostFacts(
            hostname="", kernel="", machine="", criu_version="", gpusnap_version="", cpu_model="", cpu_flags=()
        ),
        files=(),
        phases=(),
        owner_uid=1000,
        owner_creds=Creds(uid=1000, gid=1000, groups=(1000, 27)),
        held_files=held,
    )


def _fd(path: str, flags: int, pos: int = 10, what: str = "fd 3", pid: int = 1) -> HeldFile:
    access = {os.O_RDONLY: R, os.O_WRONLY: W}.get(flags & os.O_ACCMODE, R | W)
    return HeldFile(pid=pid, what=what, path=path, dev=1, ino=2, access=access, size=10, pos=pos, flags=flags)


def test_only_files_written_at_their_own_position_get_copies() -> None:
    taken: list[bool] = []
    held = (
        _fd("/h/append.log", os.O_WRONLY | os.O_APPEND),  # CRIU checks no size: continued by every copy
        _fd("/h/model.bin", os.O_RDONLY),
        HeldFile(pid=1, what="cwd", path="/h", dev=1, ino=3, access=os.X_OK),
    )
    assert file_copies.request(_snapshot(*held), "op-a", lambda: taken.append(True) or True) is None
    assert taken == [], "the in-place claim is taken only when a file needs it"
    req = file_copies.request(_snapshot(*held, _fd("/h/w.log", os.O_WRONLY | 0o100000)), "op-a-1", lambda: False)
    assert req == CopySpec(
        in_place=False,
        files=(
            FileToCopy(
                path="/h/w.log",
                key="h/w.log",
                reopen=False,
                copy="w.log.gpusnap-op-a-1",
                size=10,
                pos=10,
                flags=os.O_WRONLY | 0o100000,
                owner=Creds(1000, 1000, (1000, 27)),
            ),
        ),
    )


def test_a_file_also_read_or_mapped_gets_a_copy_it_can_read() -> None:
    mapped = HeldFile(pid=1, what="map 7f00", path="/h/db", dev=1, ino=2, access=R | W)
    req = file_copies.request(_snapshot(_fd("/h/db", os.O_WRONLY), mapped), "op-b", lambda: True)
    assert req is not None and req.in_place and req.files[0].flags & os.O_ACCMODE == os.O_RDWR


def test_a_file_held_through_several_descriptors_is_reopened_from_its_copy_once_each() -> None:
    """Issue 26, item 5: a writer and a reader (or one fd with ``O_APPEND`` and one without) are not refused;
    CRIU reopens the copy once per description (the key is the path itself: an external file)."""
    held = (_fd("/h/w.log", os.O_WRONLY, pos=10), _fd("/h/w.log", os.O_RDONLY, pos=0, what="fd 4"))
    req = file_copies.request(_snapshot(*held), "op-c", lambda: True)
    assert req is not None and req.in_place
    [f] = req.files
    assert (f.key, f.reopen, f.flags & os.O_ACCMODE) == ("/h/w.log", True, os.O_RDWR)
    one = file_copies.request(_snapshot(_fd("/h/w.log", os.O_WRONLY)), "op-c", lambda: True)
    assert one is not None and (one.files[0].key, one.files[0].reopen) == ("h/w.log", False)


def test_each_copy_is_made_as_the_process_that_writes_it() -> None:
    """Issue 26, item 1: root's snapshot of a tree whose processes ran as two users: each file's copy is
    made with its writer's rights (a writer that ran as root: root's)."""
    from gpusnap.daemon.api.types import ProcessCreds

    snap = dataclasses.replace(
        _snapshot(_fd("/h/a.log", os.O_WRONLY, pid=1), _fd("/h/b.log", os.O_WRONLY, pid=2), _fd("/r.log", 1, pid=3)),
        owner_uid=0,
        tree_creds=(ProcessCreds(1, 1000, 1000, (1000,)), ProcessCreds(2, 1001, 1001, ()), ProcessCreds(3, 0, 0)),
    )
    req = file_copies.request(snap, "op-d", lambda: True)
    assert req is not None
    assert [(f.path, f.owner.uid, f.owner.groups) for f in req.files] == [
        ("/h/a.log", 1000, (1000,)),
        ("/h/b.log", 1001, ()),
        ("/r.log", 0, ()),
    ]
