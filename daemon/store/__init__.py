"""The snapshot store: staging, manifests, checksums and atomic publish."""

from gpusnap.daemon.store.store import SnapshotStore, StagingDir

__all__ = ["SnapshotStore", "StagingDir"]
