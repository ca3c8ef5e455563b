"""BufferStore: staged files are digested by the daemon, stored once per user and content, kept while a
snapshot or an operation needs them, and refused when the store has no room."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import DataLossError, ResourceExhaustedError
from gpusnap.daemon.store import checksum
from gpusnap.daemon.store.buffers import BufferStore
from tests.lanes import LANES


def _store(tmp_path: Path) -> BufferStore:
    store = BufferStore(tmp_path / "buffers", executor=LANES)
    store.open()
    return store


def _write(store: BufferStore, uid: int, contents: dict[str, bytes]):  # type: ignore[no-untyped-def]
    staged = store.stage(uid, list(contents), [len(c) for c in contents.values()])
    for fd, data in zip(staged.memfds(range(len(contents))), contents.values(), strict=True):  # the worker's
        os.pwrite(fd, data, 0)
    staged.start_digests()
    return staged


def test_commit_names_blobs_by_digest_and_stores_identical_content_once(tmp_path: Path) -> None:
    store = _store(tmp_path)
    a = _write(store, 1000, {"w": b"x" * 5000, "b": b"y" * 10})
    refs = a.commit()
    assert [r.name for r in refs] == ["w", "b"]
    path = store.path(1000, refs[0].sha256)
    assert refs[0].sha256 == checksum.file_digests([path], LANES.digest)[0] and path.read_bytes() == b"x" * 5000
    assert oct(path.stat().st_mode & 0o777) == "0o400"
    again = _write(store, 1000, {"other-name": b"x" * 5000})
    assert again.commit()[0].sha256 == refs[0].sha256
    assert store.used_bytes() == 5010, "the second copy was dropped"
    _write(store, 1001, {"w": b"x" * 5000}).commit()
    assert store.used_bytes() == 10010, "another user's worker gets its own blob"
    for s in (a, again):
        s.close()
    assert not list(store.incoming.iterdir())


def test_garbage_collection_spares_referenced_and_pinned_blobs(tmp_path: Path) -> None:
    store = _store(tmp_path)
    kept = _write(store, 0, {"k": b"k" * 100})
    kept_ref = kept.commit()[0]
    kept.close()
    inflight = _write(store, 0, {"p": b"p" * 100})
    pinned_ref = inflight.commit()[0]  # committed, manifest not published yet
    gone = _write(store, 0, {"g": b"g" * 100})
    gone.commit()
    gone.close()
    assert store.collect_garbage(lambda: {store.key(0, kept_ref.sha256)}) == 100
    assert store.path(0, pinned_ref.sha256).exists()
    inflight.close()
    store.pin(0, [kept_ref.sha256])  # as a restore does
    assert store.collect_garbage(set) == 100, "the in-flight blob goes once unpinned; the restored one stays"
    store.unpin(0, [kept_ref.sha256])
    assert store.collect_garbage(lambda: {store.key(0, kept_ref.sha256)}) == 0
    assert store.used_bytes() == 100


def test_a_worker_cannot_grow_its_buffers_past_the_announced_size(tmp_path: Path) -> None:
    """Issue 19, item 8: the worker kept its read-write descriptor of the store's own staged file and grew
    the blob past every budget, during or after its capture. It now writes into a sealed memfd: a descriptor
    it keeps (or reopens through /proc) cannot grow, shrink or reseal it, and never reaches the blob."""
    store = _store(tmp_path)
    staged = store.stage(1000, ["w"], [100])
    (memfd,) = staged.memfds([0])
    kept = os.dup(memfd)  # what a hostile worker keeps
    reopened = os.open(f"/proc/self/fd/{memfd}", os.O_RDWR)
    try:
        os.pwrite(kept, b"short", 0)
        for fd in (kept, reopened):
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x" * 4096, 100)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 1 << 30)
            with pytest.raises(PermissionError):
                os.posix_fallocate(fd, 0, 1 << 30)
        (ref,) = staged.commit()
        blob = store.path(1000, ref.sha256)
        assert blob.read_bytes() == b"short" + bytes(95), "the blob holds what was written, at the announced size"
        os.pwrite(kept, b"later", 0)  # after the capture: only the worker's own memory changes
        assert blob.read_bytes()[:5] == b"short" and store.used_bytes() == 100
    finally:
        os.close(kept)
        os.close(reopened)
        staged.close()


def test_a_wrong_size_or_missing_blob_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    ok = _write(store, 0, {"w": b"w" * 10})
    ref = ok.commit()[0]
    ok.close()
    store.check_present("snap-x", 0, [ref])
    store.path(0, ref.sha256).unlink()
    with pytest.raises(DataLossError, match="missing from") as err:
        store.check_present("snap-x", 0, [ref])
    assert err.value.reason == "BUFFER_MISSING"


def test_staging_more_than_the_free_space_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    with pytest.raises(ResourceExhaustedError, match="buffer store .* free") as err:
        store.stage(0, ["huge"], [1 << 62])
    assert err.value.reason == "BUFFER_STORE_FULL"


def test_read_descriptors_survive_the_commit(tmp_path: Path) -> None:
    store = _store(tmp_path)
    staged = _write(store, 0, {"w": b"abc" * 100})
    staged.commit()
    (fd,) = staged.read_fds()
    try:
        assert os.pread(fd, 3, 0) == b"abc"
    finally:
        os.close(fd)
        staged.close()


def test_two_daemons_cannot_share_a_buffer_store(tmp_path: Path) -> None:
    from gpusnap.daemon.api.errors import FailedPreconditionError

    first = _store(tmp_path)
    with pytest.raises(FailedPreconditionError, match="in use by another gpusnapd") as err:
        _store(tmp_path)
    assert err.value.reason == "STORE_LOCKED"
    first.close()
    _store(tmp_path).close()


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache (``mincore`` over a read-only mapping, which faults nothing in)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def test_prefetch_reads_disk_tier_blobs_into_the_page_cache(tmp_path: Path) -> None:
    """Restores without --verify-buffers read disk-tier blobs ahead while CRIU runs; RAM-tier ones are skipped."""
    store = BufferStore(tmp_path / "ram", disk=tmp_path / "disk", executor=LANES)
    store.open()
    data = os.urandom(1 << 20)
    staged = store.stage(1000, ["w"], [len(data)])
    os.pwrite(staged.memfds([0])[0], data, 0)
    staged.start_digests()
    (ref,) = staged.commit()
    staged.close()
    ram_path = store.path(1000, ref.sha256)
    disk_path = store.tiers[1].blobs / store.key(1000, ref.sha256)
    disk_path.parent.mkdir(mode=0o700, exist_ok=True)
    os.rename(ram_path, disk_path)  # as a budget pass moves it
    assert store.path(1000, ref.sha256) == disk_path
    fd = os.open(disk_path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped from the cache
    os.close(fd)
    if _resident_pages(disk_path) > 16:
        pytest.skip("this filesystem keeps the blob cached (tmpfs?): nothing to read ahead")
    assert store.prefetch(1000, [ref]).result(timeout=30) == len(data)
    deadline = time.monotonic() + 10  # readahead completes asynchronously
    while _resident_pages(disk_path) < len(data) // 4096 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _resident_pages(disk_path) == len(data) // 4096
    assert disk_path.read_bytes() == data
    os.rename(disk_path, ram_path)
    assert store.prefetch(1000, [ref]).result(timeout=30) == 0, "a RAM-tier blob is not read ahead"
