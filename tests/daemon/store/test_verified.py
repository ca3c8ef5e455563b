"""Image files verified once on a root-only RAM store (``store.verified``): what is trusted, and the re-check."""

from __future__ import annotations

import mmap
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.store import checksum
from gpusnap.daemon.store.verified import Status, VerifiedOnce
from tests.lanes import LANES


@pytest.fixture
def ram_dir() -> Iterator[Path]:
    path = Path(f"/dev/shm/gpusnap-test-verified-{uuid.uuid4().hex[:8]}")
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _remembered(ram_dir: Path, data: bytes) -> tuple[VerifiedOnce, Path, str]:
    v = VerifiedOnce(LANES.digest)
    v.use_store(ram_dir)
    path = ram_dir / "pages-1.img"
    path.write_bytes(data)
    st = Status.of(path)
    [digest] = checksum.file_digests([path], LANES.digest)
    v.remember(st, path, digest)
    return v, path, digest


def test_only_a_root_only_ram_store_keeps_trust(ram_dir: Path, tmp_path: Path) -> None:
    v = VerifiedOnce(LANES.digest)
    v.use_store(tmp_path)  # the test machine's /tmp is a disk
    assert v.enabled == _is_ram(tmp_path)
    v.use_store(ram_dir)
    assert v.enabled
    os.chmod(ram_dir, 0o755)  # others may list it: not closed to them
    v.use_store(ram_dir)
    assert not v.enabled


def _is_ram(path: Path) -> bool:
    from gpusnap.daemon.store.verified import RAMFS_MAGIC, TMPFS_MAGIC, fs_type

    return fs_type(path) in (TMPFS_MAGIC, RAMFS_MAGIC) and path.stat().st_mode & 0o077 == 0


def test_a_write_ends_trust(ram_dir: Path) -> None:
    v, path, digest = _remembered(ram_dir, os.urandom(checksum.CHUNK_BYTES + 5))
    assert v.trusted(Status.of(path), digest)
    assert not v.trusted(Status.of(path), "0" * 64), "trusted only for the digest it was hashed to"
    with open(path, "r+b") as fh:  # same size, same bytes even: a new mtime and ctime
        fh.write(path.read_bytes()[:1])
    assert not v.trusted(Status.of(path), digest)


def test_a_write_through_a_mapping_is_found_by_the_background_recheck(ram_dir: Path) -> None:
    v, path, digest = _remembered(ram_dir, os.urandom(2 * checksum.CHUNK_BYTES))
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:  # tmpfs: no time changes
        mm[checksum.CHUNK_BYTES + 3] ^= 0xFF
    st = Status.of(path)
    assert v.trusted(st, digest), "a write through a mapping leaves the status as it was (what the re-check is for)"
    v.recheck(path, st)  # hashed less than RECHECK_AFTER_S ago: not due
    v.force_due()
    done = threading.Event()
    result: list[bool] = []
    v.recheck(path, st, lambda same: (result.append(same), done.set()))
    assert done.wait(30)
    assert result == [False]
    assert not v.trusted(st, digest), "the re-check took the trust away: the next restore hashes it"


def test_an_unchanged_file_keeps_its_trust_after_the_recheck(ram_dir: Path) -> None:
    v, path, digest = _remembered(ram_dir, os.urandom(3 * checksum.CHUNK_BYTES // 2))
    v.force_due()
    done = threading.Event()
    result: list[bool] = []
    v.recheck(path, Status.of(path), lambda same: (result.append(same), done.set()))
    assert done.wait(30)
    assert result == [True] and v.trusted(Status.of(path), digest)
