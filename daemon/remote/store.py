"""RemoteStore: published snapshots in the remote store, found, published atomically and collected.

A snapshot is published by one conditional put of its manifest (``If-None-Match: *``) after all its
chunks are up: a reader sees either no manifest or one whose chunks all exist. Deleting removes the
manifest; :meth:`RemoteStore.collect_garbage` then marks the chunks every remaining manifest references
and deletes the others, but only those older than the grace period, so the chunks of a push still in
flight (uploaded, manifest not yet put) survive it. A push renews the modification time of the old
chunks it reuses (``transfer.push_chunks``) for the same reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import structlog

from gpusnap.daemon.api import validate
from gpusnap.daemon.api.errors import DataLossError, NotFoundError
from gpusnap.daemon.remote import layout
from gpusnap.daemon.remote.layout import RemoteManifest
from gpusnap.daemon.remote.s3 import ObjectStore
from gpusnap.daemon.remote.transfer import TransferLimits

log = structlog.get_logger(__name__)


class RemoteStore:
    """Args: ``objects``: the bucket and prefix; ``limits``: transfer parallelism and memory."""

    def __init__(self, objects: ObjectStore, limits: TransferLimits):
        self.objects = objects
        self.limits = limits

    def __str__(self) -> str:
        return str(self.objects.url)

    def manifest(self, snapshot_id: str) -> RemoteManifest:
        """The published snapshot ``snapshot_id``.

        Raises:
            NotFoundError: ``SNAPSHOT_NOT_FOUND``. DataLossError: unusable manifest. UnavailableError.
        """
        try:
            data = self.objects.get(layout.manifest_key(snapshot_id), 0, layout.MAX_MANIFEST_BYTES + 1)
        except NotFoundError:
            raise self._not_found(snapshot_id) from None
        if len(data) > layout.MAX_MANIFEST_BYTES:
            raise DataLossError(
                f"remote manifest of {snapshot_id} is larger than {layout.MAX_MANIFEST_BYTES} bytes",
                reason="REMOTE_MANIFEST_CORRUPT",
            )
        return layout.parse(data, snapshot_id)

    def published(self, snapshot_id: str) -> bool:
        """Whether ``snapshot_id``'s manifest is in the remote store (one HEAD; raises UnavailableError)."""
        return self.objects.head(layout.manifest_key(snapshot_id)) is not None

    def ids(self) -> Iterator[str]:
        for obj in self.objects.list(layout.MANIFESTS):
            sid = layout.snapshot_id_of(obj.key)
            if sid:
                yield sid

    def list(self) -> list[RemoteManifest]:
        """Every usable published snapshot, oldest first; unusable manifests are logged and left out."""

        def one(sid: str) -> RemoteManifest | None:
            try:
                return self.manifest(sid)
            except (DataLossError, NotFoundError) as exc:
                log.warning("remote.manifest_unusable", snapshot_id=sid, error=str(exc))
                return None

        with ThreadPoolExecutor(self.limits.threads) as pool:
            found = [m for m in pool.map(one, list(self.ids())) if m is not None]
        return sorted(found, key=lambda m: (m.snapshot.created, m.snapshot.id))

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
        named = [m for m in self.list() if m.snapshot.name == name and m.snapshot.owner_uid == uid]
        if not named:
            raise self._not_found(ref)
        return named[-1]

    def publish(self, doc: RemoteManifest) -> bool:
        """Put the manifest last, only if absent; False when this snapshot was published already."""
        return self.objects.put(layout.manifest_key(doc.snapshot.id), doc.to_bytes(), if_absent=True)

    def delete(self, snapshot_id: str) -> None:
        """Remove a published snapshot's manifest (its chunks go at the next collection).

        Raises:
            NotFoundError: no such snapshot.
        """
        if self.objects.head(layout.manifest_key(snapshot_id)) is None:
            raise self._not_found(snapshot_id)
        self.objects.delete(layout.manifest_key(snapshot_id))

    def collect_garbage(self, grace_s: float) -> tuple[int, int]:
        """Delete chunks that no manifest references and that are older than ``grace_s`` seconds;
        returns (chunks, bytes) deleted. A manifest that cannot be read stops the collection (its
        chunks might be live) instead of being treated as absent.

        Raises:
            DataLossError: an unusable manifest (``REMOTE_MANIFEST_CORRUPT``): fix or delete it first.
        """
        live: set[str] = set()
        for sid in list(self.ids()):
            live |= self.manifest(sid).chunks()
        cutoff = datetime.now(UTC) - timedelta(seconds=grace_s)
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

    def _not_found(self, ref: str) -> NotFoundError:
        return NotFoundError(
            f"no snapshot {ref!r} in the remote store {self}; list them with `gpusnap ls --remote`",
            reason="SNAPSHOT_NOT_FOUND",
            metadata={"snapshot": ref},
        )
