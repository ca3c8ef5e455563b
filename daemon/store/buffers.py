"""BufferStore: content-addressed files holding workers' named buffers (weights), shared by snapshots.

Layout under its root (default ``<store>/buffers``; ``--buffer-dir`` puts it elsewhere, e.g. on tmpfs
for a RAM tier, and ``<store>/buffers`` becomes the disk tier below it: ``gpusnap.daemon.store.tiers``;
mode 0700)::

    sha256/<uid>/<digest>   one buffer's bytes, mode 0400, named by its digest (``checksum.DIGEST_ALGORITHM``),
                            under the uid of the worker that wrote it
    incoming/<random>       being written by a worker; removed when its operation ends, and at start
                            unless a crashed capture's journal entry names it (recovery hands it back)
    pulling/<id>/<digest>   being downloaded by a pull of snapshot <id>; kept across restarts (a retried
                            pull resumes), moved into sha256/ when the pull publishes

A capture stages one file per buffer; the worker writes each buffer into a sealed memfd that gpusnapd
copies into that file (``gpusnap.daemon.store.sealed``, ``agent.proto``), so the worker never holds a
descriptor of the store's files. The daemon then digests the files itself and commits them:
a digest already present is kept and the new copy dropped, so identical weights are stored once, however
many snapshots use them. Blobs no snapshot references are removed by :meth:`BufferStore.collect_garbage`;
digests of operations still in flight are pinned against that.

Blobs are shared only between snapshots of workers of the same user: one user's capture never decides
what another user's restore reads. Restores check blob sizes, and re-digest blobs only on request
(``--verify-buffers``), which keeps gigabytes of hashing off the restore path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, wait
from pathlib import Path

import structlog

from gpusnap.daemon.api.errors import DataLossError, FailedPreconditionError, ResourceExhaustedError
from gpusnap.daemon.api.types import BufferRef
from gpusnap.daemon.executor import Executor, check_wait
from gpusnap.daemon.store import checksum, listing, sealed
from gpusnap.daemon.store.durable import fsync_dir
from gpusnap.daemon.store.tiers import Tier, eviction_order, mark_used, move

log = structlog.get_logger(__name__)

COPY_CHUNK_BYTES = 64 << 20
"""Bytes of a worker's memfd copied into gpusnapd's file per job on the store's pool."""


class StagedBuffers:
    """Files a worker's buffers are staged in, in one capture; owns their descriptors until :meth:`close`.

    The worker never gets a descriptor of these files: it writes each buffer into a sealed memfd of the
    announced size (:meth:`memfds`, ``gpusnap.daemon.store.sealed``), which :meth:`copy_in` copies into its
    file on the store's pool. The descriptors stay open after :meth:`commit`, so a capture that fails later
    can still hand the worker its buffers back (:meth:`read_fds`).
    """

    def __init__(self, store: BufferStore, uid: int, names: Sequence[str], sizes: Sequence[int], tier: Tier):
        self.store = store
        self.uid = uid
        self.names = list(names)
        self.sizes = list(sizes)
        self.tier = tier
        self.paths = [tier.incoming / f"{secrets.token_hex(8)}" for _ in self.names]
        self.fds: list[int] = []
        """gpusnapd's own read-write descriptors of the staged files."""
        self._memfds: dict[int, int] = {}
        """Buffer index -> the sealed memfd the worker writes it into, until its copy is done."""
        self._copies: list[Future[None]] = []
        self._copying: set[int] = set()
        self._lock = threading.Lock()
        self._digests: Future[list[str]] | None = None
        self.refs: list[BufferRef] = []
        try:
            for path in self.paths:
                self.fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        except OSError:
            self.close()
            raise

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def memfds(self, indices: Iterable[int]) -> list[int]:
        """The sealed memfds the worker writes buffers ``indices`` into (made on first use; this object keeps
        them, :meth:`copy_in` copies and closes them).

        Raises:
            OSError: out of descriptors.
        """
        out = []
        for i in indices:
            if i not in self._memfds:
                self._memfds[i] = sealed.create(self.sizes[i], f"gpusnap-buffer-{i}")
            out.append(self._memfds[i])
        return out

    def copy_in(self, indices: Iterable[int]) -> list[Future[None]]:
        """Start copying the memfds of buffers ``indices`` (written by the worker) into their staged files,
        ``COPY_CHUNK_BYTES`` at a time on the store's pool; each memfd is closed once its copy is done.
        Returns the copies started (:meth:`wait_copies` waits for all of them)."""
        started: list[Future[None]] = []
        for i in indices:
            if i not in self._memfds or i in self._copying:
                continue
            self._copying.add(i)
            chunks = [
                (off, min(COPY_CHUNK_BYTES, self.sizes[i] - off)) for off in range(0, self.sizes[i], COPY_CHUNK_BYTES)
            ]
            left = [len(chunks)]

            def done(_: Future[None], i: int = i, left: list[int] = left) -> None:
                with self._lock:
                    left[0] -= 1
                    fd = self._memfds.pop(i, None) if left[0] == 0 else None
                if fd is not None:
                    os.close(fd)

            for off, length in chunks:
                future = self.store.pool.submit(self._copy_chunk, i, off, length)
                self._copies.append(future)
                started.append(future)
                future.add_done_callback(done)
        return started

    def _copy_chunk(self, i: int, offset: int, length: int) -> None:
        dst = os.open(self.paths[i], os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            sealed.copy_chunk(self._memfds[i], dst, offset, length)
        finally:
            os.close(dst)

    def wait_copies(self) -> None:
        """Wait for every copy :meth:`copy_in` started; copy the memfds not handed to it yet first (the
        buffers are then in gpusnapd's files alone).

        Raises:
            OSError: a copy failed (``ENOSPC``: the store's file system is full).
        """
        self.copy_in(list(self._memfds))
        copies, self._copies = self._copies, []
        for future in copies:
            future.result()

    def start_digests(self) -> None:
        """Wait for the copies (:meth:`wait_copies`) and start digesting the staged files on the store's pool
        (see :meth:`commit`)."""
        self.wait_copies()
        self._digests = self.store.jobs.submit(checksum.file_digests, self.paths, self.store.pool)

    def digests(self) -> list[str]:
        """The files' digests, in the order of :attr:`names` (waits for them; see :meth:`start_digests`)."""
        if self._digests is None:
            self.start_digests()
        assert self._digests is not None
        return self._digests.result()

    def commit(self) -> list[BufferRef]:
        """Wait for the digests and move each file to ``sha256/<uid>/<digest>`` (or drop it if that
        exists), fsynced; the digests stay pinned until :meth:`close`. Returns the snapshot's references."""
        digests = self.digests()
        refs = [
            BufferRef(name=n, size_bytes=s, sha256=d) for n, s, d in zip(self.names, self.sizes, digests, strict=True)
        ]
        self.store.pin(self.uid, digests)
        self.refs = refs
        for path, fd, digest in zip(self.paths, self.fds, digests, strict=True):
            self.store.adopt(path, fd, self.uid, digest, self.tier)
        fsync_dir(self.tier.blobs / str(self.uid))
        fsync_dir(self.tier.blobs)
        return refs

    def read_fds(self) -> list[int]:
        """Fresh read-only descriptors of the written files (to hand the buffers back to the worker)."""
        return [os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC) for fd in self.fds]

    def close(self) -> None:
        """Stop the copies, close the descriptors, remove what was not committed, and unpin the committed
        digests."""
        copies, self._copies = self._copies, []
        for future in copies:
            future.cancel()
        check_wait(self.store.pool)
        wait(copies)  # a running copy still uses its memfd and file
        with self._lock:
            memfds, self._memfds = self._memfds, {}
        for fd in [*memfds.values(), *self.fds]:
            os.close(fd)
        self.fds = []
        for path in self.paths:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        self.store.unpin(self.uid, [r.sha256 for r in self.refs])
        if self.refs:
            self.store.schedule_budgets()  # spill to slower tiers off the capture's path
        self.refs = []


class HeldFiles:
    """Buffers a crashed capture had staged or committed, found again from its journal entry: ``names[i]``
    is in file ``paths[i]``. Gives read-only descriptors as :meth:`StagedBuffers.read_fds` does."""

    def __init__(self, names: Sequence[str], paths: Sequence[Path]):
        self.names = list(names)
        self.paths = list(paths)

    def read_fds(self) -> list[int]:
        fds: list[int] = []
        try:
            for path in self.paths:
                fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        return fds


class BufferStore:
    """Content-addressed buffer files under ``root`` (see the module docstring).

    Args:
        root, disk: the fastest tier's directory and, when another, the disk tier's (``store.tiers``).
        ram_budget_bytes, disk_budget_bytes: the tiers' budgets in bytes (0: none).
        evictor: says whether blob ``<uid>/<digest>`` of ``size`` bytes is safely in the remote store, so the
            slowest tier may drop it (``gpusnap.daemon.remote.evict``); None: no remote, nothing leaves.
        after_collect: called after a garbage collection removed blobs or a budget pass moved them out of a
            tier (gpusnapd's prefill then unregisters their unlinked files, whose pages a registration pins).
        rank: a blob's rank for eviction (``<uid>/<digest>`` → the highest park priority of the snapshots
            using it): lower ranks leave a tier first, least recently used first within a rank. None: LRU only.
        executor: gpusnapd's executor: copies and chunk digests run on its ``buffer_io`` lane, the jobs that
            wait for them (digest jobs, read-aheads, verifies, budget passes) on its ``buffer_jobs`` lane.
    """

    def __init__(
        self,
        root: Path,
        disk: Path | None = None,
        ram_budget_bytes: int = 0,
        disk_budget_bytes: int = 0,
        *,
        evictor: Callable[[str, int], bool] | None = None,
        after_collect: Callable[[], None] | None = None,
        rank: Callable[[str], int] | None = None,
        executor: Executor,
    ):
        self.root = root
        self.tiers = (
            [Tier("ram", root, ram_budget_bytes), Tier("disk", disk, disk_budget_bytes)]
            if disk is not None and disk != root
            else [Tier("disk", root, disk_budget_bytes)]
        )
        """Fastest first (``gpusnap.daemon.store.tiers``)."""
        self.blobs = root / "sha256"
        self.incoming = root / "incoming"
        self.pulling = root / "pulling"
        self.pool = executor.buffer_io
        """Copies and hashes chunks; ``jobs`` waits for them (never the other way round, so neither can starve)."""
        self.jobs = executor.buffer_jobs
        self._lock = threading.Lock()
        self._pins: dict[str, int] = {}
        self._lock_fd: int | None = None
        self.evictor = evictor
        self._held: tuple[set[Path], set[str]] = (set(), set())
        self.rank = rank
        self.after_collect = after_collect

    def release_held(
        self,
        keep: tuple[Iterable[Path], Iterable[str]] = ((), ()),
        only: tuple[Iterable[Path], Iterable[str]] | None = None,
    ) -> None:
        """Remove the staged files :meth:`open` kept and unpin the blobs it pinned (recovery is done with them),
        but those in ``keep`` (a capture recovery finishes later), or only those in ``only``."""
        held_paths, held_keys = self._held
        if only is not None:
            paths, keys = held_paths & set(only[0]), held_keys & set(only[1])
        else:
            paths, keys = held_paths - set(keep[0]), held_keys - set(keep[1])
        self._held = (held_paths - paths, held_keys - keys)
        for path in paths:
            path.unlink(missing_ok=True)
        self._unpin_keys(keys)

    def close(self) -> None:
        """Release the buffer store's lock."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def open(self, hold: Callable[[], tuple[Iterable[Path], Iterable[str]]] | None = None) -> None:
        """Create the layout, take the buffer store's lock and remove files left in ``incoming``.

        Args:
            hold: called once the lock is held; returns staged files to keep in ``incoming`` and blob keys
                (:meth:`key`) to pin, for recovery to hand back to a worker; :meth:`release_held` ends that.

        Raises:
            FailedPreconditionError: another daemon uses this directory (``STORE_LOCKED``): its garbage
                collection would delete the other daemon's blobs.
            OSError: the directory cannot be created or written.
        """
        for d in (self.pulling, *(p for t in self.tiers for p in (t.root, t.blobs, t.incoming))):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        for t in self.tiers:
            os.chmod(t.root, 0o700)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FailedPreconditionError(
                f"buffer store {self.root} is in use by another gpusnapd; give each daemon its own --buffer-dir",
                reason="STORE_LOCKED",
            ) from None
        self._lock_fd = fd
        if hold is not None:
            paths, keys = hold()
            self._held = ({Path(p) for p in paths}, set(keys))
            self._pin_keys(self._held[1])
        for leftover in (p for t in self.tiers for p in t.incoming.iterdir() if p not in self._held[0]):
            log.warning("buffers.incoming_removed", path=str(leftover))
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)

    def stage(self, uid: int, names: Sequence[str], sizes: Sequence[int]) -> StagedBuffers:
        """Staged files for the buffers of a worker of user ``uid``, after checking the store has room.

        Raises:
            ResourceExhaustedError: fewer free bytes than the buffers need (``BUFFER_STORE_FULL``), or more
                bytes than every tier's budget (``BUFFER_BUDGET``).
        """
        need = sum(sizes)
        for tier in self.tiers:
            if tier.room_for(need):
                return StagedBuffers(self, uid, names, sizes, tier)
        if all(t.budget_bytes and need > t.budget_bytes for t in self.tiers):
            shown = ", ".join(f"{t.name} {t.budget_bytes / 2**20:.0f} MiB" for t in self.tiers)
            raise ResourceExhaustedError(
                f"the worker's buffers need {need / 2**20:.0f} MiB, more than every buffer tier's budget ({shown}); "
                "raise ram_tier_bytes or disk_tier_bytes, or checkpoint without offload (--no-offload)",
                reason="BUFFER_BUDGET",
            )
        free = max(t.free_bytes() for t in self.tiers)
        raise ResourceExhaustedError(
            f"the worker's buffers need {need / 2**30:.1f} GiB but the buffer store {self.root} has "
            f"{free / 2**30:.1f} GiB free; delete snapshots (`gpusnap rm`), give gpusnapd a larger --buffer-dir, "
            "or checkpoint without offload (--no-offload)",
            reason="BUFFER_STORE_FULL",
        )

    @staticmethod
    def key(uid: int, digest: str) -> str:
        """A blob's identity in the store: ``<uid>/<digest>``."""
        return f"{uid}/{digest}"

    def path(self, uid: int, digest: str) -> Path:
        """Where blob ``digest`` of ``uid`` is read: the fastest tier holding it (else where the fastest
        tier would hold it)."""
        key = self.key(uid, digest)
        for tier in self.tiers:
            if (tier.blobs / key).exists():
                return tier.blobs / key
        return self.tiers[0].blobs / key

    def in_ram_tier(self, path: Path) -> bool:
        """Whether ``path`` (a blob's, from :meth:`path`) lies in the RAM tier (False without one)."""
        return any(path.is_relative_to(t.blobs) for t in self.tiers if t.name == "ram")

    def adopt(self, path: Path, fd: int, uid: int, digest: str, tier: Tier | None = None) -> None:
        """Make the staged file ``path`` the blob ``digest`` of ``uid`` in ``tier`` (default: the fastest)
        unless that blob exists already in some tier."""
        target = (tier or self.tiers[0]).blobs / self.key(uid, digest)
        os.fsync(fd)
        os.fchmod(fd, 0o400)
        with self._lock:  # the garbage collector removes empty user directories
            if self.path(uid, digest).exists():
                path.unlink()
                return
            target.parent.mkdir(mode=0o700, exist_ok=True)
            os.rename(path, target)

    def pin(self, uid: int, digests: Iterable[str]) -> None:
        """Protect blobs from garbage collection while an operation uses them."""
        self._pin_keys(self.key(uid, d) for d in digests)

    def unpin(self, uid: int, digests: Iterable[str]) -> None:
        self._unpin_keys(self.key(uid, d) for d in digests)

    def _pin_keys(self, keys: Iterable[str]) -> None:
        with self._lock:
            for k in keys:
                self._pins[k] = self._pins.get(k, 0) + 1

    def _unpin_keys(self, keys: Iterable[str]) -> None:
        with self._lock:
            for k in keys:
                left = self._pins.get(k, 0) - 1
                if left > 0:
                    self._pins[k] = left
                else:
                    self._pins.pop(k, None)

    def check_present(self, snapshot_id: str, uid: int, refs: Sequence[BufferRef]) -> None:
        """Raise DataLossError (``BUFFER_MISSING``) if a referenced blob is gone or has the wrong size."""
        for ref in refs:
            try:
                size = self.path(uid, ref.sha256).stat().st_size
            except FileNotFoundError:
                size = -1
            if size != ref.size_bytes:
                raise DataLossError(
                    f"snapshot {snapshot_id} needs buffer {ref.name!r} (blob {ref.sha256[:12]}…, {ref.size_bytes} bytes), "
                    f"which {'is missing from' if size < 0 else 'has the wrong size in'} {self.blobs} (a RAM --buffer-dir "
                    "lost at reboot?); delete the snapshot and checkpoint again",
                    reason="BUFFER_MISSING",
                    metadata={"snapshot": snapshot_id, "buffer": ref.name, "sha256": ref.sha256},
                )

    def missing(self, uid: int, refs: Sequence[BufferRef]) -> dict[str, BufferRef]:
        """The referenced blobs no tier holds with their size, by digest (each once)."""
        out: dict[str, BufferRef] = {}
        for ref in refs:
            path = self.path(uid, ref.sha256)
            if ref.sha256 not in out and not (path.exists() and path.stat().st_size == ref.size_bytes):
                out[ref.sha256] = ref
        return out

    def adopt_pulled(self, work: Path, uid: int, digests: Iterable[str]) -> None:
        """Adopt the verified files ``work/<digest>`` (a pull's or a fetch's) as blobs of ``uid``, fsynced."""
        adopted = False
        for d in digests:
            path = work / d
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                self.adopt(path, fd, uid, d)
            finally:
                os.close(fd)
            adopted = True
        if adopted:
            fsync_dir(self.blobs / str(uid))

    def prefetch(self, uid: int, refs: Sequence[BufferRef]) -> Future[int]:
        """Start reading the referenced blobs that are not in the RAM tier into the page cache, in the
        background (``posix_fadvise(POSIX_FADV_WILLNEED)``: the kernel's readahead), so a restore's reload
        reads them from memory once CRIU and the CUDA restore are done. Blobs on a tmpfs gain nothing and
        are skipped when the store has a RAM tier; a blob that cannot be opened is left to the reload, which
        reports it.

        Returns:
            A future of the bytes asked for.
        """
        slow = [p for p in (self.path(uid, r.sha256) for r in refs) if not self.in_ram_tier(p)]

        def run() -> int:
            asked = 0
            for path in slow:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                    asked += os.fstat(fd).st_size
                except OSError:
                    pass
                finally:
                    os.close(fd)
            return asked

        return self.jobs.submit(run)

    def open_for_read(self, uid: int, refs: Sequence[BufferRef]) -> list[int]:
        """Read-only descriptors of the referenced blobs (the caller closes them)."""
        fds: list[int] = []
        try:
            for ref in refs:
                path = self.path(uid, ref.sha256)
                fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
                mark_used(path)
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def start_verify(self, uid: int, refs: Sequence[BufferRef]) -> Future[list[str]]:
        """Digest the referenced blobs on the store's pool; the future yields one line per damaged blob."""

        def run() -> list[str]:
            digests = checksum.file_digests([self.path(uid, r.sha256) for r in refs], self.pool)
            return [f"buffer {r.name}: checksum mismatch" for r, d in zip(refs, digests, strict=True) if d != r.sha256]

        return self.jobs.submit(run)

    def collect_garbage(self, referenced: Callable[[], set[str]]) -> int:
        """Remove blobs whose :meth:`key` neither ``referenced()`` (called under the store's lock, so a
        capture cannot publish and unpin in between) nor an in-flight operation names; returns the bytes
        freed."""
        freed = 0
        with self._lock:
            keep = referenced() | set(self._pins)
            for tier in self.tiers:
                for key, blob, st in list(tier.blob_stats()):
                    if key not in keep:  # (an eviction may move it meanwhile: it is then gone here)
                        freed += st.st_size
                        blob.unlink(missing_ok=True)
                for user_dir in listing.entries(tier.blobs):
                    if not listing.entries(user_dir):
                        with contextlib.suppress(OSError):  # gone meanwhile, or an eviction moved a blob in
                            user_dir.rmdir()
        if freed:
            log.info("buffers.collected", bytes=freed)
            if self.after_collect is not None:
                self.after_collect()
        return freed

    def used_bytes(self) -> int:
        return sum(t.used_bytes() for t in self.tiers)

    def schedule_budgets(self) -> None:
        """Run :meth:`enforce_budgets` in the background (after a capture or pull added blobs)."""
        self.jobs.submit(self.enforce_budgets)

    def enforce_budgets(self) -> int:
        """Move least recently used, unpinned blobs of each tier over its budget to the next tier, and
        drop those of the slowest tier over its budget that :attr:`evictor` finds safely in the remote
        store; returns the bytes moved or dropped. Without a remote store the slowest tier's budget is
        enforced at staging only (its blobs have nowhere safer to go)."""
        moved = 0
        for tier, slower in zip(self.tiers, self.tiers[1:], strict=False):
            moved += self._drain(tier, slower.name, functools.partial(self._move_to, slower), "pinned by operations")
        evictor = self.evictor
        if evictor is not None:
            moved += self._drain(
                self.tiers[-1],
                "remote",
                lambda key, path, size: evictor(key, size) and self._drop_unpinned(key, path),
                "pinned, not yet pushed, or not found whole in the remote store",
            )
        if moved and self.after_collect is not None:
            self.after_collect()
        return moved

    def _drain(self, tier: Tier, dst: str, drop: Callable[[str, Path, int], bool], kept: str) -> int:
        """Offer ``tier``'s least recently used unpinned blobs to ``drop`` (True: gone from ``tier``) until
        it is within its budget; returns the bytes gone."""
        used = tier.used_bytes()
        if not tier.budget_bytes or used <= tier.budget_bytes:
            return 0
        gone = 0
        with self._lock:
            pinned = set(self._pins)
        for key, path, size in eviction_order(tier, pinned, self.rank):
            if used <= tier.budget_bytes:
                break
            if drop(key, path, size):
                used -= size
                gone += size
                log.info("buffers.evicted", blob=key, bytes=size, src=tier.name, dst=dst)
        if used > tier.budget_bytes:
            log.warning(
                "buffers.over_budget", tier=tier.name, used=used, budget=tier.budget_bytes, why=f"the rest is {kept}"
            )
        return gone

    def _move_to(self, dst: Tier, key: str, path: Path, _size: int) -> bool:
        return move(key, path, dst, guard=self._lock)  # (the collector removes empty user directories under it)

    def _drop_unpinned(self, key: str, path: Path) -> bool:
        with self._lock:  # pinned since the order was taken: an operation is about to read it
            if key in self._pins:
                return False
            path.unlink(missing_ok=True)
        return True
