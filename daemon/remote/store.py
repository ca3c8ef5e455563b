"""RemoteStore: published snapshots in the remote store, found, published atomically and collected.

A snapshot is published by one conditional put of its manifest (``If-None-Match: *``) after all its
chunks are up: a reader sees either no manifest or one whose chunks all exist. Deleting removes the
manifest; :meth:`RemoteStore.collect_garbage` then marks the chunks every remaining manifest references
and deletes the others, but only those older than the grace period, so the chunks of a push still in
flight (uploaded, manifest not yet put) survive it. A push renews the modification time of the old
chunks it reuses (``transfer.push_chunks``) for the same reason. Listing and finding by name go
through the name index (``gpusnap.daemon.remote.index``), which publish and delete keep and collection
repairs.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import structlog

from gpusnap.daemon.api import validate
from gpusnap.daemon.api.errors import DataLossError, NotFoundError
from gpusnap.daemon.api.types import Snapshot
from gpusnap.daemon.remote import layout
from gpusnap.daemon.remote.index import RemoteIndex
from gpusnap.daemon.remote.layout import RemoteManifest
from gpusnap.daemon.remote.objects import ObjectStore
from gpusnap.daemon.remote.transfer import TransferLimits

log = structlog.get_logger(__name__)


class RemoteStore:
    """Args: ``objects``: the bucket and prefix; ``limits``: transfer parallelism and memory."""

    def __init__(self, objects: ObjectStore, limits: TransferLimits):
        self.objects = objects
        self.limits = limits
        self.index = RemoteIndex(objects, limits.threads)

    def __str__(self) -> str:
        return str(self.objects)

    def manifest(self, snapshot_id: str) -> RemoteManifest:
        """The published snapshot ``snapshot_id``.

        Raises:
            NotFoundError: ``SNAPSHOT_NOT_FOUND``. DataLossError: unusable manifest. UnavailableError.
        """
        try:
            data = self.objects.get(layout.manifest_key(snapshot_id), 0, layout.MAX_MANIFEST_BYTES + 1)
        except NotFoundError:
            raise self.not_found(snapshot_id) from None
        if len(data) > layout.MAX_MANIFEST_BYTES:
            raise DataLossError(
                f"remote manifest of {snapshot_id} is larger than {layout.MAX_MANIFEST_BYTES} bytes; delete it "
                f"with `gpusnap rm --remote {snapshot_id}` and push again",
                reason="REMOTE_MANIFEST_CORRUPT",
                metadata={"snapshot": snapshot_id},
            )
        return layout.parse(data, snapshot_id)

    def published(self, snapshot_id: str) -> bool:
        """Whether ``snapshot_id``'s manifest is in the remote store (one HEAD; raises UnavailableError)."""
        return self.objects.head(layout.manifest_key(snapshot_id)) is not None

    def find(self, ref: str, owner_uid: int = 0) -> RemoteManifest:
        """The published snapshot with id or name ``ref`` (the newest of that name); names are per owner,
        as in the local store: ``NAME`` among ``owner_uid``'s snapshots, ``UID/NAME`` among UID's.

        Raises:
            InvalidArgumentError, NotFoundError, DataLossError, UnavailableError.
        """
        validate.snapshot_ref(ref)
        if validate.SNAPSHOT_ID_RE.fullmatch(ref):
            return self.manifest(ref)
        uid, name = validate.split_snapshot_ref(ref, owner_uid)
        for entry in reversed(self.index.entries(uid, name)):  # the newest first; a stale entry is passed over
            try:
                doc = self.manifest(entry.snapshot_id)
            except NotFoundError:
                continue
            if (doc.snapshot.owner_uid, doc.snapshot.name) == (uid, name):
                return doc
        raise self.not_found(ref)

    def publish(self, doc: RemoteManifest) -> bool:
        """Put the manifest last, only if absent, then its index entry; False when this snapshot was
        published already (its entry is put again: a push that died in between is finished)."""
        fresh = self.objects.put(layout.manifest_key(doc.snapshot.id), doc.to_bytes(), if_absent=True)
        self.index.put(doc.snapshot)
        return fresh

    def delete(self, snapshot: Snapshot) -> None:
        """Remove a published snapshot: its index entry, then its manifest (its chunks go at the next
        collection).

        Raises:
            NotFoundError: no such snapshot.
        """
        if not self.published(snapshot.id):
            raise self.not_found(snapshot.id)
        self.index.remove(snapshot)
        self.objects.delete(layout.manifest_key(snapshot.id))

    def delete_unusable(self, snapshot_id: str, caller_uid: int) -> None:
        """Remove the manifest of ``snapshot_id`` that cannot be read (:meth:`manifest` raised
        ``REMOTE_MANIFEST_CORRUPT``), with its index entries. Its owner is not in it to check: root may, and
        so may the user its index entry is filed under.

        Raises:
            NotFoundError: no such manifest, or none the caller's (``SNAPSHOT_NOT_FOUND``).
        """
        entries = [
            e for e in self.index.entries(None if caller_uid == 0 else caller_uid) if e.snapshot_id == snapshot_id
        ]
        if (caller_uid != 0 and not entries) or not self.published(snapshot_id):
            raise self.not_found(snapshot_id)
        for entry in entries:
            self.objects.delete(entry.key)
        self.objects.delete(layout.manifest_key(snapshot_id))
        log.info("remote.unusable_deleted", snapshot=snapshot_id, by=caller_uid)

    def collect_garbage(self, grace_s: float) -> tuple[int, int]:
        """Delete chunks that no manifest references and that are older than ``grace_s`` seconds;
        returns (chunks, bytes) deleted. A manifest that cannot be read stops the collection (its
        chunks might be live) instead of being treated as absent.

        Raises:
            DataLossError: an unusable manifest (``REMOTE_MANIFEST_CORRUPT``): fix or delete it first.
        """
        cutoff = datetime.now(UTC) - timedelta(seconds=grace_s)
        live: set[str] = set()
        published: set[str] = set()
        indexed = {e.snapshot_id: e for e in self.index.entries()}
        for obj in list(self.objects.list(layout.MANIFESTS)):
            sid = layout.snapshot_id_of(obj.key)
            if sid is None:
                continue
            doc = self.manifest(sid)
            live |= doc.chunks()
            published.add(sid)
            if sid not in indexed and obj.modified < cutoff:  # its push died between manifest and entry
                self.index.put(doc.snapshot)
        for sid, entry in indexed.items():
            if sid not in published:  # its delete died between entry and manifest, or the entry is forged
                self.objects.delete(entry.key)
        count = size = 0
        for obj in list(self.objects.list("chunks/")):
            digest = obj.key.rsplit("/", 1)[-1]
            if digest not in live and obj.modified < cutoff:
                self.objects.delete(obj.key)
                count += 1
                size += obj.size
        if count:
            log.info("remote.collected", chunks=count, bytes=size, remote=str(self))
        return count, size

    def not_found(self, ref: str) -> NotFoundError:
        """The error for a snapshot ``ref`` the remote store does not have (or the caller may not see)."""
        return NotFoundError(
            f"no snapshot {ref!r} in the remote store {self}; list them with `gpusnap ls --remote`",
            reason="SNAPSHOT_NOT_FOUND",
            metadata={"snapshot": ref},
        )
