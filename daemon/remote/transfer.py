"""Moving chunks between local files and the remote store, many at once, in bounded memory.

A push reads each ``checksum.CHUNK_BYTES`` chunk of each file, hashes it, and uploads it unless an
object of that name and size exists already (content addressing: a chunk another push uploaded is not
sent again, which is also how an interrupted push resumes). A pull fetches each chunk and checks its
SHA-256 before writing it; a chunk already present at its place (an interrupted pull) is kept after the
same check. ``threads`` chunks are in flight at most, each held in memory once: the bound is
``threads * CHUNK_BYTES`` bytes (``TransferLimits.from_config``).

Each transfer has a pool of its own (``threads`` workers, as ``remote.index`` and ``remote.evict`` have for
their heads and gets), not a lane of ``gpusnap.daemon.executor``: ``remote_threads`` and
``remote_memory_bytes`` bound one push or pull (docs/fleet.md), and one shared lane would bound all of them
together, a change of what those settings mean.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpusnap.daemon.api.errors import DataLossError
from gpusnap.daemon.remote import layout
from gpusnap.daemon.remote.objects import ObjectStore
from gpusnap.daemon.store import checksum

Progress = Callable[[int, int], None]
"""Called with (bytes done, bytes total) after each chunk."""


@dataclasses.dataclass(frozen=True)
class TransferLimits:
    threads: int
    """Chunks in flight at once; memory held is at most ``threads * CHUNK_BYTES``."""
    touch_after_s: float
    """A reused chunk older than this gets its modification time renewed (half the GC grace period)."""

    @classmethod
    def from_config(cls, threads: int, memory_bytes: int, gc_grace_s: float) -> TransferLimits:
        return cls(threads=max(1, min(threads, memory_bytes // checksum.CHUNK_BYTES)), touch_after_s=gc_grace_s / 2)


@dataclasses.dataclass(frozen=True)
class Item:
    """One local file moved as chunks: an image file or a buffer blob."""

    label: str  # for messages: the image path or "buffer <name>"
    path: Path
    size: int
    is_buffer: bool = False


@dataclasses.dataclass
class Tally:
    transferred_bytes: int = 0
    skipped_bytes: int = 0
    transferred_chunks: int = 0
    skipped_chunks: int = 0
    buffer_transferred_bytes: int = 0

    def add(self, n: int, sent: bool, is_buffer: bool) -> None:
        if sent:
            self.transferred_bytes += n
            self.transferred_chunks += 1
            if is_buffer:
                self.buffer_transferred_bytes += n
        else:
            self.skipped_bytes += n
            self.skipped_chunks += 1


class _Run:
    """Runs one job per chunk on a pool, stops at the first failure, reports progress."""

    def __init__(self, limits: TransferLimits, items: Sequence[Item], progress: Progress):
        self.limits = limits
        self.items = items
        self.progress = progress
        self.total = sum(i.size for i in items)
        self.done = 0
        self.tally = Tally()
        self._lock = threading.Lock()
        self._failed = threading.Event()

    def chunks(self) -> list[tuple[int, int, int, int]]:
        """(item index, chunk index, offset, length) of every chunk."""
        out = []
        for n, item in enumerate(self.items):
            for c in range(checksum.chunk_count(item.size)):
                off = c * checksum.CHUNK_BYTES
                out.append((n, c, off, min(checksum.CHUNK_BYTES, item.size - off)))
        return out

    def finished(self, item: Item, length: int, sent: bool) -> None:
        with self._lock:
            self.done += length
            self.tally.add(length, sent, item.is_buffer)
            done = self.done
        self.progress(done, self.total)

    def run(self, job: Callable[[int, int, int, int], None]) -> None:
        def guarded(*args: int) -> None:
            if not self._failed.is_set():
                try:
                    job(*args)
                except BaseException:
                    self._failed.set()
                    raise

        with ThreadPoolExecutor(self.limits.threads, thread_name_prefix="gpusnap-remote") as pool:
            futures: list[Future[None]] = [pool.submit(guarded, *c) for c in self.chunks()]
            wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                f.cancel()
        for f in futures:
            if not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset``: a file system that fills up part-way returns a short count
    first (and ``ENOSPC`` for the rest), which a single ``pwrite`` would have left as a hole."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _pread(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    if len(data) != length:
        raise DataLossError(
            f"{path.name} ended early at byte {offset + len(data)} while being pushed", reason="IMAGE_CHECKSUM"
        )
    return data


def push_chunks(
    store: ObjectStore, limits: TransferLimits, items: Sequence[Item], digests: Sequence[str], progress: Progress
) -> tuple[list[tuple[str, ...]], Tally]:
    """Upload the chunks of ``items`` that the remote lacks; returns each item's chunk digests and a tally.

    ``digests[i]`` is the ``DIGEST_ALGORITHM`` digest the snapshot records for ``items[i]``: the chunks
    read must make it up, so a file damaged on this node is never published.

    Raises:
        DataLossError: a file no longer matches its digest (``IMAGE_CHECKSUM``).
        UnavailableError, PermissionDeniedError, FailedPreconditionError: from the object store.
    """
    r = _Run(limits, items, progress)
    found: list[list[bytes]] = [[b""] * checksum.chunk_count(i.size) for i in items]
    fresh = timedelta(seconds=limits.touch_after_s)
    claimed: set[str] = set()
    claimed_lock = threading.Lock()

    def job(n: int, c: int, off: int, length: int) -> None:
        item = items[n]
        data = _pread(item.path, off, length)
        digest = hashlib.sha256(data)
        found[n][c] = digest.digest()
        key = layout.chunk_key(digest.hexdigest())
        with claimed_lock:  # the same chunk twice in one push (zero pages, repeated weights) goes up once
            first = key not in claimed
            claimed.add(key)
        if not first:
            r.finished(item, length, sent=False)
            return
        info = store.head(key)
        if info is not None and info.size == length:
            if datetime.now(UTC) - info.modified > fresh:
                store.touch(key)  # garbage collection's grace period restarts: a manifest will need it
            r.finished(item, length, sent=False)
            return
        store.put(key, data)
        r.finished(item, length, sent=True)

    r.run(job)
    for item, chunks, want in zip(items, found, digests, strict=True):
        if checksum.combine(chunks) != want:
            raise DataLossError(
                f"{item.label} changed on this node since its capture (digest mismatch); it was not "
                "published: delete the snapshot and checkpoint again",
                reason="IMAGE_CHECKSUM",
            )
    return [tuple(c.hex() for c in chunks) for chunks in found], r.tally


def pull_chunks(
    store: ObjectStore,
    limits: TransferLimits,
    items: Sequence[Item],
    chunk_lists: Sequence[Sequence[str]],
    progress: Progress,
) -> Tally:
    """Download every chunk of ``items`` into its file (created or reused), each checked against its digest.

    Raises:
        DataLossError: a remote chunk is damaged or has the wrong size (``REMOTE_CHUNK_CORRUPT``, naming it).
        UnavailableError, PermissionDeniedError, NotFoundError: from the object store (a missing chunk is
            ``REMOTE_NOT_FOUND``).
    """
    r = _Run(limits, items, progress)
    fds: list[int] = []
    reused: list[bool] = []
    try:
        for item in items:
            item.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(item.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            fds.append(fd)
            reused.append(os.fstat(fd).st_size == item.size and item.size > 0)
            os.ftruncate(fd, item.size)

        def job(n: int, c: int, off: int, length: int) -> None:
            item, want = items[n], chunk_lists[n][c]
            if reused[n] and hashlib.sha256(os.pread(fds[n], length, off)).hexdigest() == want:
                r.finished(item, length, sent=False)
                return
            key = layout.chunk_key(want)
            data = store.get(key, 0, length + 1)  # one byte more shows an object too long, and bounds memory
            if len(data) != length or hashlib.sha256(data).hexdigest() != want:
                raise DataLossError(
                    f"remote chunk {key} ({item.label}, bytes {off}-{off + length - 1}) is damaged in "
                    f"{store.where()}: {len(data)} bytes that do not hash to its name; nothing was restored from it. "
                    "Push the snapshot again from a node that has it (the chunk is re-uploaded once deleted)",
                    reason="REMOTE_CHUNK_CORRUPT",
                    metadata={"chunk": want},
                )
            _pwrite_all(fds[n], data, off)
            r.finished(item, length, sent=True)

        r.run(job)
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return r.tally
