"""What the client returns: frozen values of the gpusnap.v1 contract, free of protobuf.

One class per message the API answers with (``Operation``, ``Snapshot``, ``NodeInfo``, ``OperationEvent``
and their parts); field names are the proto field names (proto/gpusnap/v1), so ``-o json`` keys and
the schema in docs/schemas/v1/cli.schema.json follow from them. A field that may be absent is typed
``X | None`` and is ``None`` when the wire leaves it unset or empty (no ``""`` or 0 standing for "none").
Parts the daemon's domain types already describe exactly (``ProcessFacts``, ``ImageFile``,
``PhaseTiming``, ``GpuProcess``, ``TransferResult``, ``GpuPrefill``, ``FileCopy``) are those types. Built from wire messages by ``gpusnap.daemon.client.convert``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from datetime import datetime

from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.api.types import (
    EventType,
    FileCopy,
    GpuPrefill,
    GpuProcess,
    ImageFile,
    OperationKind,
    OperationState,
    PhaseTiming,
    ProcessFacts,
    ProcessImage,
    Terminal,
    TransferResult,
)

__all__ = [
    "Agent",
    "Budget",
    "Ladder",
    "ParkEvent",
    "Policy",
    "PolicyRule",
    "PolicySelector",
    "Rung",
    "Standby",
    "StandbyResult",
    "Workload",
    "Buffer",
    "EventType",
    "FileCopy",
    "GpuComputeProcess",
    "GpuInfo",
    "GpuPrefill",
    "GpuProcess",
    "HostFacts",
    "ImageFile",
    "NodeInfo",
    "Operation",
    "OperationEvent",
    "OperationKind",
    "OperationState",
    "PhaseTiming",
    "ProcessFacts",
    "ProcessImage",
    "Replica",
    "RestoredTree",
    "RestoreResult",
    "ResumeResult",
    "Snapshot",
    "StoreTier",
    "SuspendResult",
    "Terminal",
    "TransferResult",
]


@dataclasses.dataclass(frozen=True)
class HostFacts:
    """The host a snapshot was taken on, or this node (``gpusnap.v1.HostFacts``)."""

    hostname: str
    kernel: str
    machine: str
    criu_version: str
    gpusnap_version: str
    cpu_model: str
    cpu_flags: tuple[str, ...]
    nvidia_driver_version: str | None
    """``None`` on a host without an NVIDIA driver."""
    cuda_driver_version: str | None


@dataclasses.dataclass(frozen=True)
class Agent:
    """A worker's agent (or a control-directory worker) as a snapshot records it (``gpusnap.v1.WorkerInfo``)."""

    engine: str | None
    instance_id: str | None
    wake_dir: str | None
    canary_tokens: str | None
    control_dir: str | None
    uid: int
    pid: int | None
    role: str | None
    """``frontend``, ``core`` or ``worker``; ``None`` for a single-process worker."""
    process: str | None
    weights: str | None
    released_bytes: int
    """Memory its quiesce freed without saving it (a KV cache); 0: none or unknown."""


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A named buffer (weights) kept in the buffer store (``gpusnap.v1.BufferRef``)."""

    name: str
    size_bytes: int
    sha256: str
    agent: str | None
    """The agent holding it; ``None``: the snapshot's ``worker``."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A published snapshot (``gpusnap.v1.Snapshot``)."""

    id: str
    name: str | None
    created: datetime
    labels: Mapping[str, str]
    source: ProcessFacts
    host: HostFacts
    files: tuple[ImageFile, ...]
    size_bytes: int
    phases: tuple[PhaseTiming, ...]
    owner_uid: int
    manifest_version: int
    gpu_processes: tuple[GpuProcess, ...]
    worker: Agent | None
    buffers: tuple[Buffer, ...]
    buffer_bytes: int
    agents: tuple[Agent, ...]
    process_images: tuple[ProcessImage, ...]
    terminals: tuple[Terminal, ...]


@dataclasses.dataclass(frozen=True)
class Replica:
    """One copy of a fan-out restore."""

    index: int
    pid: int
    pids: tuple[int, ...]
    namespace_pid: int
    file_copies: tuple[FileCopy, ...] = ()


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """Where a restored tree lives (the first copy's, with every copy in ``replicas``)."""

    pid: int
    pids: tuple[int, ...]
    snapshot_id: str
    namespace_pid: int
    replicas: tuple[Replica, ...]
    file_copies: tuple[FileCopy, ...] = ()
    """Files the tree continues writing in a copy of its own (the first copy's)."""
    standby_id: str | None = None
    """The standby activated instead of a restore from the images."""
    standbys_skipped: str | None = None
    """Restored from the images although the snapshot has ready standbys: why none was taken, how to take one."""


@dataclasses.dataclass(frozen=True)
class RestoredTree:
    """A restored tree running now (``gpusnap.v1.RestoredTree``): its root, the init of its PID namespace, what
    it was restored from and by, the uid its root runs as."""

    pid: int
    init_pid: int
    snapshot_id: str
    snapshot_name: str | None
    operation_id: str
    uid: int
    started: datetime
    process_count: int


@dataclasses.dataclass(frozen=True)
class SuspendResult:
    gpu_processes: tuple[GpuProcess, ...]


@dataclasses.dataclass(frozen=True)
class ResumeResult:
    gpu_map: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class Standby:
    """A snapshot restored ahead of demand (``gpusnap.v1.Standby``; docs/standby.md)."""

    id: str
    snapshot_id: str
    owner_uid: int
    created: datetime
    pid: int
    pids: tuple[int, ...]
    host_memory_bytes: int
    state: str
    """``ready`` or ``activating``."""
    private_network: bool


@dataclasses.dataclass(frozen=True)
class StandbyResult:
    standbys: tuple[Standby, ...]


@dataclasses.dataclass(frozen=True)
class Operation:
    """An operation of gpusnapd as it is now (``gpusnap.v1.Operation``); at most one result is set."""

    id: str
    kind: OperationKind
    state: OperationState
    started: datetime
    finished: datetime | None
    phase: str
    phases: tuple[PhaseTiming, ...]
    snapshot: Snapshot | None
    restore: RestoreResult | None
    suspend: SuspendResult | None
    resume: ResumeResult | None
    transfer: TransferResult | None
    standby: StandbyResult | None
    error: GpusnapError | None
    target_pid: int | None
    """checkpoint, suspend, resume: the tree's root."""
    target_snapshot: str | None
    """restore, push, pull: the snapshot's id."""
    cancel_note: str | None
    """Once a cancel was requested: what it does (stops now; runs its phase to the end first, and why; too late)."""
    dry_run: bool | None = None
    """A checkpoint that ran its preflight only (``dump --dry-run``): it made no snapshot."""


@dataclasses.dataclass(frozen=True)
class OperationEvent:
    """One event of an operation's stream (``gpusnap.v1.OperationEvent``); ``operation`` only on the last."""

    operation_id: str
    type: EventType
    time: datetime
    phase: str | None
    duration_seconds: float
    bytes: int
    total_bytes: int
    message: str | None
    operation: Operation | None
    sequence: int
    bytes_per_second: float
    """``PROGRESS``: bytes a second over the last few seconds (0: not known yet)."""


@dataclasses.dataclass(frozen=True)
class GpuComputeProcess:
    pid: int
    used_memory_bytes: int


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    persistence_mode: bool
    mig_mode: bool
    processes: tuple[GpuComputeProcess, ...]
    pci_bus_id: str


@dataclasses.dataclass(frozen=True)
class StoreTier:
    """One tier of the buffer store (``ram``, ``disk``) or ``remote``: what only the remote store holds."""

    name: str
    path: str
    used_bytes: int
    budget_bytes: int | None
    """None: no budget (free space bounds it)."""
    free_bytes: int
    blobs: int


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """Facts about the node (``gpusnap.v1.NodeInfo``)."""

    host: HostFacts
    store_path: str
    store_used_bytes: int
    snapshot_count: int
    gpus: tuple[GpuInfo, ...]
    cuda_checkpoint_supported: bool
    cuda_unavailable_reason: str | None
    criu_path: str
    remote: str | None
    """The remote store (``s3://bucket/prefix``); ``None`` when none is configured."""
    tiers: tuple[StoreTier, ...]
    gpu_prefill: GpuPrefill
    standbys: int
    """Standbys (the caller's; root: all)."""
    standby_host_memory_bytes: int
    unfinished_pulls: int
    """Pulls whose work the store still holds (root only); a retry resumes them."""
    unfinished_pull_bytes: int
    page_fill: str
    """How restores fill a tree's private memory: ``N threads``, or ``off (why)``."""


class Rung(enum.Enum):
    """A workload's place on the park ladder (``gpusnap.v1.Rung``), highest first."""

    UNSPECIFIED = "unspecified"
    ACTIVE = "active"
    SUSPENDED = "suspended"
    STANDBY = "standby"
    RAM = "ram"
    DISK = "disk"
    REMOTE = "remote"


@dataclasses.dataclass(frozen=True)
class Policy:
    """Park policy knobs (``gpusnap.v1.Policy``); ``None``: inherited."""

    keep_warm: int | None
    priority: int | None
    standby_idle_seconds: float | None


@dataclasses.dataclass(frozen=True)
class PolicySelector:
    snapshot: str | None
    labels: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class PolicyRule:
    selector: PolicySelector
    policy: Policy
    owner_uid: int
    snapshot_id: str | None


@dataclasses.dataclass(frozen=True)
class Workload:
    """One snapshot's workload on the ladder (``gpusnap.v1.Workload``)."""

    snapshot_id: str
    name: str | None
    rung: Rung
    active: int
    suspended: int
    standbys: int
    policy: Policy
    host_memory_bytes: int
    gpu_memory_bytes: int
    ram_tier_bytes: int
    note: str | None = None
    """Why its policy is not met now (keep_warm over a budget, the standby failed)."""


@dataclasses.dataclass(frozen=True)
class Budget:
    name: str
    used_bytes: int
    budget_bytes: int | None
    """None: no budget."""


@dataclasses.dataclass(frozen=True)
class ParkEvent:
    time: datetime
    snapshot_id: str
    from_rung: Rung | None
    """None: it was not on the ladder (a new snapshot)."""
    to_rung: Rung | None
    """None: it left the ladder (its snapshot was deleted)."""
    reason: str


@dataclasses.dataclass(frozen=True)
class Ladder:
    """``ParkService.GetLadder``: workloads, budgets, the latest moves."""

    workloads: tuple[Workload, ...]
    budgets: tuple[Budget, ...]
    events: tuple[ParkEvent, ...]
