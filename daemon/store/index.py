"""SnapshotIndex: the published snapshots in memory, by owner, so a list neither reads nor parses manifests.

Every manifest is parsed once, when the store opens; :class:`~gpusnap.daemon.store.store.SnapshotStore`
then adds a snapshot when it publishes it and drops it when it deletes it or finds its manifest damaged.
A list looks only at the caller's own snapshots (root: all) before it applies the label selector.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import structlog

from gpusnap.daemon.api.errors import DataLossError
from gpusnap.daemon.api.types import Snapshot
from gpusnap.daemon.store import manifest

log = structlog.get_logger(__name__)


class SnapshotIndex:
    """Snapshots by owner uid, then by id. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_owner: dict[int, dict[str, Snapshot]] = {}
        self._owner_of: dict[str, int] = {}
        self._damaged_owner: dict[str, int] = {}  # snapshots damaged since they were indexed: owner kept

    def load(self, snapshots_dir: Path) -> None:
        """Index every readable manifest under ``snapshots_dir``; damaged ones are logged and left out."""
        for path in snapshots_dir.iterdir():
            try:
                self.add(manifest.read(path))
            except DataLossError as exc:
                log.warning("store.snapshot_damaged", path=str(path), error=str(exc))

    def add(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._by_owner.setdefault(snapshot.owner_uid, {})[snapshot.id] = snapshot
            self._owner_of[snapshot.id] = snapshot.owner_uid

    def discard(self, snapshot_id: str) -> None:
        with self._lock:
            self._damaged_owner.pop(snapshot_id, None)
            self._drop(snapshot_id)

    def mark_damaged(self, snapshot_id: str) -> int | None:
        """No longer list a snapshot whose manifest is damaged; returns its owner's uid where it was known
        (indexed before the damage), so that only they and root are told it is damaged."""
        with self._lock:
            owner = self._drop(snapshot_id)
            if owner is not None:
                self._damaged_owner[snapshot_id] = owner
            return self._damaged_owner.get(snapshot_id)

    def _drop(self, snapshot_id: str) -> int | None:
        owner = self._owner_of.pop(snapshot_id, None)
        if owner is not None:
            self._by_owner[owner].pop(snapshot_id, None)
            if not self._by_owner[owner]:
                del self._by_owner[owner]
        return owner

    def list(self, owner_uid: int | None, label_selector: Mapping[str, str]) -> list[Snapshot]:
        """Snapshots of ``owner_uid`` (every owner's for ``None``) whose labels match, oldest first."""
        with self._lock:
            if owner_uid is None:
                candidates = [s for snaps in self._by_owner.values() for s in snaps.values()]
            else:
                candidates = list(self._by_owner.get(owner_uid, {}).values())
        out = [s for s in candidates if all(s.labels.get(k) == v for k, v in label_selector.items())]
        return sorted(out, key=lambda s: (s.created, s.id))

    def by_name(self, name: str, owner_uid: int) -> Snapshot | None:
        """The snapshot of ``owner_uid`` named ``name``, if any (names are per owner)."""
        with self._lock:
            for snap in self._by_owner.get(owner_uid, {}).values():
                if snap.name == name:
                    return snap
        return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._owner_of)
