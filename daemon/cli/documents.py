"""What each command prints with ``-o json``: the document classes :func:`~gpusnap.daemon.cli.render.render`
writes, and the table from command name to document that scripts/gen_json_schema.py turns into
docs/schemas/v1/cli.schema.json (``#/$defs/command_<name>``).

A field's ``metadata["schema"]`` adds JSON Schema keywords (patterns, minimums) to what its type says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.client.values import (
    Budget,
    NodeInfo,
    Operation,
    OperationEvent,
    ParkEvent,
    PhaseTiming,
    PolicyRule,
    Replica,
    RestoredTree,
    Snapshot,
    Standby,
    StoreTier,
    Workload,
)

SNAPSHOT_ID = {"schema": {"pattern": "^snap-[a-z2-7]{26}$"}}
OPERATION_ID = {"schema": {"pattern": "^op-[a-z2-7]{26}$"}}
PID = {"schema": {"minimum": 1}}
COUNT = {"schema": {"minimum": 0}}
PHASES = {"schema": {"description": "the phases in the order they ran, as in every operation"}}

LS_OMIT = frozenset({"host.cpu_flags"})
"""About 100 flags per snapshot; ``inspect`` shows them."""
OPS_OMIT = frozenset({"snapshot.host.cpu_flags"})


def _f(meta: Mapping[str, Any]) -> Any:
    return dataclasses.field(metadata=meta)


@dataclasses.dataclass(frozen=True)
class Dumped:
    """``dump``: the new snapshot."""

    id: str = _f(SNAPSHOT_ID)
    name: str | None = _f({})
    operation: str = _f(OPERATION_ID)
    size_bytes: int = _f(COUNT)
    buffer_bytes: int = _f(COUNT)
    phases: tuple[PhaseTiming, ...] = _f(PHASES)
    push_operation: str | None = dataclasses.field(default=None, metadata=OPERATION_ID)
    """``--push``: the background push's operation."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """``restore``: the restored tree (the first copy's), with every copy in ``replicas``."""

    pid: int = _f(PID)
    pids: tuple[int, ...] = _f({})
    namespace_pid: int = _f(COUNT)
    snapshot_id: str = _f(SNAPSHOT_ID)
    operation: str = _f(OPERATION_ID)
    replicas: tuple[Replica, ...] = _f({"schema": {"minItems": 1}})
    phases: tuple[PhaseTiming, ...] = _f(PHASES)
    standby_id: str | None = dataclasses.field(default=None, metadata={"schema": {"pattern": "^sb-"}})
    """The standby activated instead of a restore from the images."""
    standbys_skipped: str | None = dataclasses.field(default=None, metadata={})
    """Restored from the images although the snapshot has ready standbys: why none was taken, how to take one."""


@dataclasses.dataclass(frozen=True)
class Transferred:
    """``push`` and ``pull``: what moved."""

    id: str = _f(SNAPSHOT_ID)
    remote: str = _f({"schema": {"pattern": "^s3://"}})
    operation: str = _f(OPERATION_ID)
    transferred_bytes: int = _f(COUNT)
    skipped_bytes: int = _f(COUNT)
    transferred_chunks: int = _f(COUNT)
    skipped_chunks: int = _f(COUNT)
    buffer_transferred_bytes: int = _f(COUNT)
    phases: tuple[PhaseTiming, ...] = _f(PHASES)


@dataclasses.dataclass(frozen=True)
class StoreReport:
    """``store``: the snapshot store, the buffer tiers and the remote store."""

    store_path: str
    snapshot_count: int = _f(COUNT)
    store_used_bytes: int = _f(COUNT)
    remote: str | None = _f({})
    tiers: tuple[StoreTier, ...] = _f({})
    unfinished_pulls: int = _f(COUNT)
    unfinished_pull_bytes: int = _f(COUNT)


@dataclasses.dataclass(frozen=True)
class RemoveFailure:
    snapshot: str
    error: GpusnapError


@dataclasses.dataclass(frozen=True)
class Removed:
    """``rm``: what was deleted, and each snapshot that could not be, with its error."""

    deleted: tuple[str, ...] = _f({"schema": {"items": SNAPSHOT_ID["schema"]}})
    failed: tuple[RemoveFailure, ...] = _f({})


@dataclasses.dataclass(frozen=True)
class Detached:
    """``--detach``: the operation started."""

    operation: str = _f(OPERATION_ID)


STANDBY_ID = {"schema": {"pattern": "^sb-[a-z2-7]{26}$"}}


@dataclasses.dataclass(frozen=True)
class StandbysMade:
    """``standby``: the standbys made (docs/standby.md)."""

    standbys: tuple[Standby, ...] = _f({})
    operation: str = _f(OPERATION_ID)
    phases: tuple[PhaseTiming, ...] = _f(PHASES)


@dataclasses.dataclass(frozen=True)
class Dropped:
    """``drop``: the standbys dropped."""

    dropped: tuple[str, ...] = _f({"schema": {"items": STANDBY_ID["schema"]}})


@dataclasses.dataclass(frozen=True)
class ParkReport:
    """``park``: the ladder (workloads, budgets, latest moves) and the policies."""

    workloads: tuple[Workload, ...] = _f({})
    budgets: tuple[Budget, ...] = _f({})
    events: tuple[ParkEvent, ...] = _f({})
    policies: tuple[PolicyRule, ...] = _f({})


@dataclasses.dataclass(frozen=True)
class Stopped:
    """``stop``: the restored trees stopped, as they were listed before."""

    stopped: tuple[RestoredTree, ...] = _f({"schema": {"minItems": 1}})


@dataclasses.dataclass(frozen=True)
class Failed:
    """Any command that exits non-zero."""

    error: GpusnapError


COMMANDS: dict[str, tuple[Any, frozenset[str]]] = {
    "dump": (Dumped, frozenset()),
    "restore": (Restored, frozenset()),
    "push": (Transferred, frozenset()),
    "pull": (Transferred, frozenset()),
    "store": (StoreReport, frozenset()),
    "rm": (Removed, frozenset()),
    "detached": (Detached, frozenset()),
    "failed": (Failed, frozenset()),
    "ls": (list[Snapshot], LS_OMIT),
    "ls_running": (list[RestoredTree], frozenset()),
    "stop": (Stopped, frozenset()),
    "inspect": (Snapshot, frozenset()),
    "node": (NodeInfo, frozenset()),
    "ops": (list[Operation], OPS_OMIT),
    "wait": (Operation, frozenset()),
    "wait_events": (OperationEvent, frozenset()),
    "cancel": (Operation, frozenset()),
    "suspend": (Operation, frozenset()),
    "resume": (Operation, frozenset()),
    "standby": (StandbysMade, frozenset()),
    "activate": (Restored, frozenset()),
    "standbys": (list[Standby], frozenset()),
    "drop": (Dropped, frozenset()),
    "park": (ParkReport, frozenset()),
    "park_set": (PolicyRule, frozenset()),
}
"""Command (``detached``: any ``--detach``; ``failed``: any failure; ``wait_events``: each line of ``wait --events``)
-> (document type, fields left out)."""
