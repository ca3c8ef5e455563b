"""Conversions between domain types and gpusnap.v1 protobuf messages."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from google.protobuf import duration_pb2, timestamp_pb2

from gpusnap.daemon._proto import node_pb2, operations_pb2, snapshots_pb2, types_pb2
from gpusnap.daemon.api.errors import InvalidArgumentError
from gpusnap.daemon.api.status import to_status_proto
from gpusnap.daemon.api.types import (
    CheckpointOptions,
    GpuProcess,
    HostFacts,
    PhaseTiming,
    RestoredTree,
    RestoreOptions,
    RestoreResult,
    Snapshot,
    TcpMode,
    TransferResult,
    WorkerInfo,
)
from gpusnap.daemon.core import NodeInfo
from gpusnap.daemon.operations.base import EventType, OperationEvent, OperationKind, OperationRecord, OperationState
from gpusnap.daemon.park.standbys import Standby
from gpusnap.daemon.store import manifest

_TCP = {
    operations_pb2.TCP_MODE_UNSPECIFIED: TcpMode.REFUSE,
    operations_pb2.TCP_MODE_ESTABLISHED: TcpMode.ESTABLISHED,
    operations_pb2.TCP_MODE_CLOSE: TcpMode.CLOSE,
}
_KIND = {
    OperationKind.CHECKPOINT: operations_pb2.OPERATION_KIND_CHECKPOINT,
    OperationKind.RESTORE: operations_pb2.OPERATION_KIND_RESTORE,
    OperationKind.SUSPEND: operations_pb2.OPERATION_KIND_SUSPEND,
    OperationKind.RESUME: operations_pb2.OPERATION_KIND_RESUME,
    OperationKind.PUSH: operations_pb2.OPERATION_KIND_PUSH,
    OperationKind.PULL: operations_pb2.OPERATION_KIND_PULL,
    OperationKind.STANDBY: operations_pb2.OPERATION_KIND_STANDBY,
    OperationKind.ACTIVATE: operations_pb2.OPERATION_KIND_ACTIVATE,
}
_STATE = {
    OperationState.RUNNING: operations_pb2.OPERATION_STATE_RUNNING,
    OperationState.SUCCEEDED: operations_pb2.OPERATION_STATE_SUCCEEDED,
    OperationState.FAILED: operations_pb2.OPERATION_STATE_FAILED,
    OperationState.CANCELLED: operations_pb2.OPERATION_STATE_CANCELLED,
}
_EVENT = {
    EventType.PHASE_STARTED: operations_pb2.OperationEvent.TYPE_PHASE_STARTED,
    EventType.PHASE_FINISHED: operations_pb2.OperationEvent.TYPE_PHASE_FINISHED,
    EventType.PHASE_FAILED: operations_pb2.OperationEvent.TYPE_PHASE_FAILED,
    EventType.PROGRESS: operations_pb2.OperationEvent.TYPE_PROGRESS,
    EventType.ROLLBACK: operations_pb2.OperationEvent.TYPE_ROLLBACK,
    EventType.OPERATION_FINISHED: operations_pb2.OperationEvent.TYPE_OPERATION_FINISHED,
    EventType.CANCEL_REQUESTED: operations_pb2.OperationEvent.TYPE_CANCEL_REQUESTED,
}


def timestamp(value: datetime) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(value.astimezone(UTC))
    return ts


MAX_TIMEOUT_S = 7 * 86400
"""Longest timeout a request may ask for (a week); longer ones are refused, not overflowed."""


def seconds(field: str, value: duration_pb2.Duration) -> float:
    """A request's Duration as seconds: a valid Duration (google/protobuf/duration.proto: nanos within
    +-999999999 with the sign of seconds), positive, at most ``MAX_TIMEOUT_S``.

    Raises:
        InvalidArgumentError: reason ``INVALID_TIMEOUT``.
    """
    secs, nanos = value.seconds, value.nanos
    if abs(nanos) > 999_999_999 or (secs > 0 and nanos < 0) or (secs < 0 and nanos > 0):
        raise InvalidArgumentError(
            f"{field} is not a valid Duration (seconds {secs}, nanos {nanos})", reason="INVALID_TIMEOUT"
        )
    total = secs + nanos / 1e9
    if total <= 0 or total > MAX_TIMEOUT_S:
        raise InvalidArgumentError(
            f"{field} must be a positive duration of at most {MAX_TIMEOUT_S} s, not {total:g} s",
            reason="INVALID_TIMEOUT",
        )
    return total


def _tcp(value: operations_pb2.TcpMode.ValueType) -> TcpMode:
    mode = _TCP.get(value)
    if mode is None:
        raise InvalidArgumentError(
            f"unknown tcp mode {int(value)}; use one of {', '.join(str(int(v)) for v in _TCP)}",
            reason="INVALID_ARGUMENT",
        )
    return mode


def checkpoint_options(req: operations_pb2.CheckpointRequest) -> CheckpointOptions:
    return CheckpointOptions(
        pid=req.pid,
        name=req.name,
        labels=dict(req.labels),
        leave_running=req.leave_running,
        tcp=_tcp(req.tcp),
        timeout_s=seconds("timeout", req.timeout) if req.HasField("timeout") else None,
        gpu_lock_timeout_s=seconds("gpu_lock_timeout", req.gpu_lock_timeout)
        if req.HasField("gpu_lock_timeout")
        else None,
        control_dir=req.control_dir,
        quiesce=not req.no_quiesce,
        offload=not req.no_offload,
        dry_run=req.dry_run,
    )


def restore_options(req: operations_pb2.RestoreRequest) -> RestoreOptions:
    return RestoreOptions(
        snapshot=req.snapshot,
        host_pid_namespace=req.host_pid_namespace,
        gpu_map=dict(req.gpu_map),
        timeout_s=seconds("timeout", req.timeout) if req.HasField("timeout") else None,
        env=dict(req.context.env),
        unset_env=tuple(req.context.unset_env),
        values=dict(req.context.values),
        private_network=req.private_network,
        verify_buffers=req.verify_buffers,
        replicas=max(1, req.replicas),
        terminal=_terminal_path(req.terminal),
        no_standby=req.no_standby,
    )


def _terminal_path(path: str) -> str:
    """``RestoreRequest.terminal``: empty, or an absolute path without NUL.

    Raises:
        InvalidArgumentError: reason ``INVALID_ARGUMENT``.
    """
    if path and (not path.startswith("/") or "\0" in path or len(path) > 4096):
        raise InvalidArgumentError(
            f"terminal {path[:100]!r} is not an absolute path; name the file that stands in for the terminal "
            "by its full path (`gpusnap restore --terminal` makes a relative one absolute)",
            reason="INVALID_ARGUMENT",
        )
    return path


def phase(p: PhaseTiming) -> types_pb2.PhaseTiming:
    return types_pb2.PhaseTiming(phase=p.phase, duration_seconds=p.duration_seconds, bytes=p.bytes)


def host(h: HostFacts) -> types_pb2.HostFacts:
    return types_pb2.HostFacts(
        hostname=h.hostname,
        kernel=h.kernel,
        machine=h.machine,
        criu_version=h.criu_version,
        gpusnap_version=h.gpusnap_version,
        cpu_model=h.cpu_model,
        cpu_flags=list(h.cpu_flags),
        nvidia_driver_version=h.nvidia_driver_version,
        cuda_driver_version=h.cuda_driver_version,
    )


def snapshot(s: Snapshot) -> types_pb2.Snapshot:
    src = s.source
    return types_pb2.Snapshot(
        id=s.id,
        name=s.name,
        created=timestamp(s.created),
        labels=dict(s.labels),
        source=types_pb2.ProcessFacts(
            pid=src.pid,
            comm=src.comm,
            cmdline=list(src.cmdline),
            uid=src.uid,
            gid=src.gid,
            tree_pids=list(src.tree_pids),
            rss_bytes=src.rss_bytes,
            cwd=src.cwd,
            listening=list(src.listening),
        ),
        host=host(s.host),
        files=[types_pb2.ImageFile(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256) for f in s.files],
        size_bytes=s.size_bytes,
        buffers=[
            types_pb2.BufferRef(name=b.name, size_bytes=b.size_bytes, sha256=b.sha256, agent=b.agent) for b in s.buffers
        ],
        buffer_bytes=s.buffer_bytes,
        phases=[phase(p) for p in s.phases],
        owner_uid=s.owner_uid,
        manifest_version=manifest.MANIFEST_VERSION,
        gpu_processes=[gpu_process(g) for g in s.gpu_processes],
        worker=worker_info(s.worker) if s.worker else None,
        agents=[worker_info(w) for w in s.agents],
        process_images=[types_pb2.ProcessImage(pid=i.pid, image_bytes=i.image_bytes) for i in s.process_images],
        terminals=[
            types_pb2.Terminal(path=t.path, key=t.key, fds=list(t.fds), controlling=t.controlling) for t in s.terminals
        ],
    )


def worker_info(w: WorkerInfo) -> types_pb2.WorkerInfo:
    """The API's view of a worker (its arenas' layouts stay in the manifest: they are for gpusnapd's prefill)."""
    return types_pb2.WorkerInfo(**{k: v for k, v in dataclasses.asdict(w).items() if k != "arenas"})


def operation(r: OperationRecord) -> operations_pb2.Operation:
    msg = operations_pb2.Operation(
        id=r.id,
        kind=_KIND[r.kind],
        state=_STATE[r.state],
        started=timestamp(r.started),
        phase=r.phase,
        phases=[phase(p) for p in r.phases],
        target_pid=r.target_pid,
        target_snapshot=r.target_snapshot,
        cancel_note=r.cancel_note,
        dry_run=r.dry_run,
    )
    if r.finished:
        msg.finished.CopyFrom(timestamp(r.finished))
    if r.error is not None:
        msg.error.CopyFrom(to_status_proto(r.error))
    if isinstance(r.result, Snapshot):
        msg.snapshot.CopyFrom(snapshot(r.result))
    elif r.kind is OperationKind.SUSPEND and isinstance(r.result, tuple):
        msg.suspend.CopyFrom(operations_pb2.SuspendResult(gpu_processes=[gpu_process(g) for g in r.result]))
    elif r.kind is OperationKind.RESUME and isinstance(r.result, dict):
        msg.resume.CopyFrom(operations_pb2.ResumeResult(gpu_map=r.result))
    elif isinstance(r.result, RestoreResult):
        msg.restore.CopyFrom(
            operations_pb2.RestoreResult(
                pid=r.result.pid,
                pids=list(r.result.pids),
                snapshot_id=r.result.snapshot_id,
                namespace_pid=r.result.namespace_pid,
                replicas=[
                    operations_pb2.RestoredReplica(
                        index=i,
                        pid=c.pid,
                        pids=list(c.pids),
                        namespace_pid=c.namespace_pid,
                        file_copies=[operations_pb2.FileCopy(**dataclasses.asdict(f)) for f in c.file_copies],
                    )
                    for i, c in enumerate(r.result.replicas)
                ],
                file_copies=[operations_pb2.FileCopy(**dataclasses.asdict(f)) for f in r.result.file_copies],
                standby_id=r.result.standby_id,
                standbys_skipped=r.result.standbys_skipped,
            )
        )
    elif isinstance(r.result, TransferResult):
        msg.transfer.CopyFrom(operations_pb2.TransferResult(**dataclasses.asdict(r.result)))
    elif r.kind is OperationKind.STANDBY and isinstance(r.result, tuple):
        msg.standby.CopyFrom(operations_pb2.StandbyResult(standbys=[standby(s) for s in r.result]))
    return msg


def standby(s: Standby) -> types_pb2.Standby:
    return types_pb2.Standby(
        id=s.id,
        snapshot_id=s.snapshot_id,
        owner_uid=s.owner_uid,
        created=timestamp(s.created),
        pid=s.root,
        pids=list(s.pids),
        host_memory_bytes=s.host_memory_bytes,
        state=s.state,
        private_network=s.private_network,
    )


def event(r: OperationRecord, e: OperationEvent) -> operations_pb2.OperationEvent:
    msg = operations_pb2.OperationEvent(
        operation_id=r.id,
        type=_EVENT[e.type],
        time=timestamp(e.time),
        phase=e.phase,
        duration_seconds=e.duration_seconds,
        bytes=e.bytes,
        total_bytes=e.total_bytes,
        message=e.message,
        sequence=e.sequence,
        bytes_per_second=e.bytes_per_second,
    )
    if e.type is EventType.OPERATION_FINISHED:
        msg.operation.CopyFrom(operation(r))
    return msg


def node_info(n: NodeInfo) -> node_pb2.NodeInfo:
    return node_pb2.NodeInfo(
        host=host(n.host),
        store_path=n.store_path,
        store_used_bytes=n.store_used_bytes,
        snapshot_count=n.snapshot_count,
        criu_path=n.criu_path,
        gpus=[
            types_pb2.GpuInfo(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                memory_total_bytes=g.memory_total_bytes,
                memory_free_bytes=g.memory_free_bytes,
                persistence_mode=g.persistence_mode,
                mig_mode=g.mig_mode,
                pci_bus_id=g.pci_bus_id,
                processes=[types_pb2.GpuComputeProcess(pid=p, used_memory_bytes=b) for p, b in g.processes],
            )
            for g in n.gpus
        ],
        cuda_checkpoint_supported=n.cuda_checkpoint_supported,
        cuda_unavailable_reason=n.cuda_unavailable_reason,
        gpu_prefill=node_pb2.GpuPrefill(
            **{k: v for k, v in dataclasses.asdict(n.gpu_prefill).items() if v is not None}
        ),
        remote=n.remote,
        standbys=n.standbys,
        standby_host_memory_bytes=n.standby_host_memory_bytes,
        unfinished_pulls=n.unfinished_pulls,
        unfinished_pull_bytes=n.unfinished_pull_bytes,
        page_fill=n.page_fill,
        tiers=[
            node_pb2.StoreTier(
                name=t.name,
                path=t.path,
                used_bytes=t.used_bytes,
                budget_bytes=t.budget_bytes,
                free_bytes=t.free_bytes,
                blobs=t.blobs,
            )
            for t in n.tiers
        ],
    )


def restored_tree(t: RestoredTree) -> snapshots_pb2.RestoredTree:
    return snapshots_pb2.RestoredTree(**{**dataclasses.asdict(t), "started": timestamp(t.started)})


def gpu_process(g: GpuProcess) -> types_pb2.GpuProcess:
    return types_pb2.GpuProcess(
        pid=g.pid,
        gpu_uuids=list(g.gpu_uuids),
        gpu_memory_bytes=g.gpu_memory_bytes,
        visible_gpu_uuids=list(g.visible_gpu_uuids),
    )
