"""What an operation journals for recovery after a crash: its journal entry's ``facts``.

One frozen, versioned type per operation kind (:data:`FACTS`): :class:`CaptureFacts` for a checkpoint,
suspend or resume, :class:`RestoreFacts` for a restore, activation or standby, :class:`TransferFacts` for a
push or pull. An operation writes its facts whole through ``OperationRecord.note`` (durable before it returns)
and ``gpusnap.daemon.operations.recovery`` reads them back as that type (:func:`read`), through the saved
documents' one codec (``gpusnap.daemon.store.documents``). The previous release journaled the same names as a
plain object (its agents with more keys, which are not read): its entries read as these types.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import structlog

from gpusnap.daemon.api.types import OperationKind
from gpusnap.daemon.store import documents
from gpusnap.daemon.store.documents import DocumentError
from gpusnap.daemon.store.journal import Entry

log = structlog.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class JournaledAgent:
    """A worker agent a capture quiesced: what recovery needs to wake and resume its worker."""

    pid: int
    uid: int
    """Its process and user: its wake file is created in a directory of that user's (or root's)."""
    instance_id: str
    wake_dir: str


@dataclasses.dataclass(frozen=True)
class JournaledBuffers:
    """One agent's buffers a capture staged: the files it wrote them to and, once committed, the blobs they
    became (recovery hands them back to the quiesced worker)."""

    instance_id: str
    uid: int
    names: tuple[str, ...]
    paths: tuple[str, ...]
    digests: tuple[str, ...] = ()
    """Empty until the commit: then one per name."""


@dataclasses.dataclass(frozen=True)
class JournaledTree:
    """A tree a restore (or standby) is bringing up: journaled before CRIU restores anything, so that recovery
    kills it, or adopts it once validated. Host PIDs; start times in seconds since the epoch (``proc.start_time``)."""

    helper_pid: int = 0
    """The CRIU helper of the restore, and its process group (CRIU)."""
    helper_start: float = 0.0
    init_pid: int = 0
    """The init of its PID namespace (0: restored into gpusnapd's)."""
    init_start: float = 0.0
    expect_pids: tuple[int, ...] = ()
    """Restored into gpusnapd's PID namespace: the PIDs its processes get back."""
    ns_pid: int = 0
    root: int = 0
    root_start: float = 0.0
    cuda_pids: tuple[int, ...] = ()
    validated: bool = False
    """It passed ``validate``: recovery resumes its worker instead of killing it."""
    pids: tuple[int, ...] = ()
    """Its processes once validated."""


@dataclasses.dataclass(frozen=True)
class CaptureFacts:
    """A checkpoint's (a suspend and a resume journal none of these)."""

    tree_pids: tuple[int, ...] = ()
    """The source tree, root first."""
    starts: tuple[float, ...] | None = None
    """Their start times, in the same order (``None``: not known; a PID then counts as its process)."""
    leave_running: bool = False
    control_dir: str = ""
    """A control-directory worker's directory: it gets ``restore-complete``."""
    agents: tuple[JournaledAgent, ...] = ()
    staged: tuple[JournaledBuffers, ...] = ()
    cuda_pids: tuple[int, ...] = ()
    """CUDA processes of the tree: restored and unlocked if they are left locked or checkpointed."""
    staging: str = ""
    """The staging directory (a snapshot id) of the dump."""
    criu_helper: int = 0
    """The dump's CRIU helper, and its process group (``operations.leftover_criu``)."""
    criu_helper_start: float = 0.0
    snapshot_id: str = ""
    """The snapshot, once published: durable, so the capture succeeded."""
    recovery: str = ""
    """What recovery did (its message)."""
    schema_version: int = 1


@dataclasses.dataclass(frozen=True)
class RestoreFacts:
    """A restore's, an activation's or a standby operation's."""

    snapshot_id: str = ""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unset_env: tuple[str, ...] = ()
    values: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The restore context (env, unset_env, values): an adopted tree's worker resumes with it."""
    standby: str = ""
    """An activation's standby."""
    tree: JournaledTree | None = None
    """The copy being brought up."""
    earlier_trees: tuple[JournaledTree, ...] = ()
    """A fan-out's copies before it."""
    recovery: str = ""
    """What recovery did (``adopted``, ``killed``, ``nothing restored``)."""
    schema_version: int = 1


@dataclasses.dataclass(frozen=True)
class TransferFacts:
    """A push's or pull's: nothing (a transfer changes no process; a half-written local copy goes with the
    store's staging)."""

    recovery: str = ""
    schema_version: int = 1


Facts = CaptureFacts | RestoreFacts | TransferFacts

FACTS: dict[OperationKind, type[CaptureFacts] | type[RestoreFacts] | type[TransferFacts]] = {
    OperationKind.CHECKPOINT: CaptureFacts,
    OperationKind.SUSPEND: CaptureFacts,
    OperationKind.RESUME: CaptureFacts,
    OperationKind.RESTORE: RestoreFacts,
    OperationKind.ACTIVATE: RestoreFacts,
    OperationKind.STANDBY: RestoreFacts,
    OperationKind.PUSH: TransferFacts,
    OperationKind.PULL: TransferFacts,
}
"""The facts each kind of operation journals."""


def empty(kind: OperationKind) -> Facts:
    """The facts of an operation of ``kind`` that has journaled none yet."""
    return FACTS[kind]()


def read(kind: OperationKind, raw: Mapping[str, Any]) -> Facts:
    """The facts of an operation of ``kind`` as its journal entry holds them (``Entry.facts``).

    Raises:
        DocumentError: a field of the wrong type, or a newer ``schema_version``.
    """
    return documents.convert(raw, FACTS[kind])


def of_entry(entry: Entry) -> Facts | None:
    """The facts of a journal entry's operation; ``None`` when they do not read as its kind's (logged)."""
    try:
        return read(entry.kind, entry.facts)
    except DocumentError as exc:
        log.error("journal.facts_unreadable", operation_id=entry.id, error=str(exc))
        return None


def raw(facts: Facts) -> dict[str, Any]:
    """``facts`` as its journal entry holds them (JSON's types)."""
    out: dict[str, Any] = documents.to_builtins(facts)
    return out
