"""SnapshotStore: where snapshots are staged, published atomically, listed and deleted.

Layout under the store root (mode 0700: images hold process memory)::

    snapshots/<id>/manifest.json     published snapshots; a directory here is complete by construction
    snapshots/<id>/images/…          CRIU images (and, later, GPU data)
    snapshots/<id>/criu-*.log        CRIU logs of the dump and of restores
    staging/<id>/…                   work in progress; removed at start and on failure
    pulls/<id>/…                     a pull from the remote store in progress; kept across restarts so that
                                     a retry resumes it, removed once published, or after ``pull_grace_s``
                                     without a write (never listed)
    snapshots/<id>/provenance.json   pulled snapshots: where they were made (the compatibility gate reads it)
    logs/                            CRIU logs of failed dumps (the last 50)
    buffers/                         workers' named buffers, shared by snapshots (``buffers.BufferStore``;
                                     may live elsewhere)
    .lock                            flock: one daemon per store

A snapshot becomes visible by one ``rename(2)`` of its staging directory into ``snapshots/``
after every file, the manifest included, has been fsynced: a crash at any point leaves either
nothing or a complete snapshot (the pattern of Dynamo Snapshot's "final directory exists").
"""

from __future__ import annotations

import base64
import dataclasses
import fcntl
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import structlog

from gpusnap.daemon.api import validate
from gpusnap.daemon.api.errors import (
    AbortedError,
    AlreadyExistsError,
    DataLossError,
    FailedPreconditionError,
    NotFoundError,
)
from gpusnap.daemon.api.types import ImageFile, Snapshot
from gpusnap.daemon.executor import Executor
from gpusnap.daemon.store import checksum, imagecheck, listing, manifest
from gpusnap.daemon.store.buffers import BufferStore
from gpusnap.daemon.store.durable import fsync_dir, fsync_tree
from gpusnap.daemon.store.imagecheck import ImageCheck
from gpusnap.daemon.store.index import SnapshotIndex
from gpusnap.daemon.store.verified import Status, VerifiedOnce

log = structlog.get_logger(__name__)

IMAGES = "images"
PROVENANCE = "provenance.json"
IN_PLACE = "in-place"
"""In a snapshot's directory: a restore (or the source, left running at the dump) continues the files the tree
writes at its own position; every later restore writes copies of them (``operations.file_copies``)."""
DEV_SHM = "dev-shm"
"""In a snapshot's images: the tree's /dev/shm files (CRIU keeps only their names and sizes); each restore into
fresh namespaces gets a private copy."""


def restore_log_name(label: str) -> str:
    """CRIU's log of restore ``label`` (the operation id, ``-<i>`` for copy ``i`` of a fan-out), in the snapshot's
    directory."""
    return f"restore-{label}.log"


def _last_write(path: Path) -> float:
    """The newest modification time of ``path`` and everything under it (0 if it went meanwhile)."""
    try:
        newest = path.lstat().st_mtime
        for dirpath, dirs, names in os.walk(path):
            for n in (*dirs, *names):
                newest = max(newest, os.lstat(os.path.join(dirpath, n)).st_mtime)
    except FileNotFoundError:
        return 0.0
    return newest


def new_snapshot_id() -> str:
    """A fresh id: ``snap-`` + 26 lowercase base32 characters (128 random bits)."""
    return "snap-" + base64.b32encode(os.urandom(16)).decode().lower().rstrip("=")


@dataclasses.dataclass(frozen=True)
class StagingDir:
    """A snapshot being written; ``images`` is where CRIU dumps."""

    snapshot_id: str
    path: Path

    @property
    def images(self) -> Path:
        return self.path / IMAGES


class SnapshotStore:
    """Snapshots on local disk.

    Args:
        root: store directory; created (mode 0700) if missing.
        buffer_dir: the buffer store's directory (default ``root/buffers``); when set, its RAM tier above
            the disk tier ``root/buffers``.
        ram_tier_bytes, disk_tier_bytes: budgets of the buffer tiers (0: none; ``store.tiers``).
        pull_grace_s: an unfinished pull untouched this long is removed (:meth:`expire_pulls`).
        evictor: builds, for this store, ``BufferStore.evictor`` (whether a blob is safely in the remote store:
            ``remote.evict.RemoteEvictor``); None: no remote, nothing leaves the slowest tier.
        after_collect: ``BufferStore.after_collect`` (gpusnapd's prefill unregisters the files blobs left).
        rank: builds, for this store, ``BufferStore.rank`` (a blob's rank for eviction: the park ladder's
            ``park.ladder.blob_rank``); None: least recently used only.
        executor: gpusnapd's executor (``gpusnap.daemon.executor``): image digests on its ``digest`` lane,
            fsyncs on its ``fsync`` lane, and the buffer store's lanes.
    """

    def __init__(
        self,
        root: Path,
        buffer_dir: Path | None = None,
        ram_tier_bytes: int = 0,
        disk_tier_bytes: int = 0,
        pull_grace_s: float = 86400.0,
        *,
        evictor: Callable[[SnapshotStore], Callable[[str, int], bool]] | None = None,
        after_collect: Callable[[], None] | None = None,
        rank: Callable[[SnapshotStore], Callable[[str], int]] | None = None,
        executor: Executor,
    ):
        self.root = root
        self.executor = executor
        self.pull_grace_s = pull_grace_s
        self._pulls: set[str] = set()
        """Ids being pulled now (:meth:`pulling`)."""
        self.buffers = BufferStore(
            buffer_dir or root / "buffers",
            root / "buffers",
            ram_tier_bytes,
            disk_tier_bytes,
            evictor=evictor(self) if evictor is not None else None,
            after_collect=after_collect,
            rank=rank(self) if rank is not None else None,
            executor=executor,
        )
        self.snapshots_dir = root / "snapshots"
        self.staging_dir = root / "staging"
        self.pulls_dir = root / "pulls"
        self._lock = threading.Lock()
        self._pull_ended = threading.Condition(self._lock)
        self._reserved_names: dict[tuple[int, str], str] = {}
        """(owner uid, name) -> id of the snapshot being written under that name."""
        self._lock_fd: int | None = None
        self._index = SnapshotIndex()
        self.verified = VerifiedOnce(executor.digest)
        """Image files hashed once on a root-only RAM store (``store.verified``; enabled by :meth:`open`)."""

    def open(
        self,
        hold_buffers: Callable[[], tuple[Iterable[Path], Iterable[str]]] | None = None,
        busy_staging: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        """Create the layout, take the store lock and remove staging leftovers (``hold_buffers``: see
        :meth:`BufferStore.open`; ``busy_staging``: the staging directories a CRIU of a crashed daemon still
        writes into, kept for recovery to remove with :meth:`remove_staging`; both called once the lock is held).

        Raises:
            FailedPreconditionError: another daemon holds the store (reason ``STORE_LOCKED``).
        """
        try:
            for d in (self.root, self.snapshots_dir, self.staging_dir, self.pulls_dir):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)
            fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise FailedPreconditionError(
                f"cannot use {self.root} as the snapshot store ({exc.strerror}); give gpusnapd a writable --store",
                reason="STORE_UNUSABLE",
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FailedPreconditionError(
                f"snapshot store {self.root} is in use by another gpusnapd; stop it or use another --store",
                reason="STORE_LOCKED",
            ) from None
        self._lock_fd = fd
        self.verified.use_store(self.root)
        busy = set(busy_staging()) if busy_staging is not None else set()
        for leftover in self.staging_dir.iterdir():
            if leftover.name in busy:
                log.warning("store.staging_kept", path=str(leftover), why="a CRIU of an earlier gpusnapd writes it")
                continue
            log.warning("store.staging_removed", path=str(leftover))
            shutil.rmtree(leftover, ignore_errors=True)
        try:
            self.buffers.open(hold_buffers)
        except OSError as exc:
            raise FailedPreconditionError(
                f"cannot use {self.buffers.root} as the buffer store ({exc.strerror}); give gpusnapd a writable "
                "--buffer-dir",
                reason="STORE_UNUSABLE",
            ) from exc
        self._index.load(self.snapshots_dir)
        self.expire_pulls()
        self.collect_buffers()
        self.buffers.enforce_budgets()

    @property
    def instance(self) -> str:
        """Names the gpusnapd that serves this store, across its restarts (its restored trees' inits carry it):
        the first 12 hex digits of the SHA-256 of the store's path."""
        return hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:12]

    def remove_staging(self, snapshot_id: str) -> None:
        """Remove a staging directory :meth:`open` kept (its CRIU has ended)."""
        path = self.staging_dir / snapshot_id
        if path.parent == self.staging_dir and path.name == snapshot_id and snapshot_id not in ("", ".", ".."):
            log.warning("store.staging_removed", path=str(path))
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Release the store's locks."""
        self.buffers.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @contextmanager
    def stage(self, name: str = "", owner_uid: int = 0) -> Iterator[StagingDir]:
        """Create a staging directory (and reserve ``name``) for a new snapshot.

        The directory is removed when the block exits without :meth:`publish` having moved it.

        Raises:
            AlreadyExistsError: ``owner_uid`` has a snapshot ``name`` or is writing one (reason ``NAME_TAKEN``).
        """
        snapshot_id = new_snapshot_id()
        with self._lock:
            if name:
                self._check_name_free_locked(name, owner_uid)
                self._reserved_names[(owner_uid, name)] = snapshot_id
        staging = StagingDir(snapshot_id, self.staging_dir / snapshot_id)
        staging.images.mkdir(parents=True, mode=0o700)
        try:
            yield staging
        finally:
            with self._lock:
                if name and self._reserved_names.get((owner_uid, name)) == snapshot_id:
                    del self._reserved_names[(owner_uid, name)]
            if staging.path.exists():
                shutil.rmtree(staging.path, ignore_errors=True)

    def publish(self, staging: StagingDir, snapshot: Snapshot) -> Snapshot:
        """Write the manifest, fsync everything and rename the staging directory into place.

        ``snapshot.files`` must already describe ``staging.images`` (see :func:`checksum.image_files`).
        """
        self._make_durable(staging.path, snapshot)
        return self._rename_into_place(staging.path, snapshot)

    def _make_durable(self, directory: Path, snapshot: Snapshot) -> None:
        """Write the manifest into ``directory`` and fsync it, the images and their directories in one round."""
        manifest.write(directory, snapshot, sync=False)
        fsync_tree(directory, self.executor.fsync)

    def _rename_into_place(self, directory: Path, snapshot: Snapshot) -> Snapshot:
        """Rename the durable ``directory`` to ``snapshots/<id>`` (listed from then on) and index it."""
        os.rename(directory, self.snapshots_dir / snapshot.id)
        fsync_dir(self.snapshots_dir)
        self._index.add(snapshot)
        log.info("store.published", snapshot_id=snapshot.id, name=snapshot.name, bytes=snapshot.size_bytes)
        return snapshot

    def publish_pulled(self, directory: Path, snapshot: Snapshot, provenance: bytes) -> Snapshot:
        """Publish a pulled snapshot from ``directory`` (``images/`` complete and verified).

        Raises:
            AlreadyExistsError: the id is here already, or its name is taken (``NAME_TAKEN``).
        """
        (directory / PROVENANCE).write_bytes(provenance)
        # durable before the lock: its fsyncs queue on the shared fsync lane, and the lock holds up every
        # checkpoint's staging and every name check meanwhile
        self._make_durable(directory, snapshot)
        with self._lock:
            if (self.snapshots_dir / snapshot.id).exists():
                raise AlreadyExistsError(
                    f"snapshot {snapshot.id} is on this node already",
                    reason="SNAPSHOT_EXISTS",
                    metadata={"snapshot": snapshot.id},
                )
            if snapshot.name:
                self._check_name_free_locked(snapshot.name, snapshot.owner_uid)
            return self._rename_into_place(directory, snapshot)

    @contextmanager
    def pulling(self, work: str) -> Iterator[None]:
        """Hold ``work`` (a pull's snapshot id, or a restore's fetch directory ``<id>.fetch-…``) as in
        flight: :meth:`expire_pulls` leaves its directories alone.

        Raises:
            AbortedError: another operation is pulling that snapshot (``SNAPSHOT_BUSY``).
        """
        with self._lock:
            if work in self._pulls:
                raise AbortedError(
                    f"snapshot {work} is being pulled by another operation; wait for it (`gpusnap ops`)",
                    reason="SNAPSHOT_BUSY",
                    metadata={"snapshot": work},
                )
            self._pulls.add(work)
        try:
            yield
        finally:
            with self._pull_ended:
                self._pulls.discard(work)
                self._pull_ended.notify_all()

    def wait_pulled(self, work: str, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until no operation pulls ``work`` (:meth:`pulling`); True once none does."""
        with self._pull_ended:
            return self._pull_ended.wait_for(lambda: work not in self._pulls, timeout_s)

    def expire_pulls(self) -> list[str]:
        """Remove what unfinished pulls left (``pulls/<id>``, the buffer store's ``pulling/<id>``): at once
        when the snapshot is here already or nothing resumes it (a restore's fetch), after
        ``pull_grace_s`` without a write otherwise; never one in flight. Returns the removed names."""
        removed = []
        now = time.time()
        for leftover in [*self.pulls_dir.iterdir(), *self.buffers.pulling.iterdir()]:
            sid = leftover.name.partition(".")[0]
            with self._lock:
                if leftover.name in self._pulls:
                    continue
            done = (self.snapshots_dir / sid).exists() or leftover.name != sid
            if done or now - _last_write(leftover) > self.pull_grace_s:
                shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
                removed.append(leftover.name)
        if removed:
            log.info("store.pulls_expired", left=removed)
        return removed

    def unfinished_pulls(self) -> tuple[int, int]:
        """Pulls whose work is in the store (in flight, or left by one that failed), and its bytes."""
        found = [*listing.entries(self.pulls_dir), *listing.entries(self.buffers.pulling)]
        held = sum(listing.tree_bytes(d) for d in found)  # (a pull finishing or expiring removes its work)
        return len({d.name.partition(".")[0] for d in found}), held

    def provenance(self, snapshot_id: str) -> bytes | None:
        """The provenance record of a pulled snapshot, None for one made here."""
        try:
            return (self.snapshots_dir / snapshot_id / PROVENANCE).read_bytes()
        except FileNotFoundError:
            return None

    def list(self, label_selector: Mapping[str, str] | None = None, owner_uid: int | None = None) -> list[Snapshot]:
        """Complete snapshots (of ``owner_uid`` only, when given), oldest first, from the in-memory index;
        damaged ones are left out."""
        return self._index.list(owner_uid, label_selector or {})

    def get(self, ref: str, owner_uid: int = 0) -> Snapshot:
        """The snapshot with id or name ``ref``; a name is looked up among ``owner_uid``'s snapshots
        (``UID/NAME`` among UID's), see :func:`validate.snapshot_ref`.

        Raises:
            InvalidArgumentError: malformed ref.
            NotFoundError: no such snapshot (reason ``SNAPSHOT_NOT_FOUND``); also a damaged one asked for by
                a non-root ``owner_uid`` that is not known to be its owner.
            DataLossError: its manifest is damaged.
        """
        path = self.path_of(ref, owner_uid)
        try:
            return manifest.read(path)
        except DataLossError:
            owner = self._index.mark_damaged(path.name)  # no longer listed
            if owner_uid != 0 and owner != owner_uid:  # only root and its owner learn that it exists
                raise self.not_found(ref) from None
            raise

    def path_of(self, ref: str, owner_uid: int = 0) -> Path:
        """Directory of the snapshot with id or name ``ref`` (raises as :meth:`get`)."""
        validate.snapshot_ref(ref)
        if validate.SNAPSHOT_ID_RE.fullmatch(ref):
            path = self.snapshots_dir / ref
            if path.is_dir():
                return path
        else:
            uid, name = validate.split_snapshot_ref(ref, owner_uid)
            found = self._index.by_name(name, uid)
            if found is not None:
                return self.snapshots_dir / found.id
        raise self.not_found(ref)

    def not_found(self, ref: str) -> NotFoundError:
        """The error for a snapshot ``ref`` this store does not have (also given for one the caller may not see)."""
        return NotFoundError(
            f"no snapshot {validate.shown(ref)} in {self.root}; list snapshots with `gpusnap ls`",
            reason="SNAPSHOT_NOT_FOUND",
            metadata={"snapshot": ref},
        )

    def verify(
        self,
        snapshot: Snapshot,
        progress: checksum.Progress | None = None,
        later: Callable[[str], bool] = lambda _path: False,
    ) -> ImageCheck:
        """Check every image file against the manifest's sizes and digests (``store.imagecheck``): sizes and
        the digests of the files ``later`` does not pick (a path relative to the images directory) now
        (``progress``: bytes digested of those); files hashed once on a root-only RAM store are trusted
        (``store.verified``); the digests of the picked ones are computed in the background, and the returned
        check's ``wait`` raises for them.

        Raises:
            DataLossError: reason ``IMAGE_CHECKSUM``, naming the damaged files.
        """
        images = self.snapshots_dir / snapshot.id / IMAGES
        return imagecheck.start(snapshot, images, self.executor.digest, self.verified, later, progress)

    def describe_images(self, images_dir: Path, progress: checksum.Progress | None = None) -> tuple[ImageFile, ...]:
        """Every regular file under ``images_dir`` (sorted by path) with its size and digest, hashed on the
        ``digest`` lane (:func:`checksum.image_files`): what a staged snapshot's ``files`` must be (``progress``:
        bytes digested of all). On a root-only RAM store the files are remembered as verified
        (``store.verified``).

        Raises:
            OSError: a file cannot be read.
        """
        before = {p: Status.of(p) for p in images_dir.rglob("*") if p.is_file() and not p.is_symlink()}
        files = checksum.image_files(images_dir, self.executor.digest, progress)
        for f in files:
            path = images_dir / f.path
            if path in before:
                self.verified.remember(before[path], path, f.sha256)
        return files

    @staticmethod
    def raise_damaged(snapshot: Snapshot, bad: Sequence[str]) -> None:
        """Raise DataLossError (``IMAGE_CHECKSUM``) naming the damaged files in ``bad``, if any."""
        imagecheck.raise_damaged(snapshot, bad)

    def delete(self, ref: str, owner_uid: int = 0) -> str:
        """Delete a snapshot (damaged ones too); returns its id. Raises as :meth:`get`."""
        path = self.path_of(ref, owner_uid)
        # Rename first so a half-deleted snapshot is never listed.
        doomed = self.staging_dir / f"{path.name}.deleting"
        os.rename(path, doomed)
        self._index.discard(path.name)
        shutil.rmtree(doomed, ignore_errors=True)
        log.info("store.deleted", snapshot_id=path.name)
        self.collect_buffers()
        return path.name

    def collect_buffers(self) -> int:
        """Remove buffer blobs that no listed snapshot references (and no operation has pinned); returns
        the bytes freed. Damaged manifests keep nothing alive: their snapshots cannot be restored."""
        return self.buffers.collect_garbage(
            lambda: {self.buffers.key(s.buffer_uid, b.sha256) for s in self.list() for b in s.buffers}
        )

    def take_in_place(self, snapshot_id: str) -> bool:
        """Take the published snapshot's in-place claim (:data:`IN_PLACE`); ``False`` when it is taken."""
        try:
            fd = os.open(self.snapshots_dir / snapshot_id / IN_PLACE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
        os.close(fd)
        return True

    def images_dir(self, snapshot_id: str) -> Path:
        """The images directory of a published snapshot."""
        return self.snapshots_dir / snapshot_id / IMAGES

    def shm_dir(self, snapshot_id: str) -> Path:
        """A published snapshot's saved /dev/shm files (:data:`DEV_SHM`; absent when the tree held none)."""
        return self.images_dir(snapshot_id) / DEV_SHM

    def restore_scratch(self, label: str) -> Path:
        """Root's scratch directory of restore ``label`` (as :func:`restore_log_name`), under the staging area."""
        return self.staging_dir / f"restore-{label}"

    def restore_criu_dir(self, label: str) -> Path:
        """Where CRIU works for restore ``label`` when it needs a directory of its own (``CriuDriver.restore``'s
        ``criu_dir``), under the staging area: on the snapshots' file system, removed at start if left behind."""
        return self.staging_dir / f"restore-{label}.criu"

    def used_bytes(self, owner_uid: int | None = None) -> int:
        """Bytes used by published snapshots and the buffer store (each blob once); of ``owner_uid``'s
        snapshots and buffer blobs only, when given."""
        if owner_uid is None:
            dirs = [self.snapshots_dir]
        else:
            dirs = [self.snapshots_dir / s.id for s in self.list(owner_uid=owner_uid)]
        images = sum(listing.tree_bytes(d) for d in dirs)  # (an rm removes a snapshot meanwhile)
        return images + sum(t.used_bytes(owner_uid) for t in self.buffers.tiers)

    def check_name_free(self, name: str, owner_uid: int = 0) -> None:
        """Raise AlreadyExistsError (reason ``NAME_TAKEN``) if ``owner_uid`` uses ``name`` or is writing it."""
        with self._lock:
            self._check_name_free_locked(name, owner_uid)

    def _check_name_free_locked(self, name: str, owner_uid: int) -> None:
        if (owner_uid, name) in self._reserved_names or self._index.by_name(name, owner_uid) is not None:
            raise AlreadyExistsError(
                f"a snapshot named {name!r} already exists; choose another name or delete it with `gpusnap rm {name}`",
                reason="NAME_TAKEN",
                metadata={"name": name},
            )
