"""The client's boundary: frozen values built from the wire, field for field, and a CLI that touches neither
protobuf nor the server."""

from __future__ import annotations

import ast
import dataclasses
from datetime import UTC, datetime

import pytest

from gpusnap.daemon._proto import node_pb2, operations_pb2, park_pb2, snapshots_pb2, types_pb2
from gpusnap.daemon.api.errors import CancelledError, Code
from gpusnap.daemon.api.status import to_status_proto
from gpusnap.daemon.client import values
from gpusnap.daemon.client.convert import value
from tests.conftest import REPO

PAIRS = [
    (values.Snapshot, types_pb2.Snapshot),
    (values.Agent, types_pb2.WorkerInfo),
    (values.Buffer, types_pb2.BufferRef),
    (values.ProcessFacts, types_pb2.ProcessFacts),
    (values.HostFacts, types_pb2.HostFacts),
    (values.ImageFile, types_pb2.ImageFile),
    (values.ProcessImage, types_pb2.ProcessImage),
    (values.Terminal, types_pb2.Terminal),
    (values.PhaseTiming, types_pb2.PhaseTiming),
    (values.GpuProcess, types_pb2.GpuProcess),
    (values.GpuInfo, types_pb2.GpuInfo),
    (values.GpuComputeProcess, types_pb2.GpuComputeProcess),
    (values.Operation, operations_pb2.Operation),
    (values.OperationEvent, operations_pb2.OperationEvent),
    (values.RestoreResult, operations_pb2.RestoreResult),
    (values.Replica, operations_pb2.RestoredReplica),
    (values.FileCopy, operations_pb2.FileCopy),
    (values.RestoredTree, snapshots_pb2.RestoredTree),
    (values.SuspendResult, operations_pb2.SuspendResult),
    (values.ResumeResult, operations_pb2.ResumeResult),
    (values.TransferResult, operations_pb2.TransferResult),
    (values.NodeInfo, node_pb2.NodeInfo),
    (values.StoreTier, node_pb2.StoreTier),
    (values.Standby, types_pb2.Standby),
    (values.StandbyResult, operations_pb2.StandbyResult),
    (values.Ladder, park_pb2.GetLadderResponse),
    (values.Workload, park_pb2.Workload),
    (values.Budget, park_pb2.Budget),
    (values.ParkEvent, park_pb2.ParkEvent),
    (values.Policy, park_pb2.Policy),
    (values.PolicyRule, park_pb2.PolicyRule),
    (values.PolicySelector, park_pb2.PolicySelector),
]


@pytest.mark.parametrize(("cls", "msg"), PAIRS, ids=[c.__name__ for c, _ in PAIRS])
def test_every_wire_field_has_its_value_field(cls: type, msg: type) -> None:
    """A field added to the proto without its value field would be dropped by the client without a word."""
    assert {f.name for f in dataclasses.fields(cls)} == set(msg.DESCRIPTOR.fields_by_name)  # type: ignore[attr-defined]


def test_an_operation_becomes_a_frozen_value() -> None:
    started = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    msg = operations_pb2.Operation(
        id="op-" + "a" * 26,
        kind=operations_pb2.OPERATION_KIND_RESTORE,
        state=operations_pb2.OPERATION_STATE_FAILED,
        phase="restore",
        phases=[types_pb2.PhaseTiming(phase="verify", duration_seconds=0.5, bytes=7)],
        restore=operations_pb2.RestoreResult(pid=10, pids=[10, 11], replicas=[operations_pb2.RestoredReplica(pid=10)]),
        error=to_status_proto(CancelledError("cancelled by the caller")),
    )
    msg.started.FromDatetime(started)
    op = value(values.Operation, msg)
    assert op.kind is values.OperationKind.RESTORE and op.state is values.OperationState.FAILED
    assert op.started == started and op.finished is None, "an unset timestamp is None, not the epoch"
    assert op.restore is not None and op.restore.pids == (10, 11) and op.restore.replicas[0].pid == 10
    assert op.snapshot is None and op.transfer is None, "the other results of the oneof are unset"
    assert isinstance(op.error, CancelledError) and op.error.code is Code.CANCELLED
    assert op.phases == (values.PhaseTiming(phase="verify", duration_seconds=0.5, bytes=7),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.phase = "other"  # type: ignore[misc]


def _imports(path: str) -> set[str]:
    found: set[str] = set()
    for file in (REPO / path).glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
    return found


def test_the_cli_imports_neither_wire_messages_nor_the_server() -> None:
    cli = _imports("daemon/cli")
    assert not {m for m in cli if m.startswith(("gpusnap.daemon._proto", "gpusnap.daemon.service", "grpc"))}, cli
    client = _imports("daemon/client")
    assert not {m for m in client if m.startswith("gpusnap.daemon.service")}, "the client imports no server code"
