"""The remote store below the disk tier: blobs safely there leave this node, and come back when used.

A snapshot pushed to (or pulled from) the remote store gets a record beside its manifest,
``snapshots/<id>/remote.json``: the remote's URL and the chunk digests each of its buffers' blobs is
stored as there::

    {"remote": "s3://BUCKET/PREFIX", "buffers": {blob digest: [chunk sha256, …]}}

When the disk tier is over its budget (``disk_tier_bytes``), ``BufferStore.enforce_budgets`` offers its
least recently used unpinned blobs to :class:`RemoteEvictor` one by one. A blob goes only if a snapshot of
this node references it and was recorded for the configured remote, and, checked at that moment, the
snapshot's manifest is still published there (so the remote's garbage collection keeps its chunks) and
every chunk of the blob is there with its size. Everything else stays: blobs in use (pinned), blobs never
pushed, blobs whose chunks are missing, and all blobs while the remote cannot be reached.

A restore that finds blobs missing fetches them back first (:func:`fetch`, the restore's
``fetch-buffers`` phase): chunk lists from the record (they must make up the blob's digest), each chunk
checked against its SHA-256 as it arrives (``transfer.pull_chunks``), then adopted into the fastest tier.
Deleting the remote snapshot (``gpusnap rm --remote``) while a node relies on it for an evicted blob
loses that blob once the remote's grace period has passed: the restore then fails ``REMOTE_NOT_FOUND``
naming the chunk (docs/fleet.md, "Disk tier").

Its reads run on a pool of their own per call (``threads`` workers), for the reason ``remote.transfer``'s
module docstring gives.
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog

from gpusnap.daemon.api.errors import FailedPreconditionError, GpusnapError
from gpusnap.daemon.api.types import BufferRef, Snapshot
from gpusnap.daemon.remote import layout
from gpusnap.daemon.remote.store import RemoteStore
from gpusnap.daemon.remote.transfer import Item, Progress, Tally, pull_chunks
from gpusnap.daemon.store import checksum, documents
from gpusnap.daemon.store.documents import DocumentError
from gpusnap.daemon.store.store import SnapshotStore

log = structlog.get_logger(__name__)

RECORD = "remote.json"


@dataclasses.dataclass(frozen=True)
class Record:
    """``snapshots/<id>/remote.json`` (``gpusnap.daemon.store.documents``): the remote it is published in, and
    each buffer blob's chunk digests there."""

    remote: str
    buffers: dict[str, tuple[str, ...]]
    schema_version: int = 1


def write_record(snapshot_dir: Path, remote: str, buffers: Mapping[str, Sequence[str]]) -> None:
    """Record (durably, atomically) that the snapshot in ``snapshot_dir`` is published in ``remote``."""
    documents.save(snapshot_dir / RECORD, Record(remote, {d: tuple(c) for d, c in buffers.items()}))


def read_record(snapshot_dir: Path) -> Record | None:
    """The snapshot's record, or None when it has none or it is unreadable (then nothing is evicted)."""
    try:
        return documents.load(snapshot_dir / RECORD, Record)
    except FileNotFoundError:
        return None
    except (OSError, DocumentError) as exc:
        log.warning("remote.record_unreadable", path=str(snapshot_dir / RECORD), error=str(exc))
        return None


def _chunks_in(record: Record, ref: BufferRef) -> tuple[str, ...] | None:
    """The chunk digests ``record`` gives blob ``ref``, if they make up its digest."""
    chunks = record.buffers.get(ref.sha256)
    if (
        chunks is None
        or len(chunks) != checksum.chunk_count(ref.size_bytes)
        or not all(layout.HEX64.fullmatch(c) for c in chunks)
        or checksum.combine([bytes.fromhex(c) for c in chunks]) != ref.sha256
    ):
        return None
    return chunks


def sources(
    store: SnapshotStore, uid: int, ref: BufferRef, first: Snapshot | None = None
) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """(snapshot id, remote, chunk digests) for each record of this node's snapshots that holds blob
    ``ref`` of ``uid`` (``first``'s record first): a blob shared by snapshots is in the remote store if
    any of them was pushed there."""
    snaps = [first] if first is not None else []
    snaps += [s for s in store.list() if first is None or s.id != first.id]
    for snap in snaps:
        if snap.buffer_uid != uid or all(
            b.sha256 != ref.sha256 or b.size_bytes != ref.size_bytes for b in snap.buffers
        ):
            continue
        record = read_record(store.snapshots_dir / snap.id)
        chunks = _chunks_in(record, ref) if record is not None else None
        if record is not None and chunks is not None:
            yield snap.id, record.remote, chunks


def _chunk_sizes(size: int) -> list[int]:
    return [min(checksum.CHUNK_BYTES, size - i * checksum.CHUNK_BYTES) for i in range(checksum.chunk_count(size))]


class RemoteEvictor:
    """``BufferStore.evictor``: whether a disk-tier blob is safely in the remote store (module docstring)."""

    def __init__(self, store: SnapshotStore, remote: RemoteStore):
        self.store = store
        self.remote = remote

    def __call__(self, key: str, size: int) -> bool:
        uid, _, digest = key.partition("/")
        ref = BufferRef(name="", size_bytes=size, sha256=digest)
        here = str(self.remote)
        return any(
            self._published(sid, chunks, size)
            for sid, remote, chunks in sources(self.store, int(uid), ref)
            if remote == here
        )

    def _published(self, snapshot_id: str, chunks: Sequence[str], size: int) -> bool:
        objects = self.remote.objects
        try:
            if not self.remote.published(snapshot_id):
                return False

            def there(chunk: tuple[str, int]) -> bool:
                info = objects.head(layout.chunk_key(chunk[0]))
                return info is not None and info.size == chunk[1]

            with ThreadPoolExecutor(self.remote.limits.threads, thread_name_prefix="gpusnap-evict") as pool:
                return all(pool.map(there, zip(chunks, _chunk_sizes(size), strict=True)))
        except GpusnapError as exc:
            log.warning("buffers.remote_check_failed", snapshot_id=snapshot_id, error=exc.message)
            return False


def remote_only(store: SnapshotStore, remote: RemoteStore | None, owner_uid: int | None = None) -> tuple[int, int]:
    """(bytes, blobs) that this node's snapshots (``owner_uid``'s only, when given) reference and that only
    the remote store holds."""
    found: dict[str, int] = {}
    for snap in store.list(owner_uid=owner_uid) if remote is not None else ():
        for ref in store.buffers.missing(snap.buffer_uid, snap.buffers).values():
            key = store.buffers.key(snap.buffer_uid, ref.sha256)
            if key not in found and any(r == str(remote) for _, r, _ in sources(store, snap.buffer_uid, ref, snap)):
                found[key] = ref.size_bytes
    return sum(found.values()), len(found)


@dataclasses.dataclass(frozen=True)
class Refetch:
    """Blobs a restore or push must fetch back: each with its chunk digests."""

    snapshot: Snapshot
    refs: tuple[BufferRef, ...]
    chunks: tuple[tuple[str, ...], ...]


def plan(store: SnapshotStore, remote: RemoteStore | None, snapshot: Snapshot) -> Refetch | None:
    """What a restore of ``snapshot`` must fetch from the remote store; None when nothing is missing, or
    when a missing blob is not recorded in the remote store (``BufferStore.check_present`` then refuses).

    Raises:
        FailedPreconditionError: missing blobs are in a remote store, but none or another is configured
            (``REMOTE_NOT_CONFIGURED``).
    """
    missing = store.buffers.missing(snapshot.buffer_uid, snapshot.buffers)
    if not missing:
        return None
    refs = tuple(missing.values())
    chunks = []
    for ref in refs:
        held = list(sources(store, snapshot.buffer_uid, ref, snapshot))
        usable = [c for _, r, c in held if remote is not None and r == str(remote)]
        if usable:
            chunks.append(usable[0])
        elif held:
            raise FailedPreconditionError(
                f"snapshot {snapshot.id} needs buffer {ref.name!r}, which only the remote store {held[0][1]} holds "
                f"(evicted from the disk tier); start gpusnapd with --remote {held[0][1]} to fetch it back",
                reason="REMOTE_NOT_CONFIGURED",
                metadata={"snapshot": snapshot.id},
            )
        else:
            return None
    return Refetch(snapshot, refs, tuple(chunks))


def fetch(store: SnapshotStore, remote: RemoteStore, todo: Refetch, progress: Progress) -> Tally:
    """Download the blobs of ``todo`` (each chunk checked as it arrives) and adopt them into the buffer store.

    Raises:
        DataLossError: a damaged remote chunk (``REMOTE_CHUNK_CORRUPT``). NotFoundError: a chunk is gone
            (``REMOTE_NOT_FOUND``). UnavailableError, PermissionDeniedError: from the object store.
    """
    uid = todo.snapshot.buffer_uid
    work = store.buffers.pulling / f"{todo.snapshot.id}.fetch-{secrets.token_hex(4)}"
    items = [Item(f"buffer {r.name}", work / r.sha256, r.size_bytes, is_buffer=True) for r in todo.refs]
    with store.pulling(work.name):
        try:
            tally = pull_chunks(remote.objects, remote.limits, items, todo.chunks, progress)
            store.buffers.adopt_pulled(work, uid, [r.sha256 for r in todo.refs])
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.info("buffers.fetched", snapshot_id=todo.snapshot.id, blobs=len(todo.refs), bytes=tally.transferred_bytes)
    return tally
