"""What the client returns: frozen values of the gpusnap.v1 contract, free of protobuf.

One class per message the API answers with (``Operation``, ``Snapshot``, ``NodeInfo``, ``OperationEvent``
and their parts); field names are the proto field names (proto/gpusnap/v1), so ``-o json`` keys and
the schema in docs/schemas/v1/cli.schema.json follow from them. Parts the daemon's domain types already
describe exactly (``ProcessFacts``, ``HostFacts``, ``ImageFile``, ``PhaseTiming``, ``GpuProcess``,
``TransferResult``) are those types. Built from wire messages by ``gpusnap.daemon.client.convert``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime

from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.api.types import (
    EventType,
    GpuProcess,
    HostFacts,
    ImageFile,
    OperationKind,
    OperationState,
    PhaseTiming,
    ProcessFacts,
    TransferResult,
)

__all__ = [
    "Agent",
    "Buffer",
    "EventType",
    "GpuComputeProcess",
    "GpuInfo",
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
    "Replica",
    "RestoreResult",
    "ResumeResult",
    "Snapshot",
    "StoreTier",
    "SuspendResult",
    "TransferResult",
]


@dataclasses.dataclass(frozen=True)
class Agent:
    """A worker's agent (or a control-directory worker) as a snapshot records it (``gpusnap.v1.WorkerInfo``)."""

    engine: str
    instance_id: str
    wake_dir: str
    canary_tokens: str
    control_dir: str
    uid: int
    pid: int
    role: str
    process: str
    weights: str


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A named buffer (weights) kept in the buffer store (``gpusnap.v1.BufferRef``)."""

    name: str
    size_bytes: int
    sha256: str
    agent: str


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A published snapshot (``gpusnap.v1.Snapshot``)."""

    id: str
    name: str
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


@dataclasses.dataclass(frozen=True)
class Replica:
    """One copy of a fan-out restore."""

    index: int
    pid: int
    pids: tuple[int, ...]
    namespace_pid: int


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """Where a restored tree lives (the first copy's, with every copy in ``replicas``)."""

    pid: int
    pids: tuple[int, ...]
    snapshot_id: str
    namespace_pid: int
    replicas: tuple[Replica, ...]


@dataclasses.dataclass(frozen=True)
class SuspendResult:
    gpu_processes: tuple[GpuProcess, ...]


@dataclasses.dataclass(frozen=True)
class ResumeResult:
    gpu_map: Mapping[str, str]


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
    error: GpusnapError | None
    target_pid: int
    target_snapshot: str


@dataclasses.dataclass(frozen=True)
class OperationEvent:
    """One event of an operation's stream (``gpusnap.v1.OperationEvent``); ``operation`` only on the last."""

    operation_id: str
    type: EventType
    time: datetime
    phase: str
    duration_seconds: float
    bytes: int
    total_bytes: int
    message: str
    operation: Operation | None
    sequence: int


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
    budget_bytes: int
    """0: no budget (free space bounds it)."""
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
    cuda_unavailable_reason: str
    criu_path: str
    remote: str
    tiers: tuple[StoreTier, ...]
    gpu_prefill: str
