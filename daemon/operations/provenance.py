"""Provenance records of snapshots and the compatibility gate applied to them on this node
(``gpusnap.daemon.remote.compat``)."""

from __future__ import annotations

import collections
from datetime import UTC, datetime

from gpusnap.daemon.api.types import Snapshot
from gpusnap.daemon.operations.checkpoint import host_facts
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.remote import compat
from gpusnap.daemon.remote.layout import Provenance
from gpusnap.daemon.store import documents


def _major(driver: str) -> str:
    return driver.split(".", 1)[0] if driver else ""


def of_snapshot(deps: Deps, snapshot: Snapshot) -> Provenance:
    """The provenance of a snapshot made on this node: its capture-time host facts and the model and number
    of the GPUs it used (looked up here by UUID)."""
    uuids = {u for g in snapshot.gpu_processes for u in g.gpu_uuids}
    models = {g.uuid: g.name for g in deps.gpu.gpus()}
    used = sorted({models.get(u, "unknown GPU") for u in uuids})
    h = snapshot.host
    return Provenance(
        node=h.hostname,
        pushed_at=datetime.now(UTC).isoformat(timespec="seconds"),
        gpusnap_version=h.gpusnap_version,
        machine=h.machine,
        kernel=h.kernel,
        criu_version=h.criu_version,
        cpu_flags=h.cpu_flags,
        gpu_model=", ".join(used),
        gpu_count=len(uuids),
        driver_major=_major(h.nvidia_driver_version),
    )


def check(deps: Deps, snapshot_id: str, prov: Provenance) -> None:
    """Refuse a snapshot this node cannot run (``compat.check``: every difference listed)."""
    h = host_facts(deps)
    here = Provenance(
        node=h.hostname,
        pushed_at="",
        gpusnap_version=h.gpusnap_version,
        machine=h.machine,
        kernel=h.kernel,
        criu_version=h.criu_version,
        cpu_flags=h.cpu_flags,
        driver_major=_major(h.nvidia_driver_version),
    )
    compat.check(snapshot_id, prov, here, dict(collections.Counter(g.name for g in deps.gpu.gpus())))


def to_bytes(prov: Provenance) -> bytes:
    return documents.encode(prov)


def check_pulled(deps: Deps, snapshot_id: str) -> None:
    """Apply the gate to a snapshot pulled from another node (a no-op for snapshots made here)."""
    data = deps.store.provenance(snapshot_id)
    if data is None:
        return
    check(deps, snapshot_id, documents.decode(data, Provenance))
