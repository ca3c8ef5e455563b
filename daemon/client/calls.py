"""DaemonClient: a synchronous Python client of gpusnapd's gRPC API (what the CLI uses).

Calls return the frozen values of ``gpusnap.daemon.client.values`` (never protobuf messages); a call
that starts an operation returns an :class:`OperationHandle`. Failed calls raise the matching
:class:`~gpusnap.daemon.api.errors.GpusnapError` subclass, rebuilt from the status's
``google.rpc.ErrorInfo``; a failed operation's error is raised the same way by :meth:`OperationHandle.wait`
and :meth:`DaemonClient.wait`.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import stat
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import duration_pb2

from gpusnap.daemon._proto import (
    node_pb2,
    node_pb2_grpc,
    operations_pb2,
    operations_pb2_grpc,
    park_pb2,
    park_pb2_grpc,
    snapshots_pb2,
    snapshots_pb2_grpc,
)
from gpusnap.daemon.api.errors import Code, GpusnapError, PermissionDeniedError, UnavailableError
from gpusnap.daemon.api.status import from_rpc_error
from gpusnap.daemon.client import values
from gpusnap.daemon.client.convert import value
from gpusnap.daemon.client.values import NodeInfo, Operation, OperationEvent, OperationState, RestoredTree, Snapshot
from gpusnap.daemon.defaults import DEFAULT_SOCKET

R = TypeVar("R")
START_RETRY_S = 15.0
STOP_TIMEOUT_S = 60.0
"""A stop answers once the trees are gone: their grace (10 s), the kill after it, and room for a loaded node."""

TCP_MODES = {
    "refuse": operations_pb2.TCP_MODE_UNSPECIFIED,
    "established": operations_pb2.TCP_MODE_ESTABLISHED,
    "close": operations_pb2.TCP_MODE_CLOSE,
}


def _duration(seconds: float | None) -> duration_pb2.Duration | None:
    if seconds is None:
        return None
    d = duration_pb2.Duration()
    d.FromMilliseconds(int(seconds * 1000))
    return d


CHECKOUT_SOCKET = "build/run/gpusnapd.sock"
"""Where ``make run`` serves, in its checkout."""


def unreachable(path: str) -> str:
    """Why no gpusnapd answers on the socket ``path``, in words, and how to reach one (gRPC's own text, "failed to
    connect to all addresses; last error: UNKNOWN: unix:…", is left out)."""
    try:
        is_socket = stat.S_ISSOCK(os.stat(path).st_mode)
        why = "nothing answers on it (a gpusnapd that stopped left it?)" if is_socket else "it is not a socket"
    except FileNotFoundError:
        why = "there is no socket there"
    except OSError as exc:
        why = exc.strerror or str(exc)
    here = Path(CHECKOUT_SOCKET)
    if here.is_socket() and here.resolve() != Path(path).resolve():
        where = f"this checkout's `make run` serves {here}: pass --socket {here} (or set GPUSNAP_SOCKET)"
    else:
        where = (
            "start it (`systemctl start gpusnapd`, or `sudo gpusnapd`), or name the one that runs with --socket "
            f"(or GPUSNAP_SOCKET): `make run` serves {here} in its checkout"
        )
    return f"cannot reach gpusnapd at {path}: {why}; {where}"


def socket_permission(path: str) -> str:
    """What to do about a socket ``path`` the caller may not use: join the group it has (its name, as on this
    host), or have one set up (``socket_group``) where it has only root's."""
    st = os.stat(path)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}, group {group}"
    if st.st_gid == 0:
        return (
            f"no permission to use {path} ({mode}): only root may; to let users in, an administrator sets "
            "socket_group in gpusnapd.toml to a group of theirs (`make install-service` creates `gpusnap`) and "
            "restarts gpusnapd"
        )
    return (
        f"no permission to use {path} ({mode}); ask an administrator to add you to group {group} "
        f"(`usermod -aG {group} $USER`, then log in again)"
    )


class DaemonClient:
    """Talk to gpusnapd.

    Args:
        target: a socket path, or a gRPC target (``unix:…``, ``host:port`` with ``credentials``).
        credentials: TLS channel credentials for TCP targets.
    """

    def __init__(self, target: str | Path = DEFAULT_SOCKET, credentials: grpc.ChannelCredentials | None = None):
        target = str(target)
        self.target = target if ":" in target and not target.startswith("/") else f"unix:{target}"
        self._channel = (
            grpc.secure_channel(self.target, credentials) if credentials else grpc.insecure_channel(self.target)
        )
        self._ops = operations_pb2_grpc.OperationServiceStub(self._channel)
        self._snaps = snapshots_pb2_grpc.SnapshotServiceStub(self._channel)
        self._node = node_pb2_grpc.NodeServiceStub(self._channel)
        self._park = park_pb2_grpc.ParkServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Callable[..., R], request: Any, timeout: float | None = 60.0) -> R:
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def _start(self, method: Callable[..., Any], request: Any) -> OperationHandle:
        """Start an operation; while the daemon is unreachable (restarting), retry with the same idempotency
        key for up to ``START_RETRY_S``: the daemon then returns the operation the first attempt started."""
        deadline = time.monotonic() + START_RETRY_S
        delay = 0.2
        while True:
            try:
                return self._handle(self._call(method, request).operation)
            except UnavailableError:
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _handle(self, msg: operations_pb2.Operation) -> OperationHandle:
        return OperationHandle(self, value(Operation, msg))

    def _error(self, exc: grpc.RpcError) -> GpusnapError:
        err = from_rpc_error(exc)
        if err.code != Code.UNAVAILABLE or not self.target.startswith("unix:"):
            return err
        path = self.target.removeprefix("unix:")
        if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
            return PermissionDeniedError(socket_permission(path), reason="SOCKET_PERMISSION")
        if err.reason in ("DAEMON_UNAVAILABLE", "UNAVAILABLE"):
            return UnavailableError(unreachable(path), reason="DAEMON_UNAVAILABLE")
        return err

    def checkpoint(
        self,
        pid: int,
        *,
        name: str = "",
        labels: Mapping[str, str] | None = None,
        leave_running: bool = False,
        tcp: str = "refuse",
        timeout_s: float | None = None,
        gpu_lock_timeout_s: float | None = None,
        control_dir: str = "",
        quiesce: bool = True,
        offload: bool = True,
        dry_run: bool = False,
        request_id: str = "",
    ) -> OperationHandle:
        """Start a checkpoint of the tree rooted at ``pid``; returns the running operation (for a
        ``request_id`` used before: that operation)."""
        req = operations_pb2.CheckpointRequest(
            pid=pid,
            name=name,
            labels=dict(labels or {}),
            leave_running=leave_running,
            tcp=TCP_MODES[tcp],
            timeout=_duration(timeout_s),
            gpu_lock_timeout=_duration(gpu_lock_timeout_s),
            control_dir=control_dir,
            no_quiesce=not quiesce,
            no_offload=not offload,
            dry_run=dry_run,
            request_id=request_id or str(uuid.uuid4()),
        )
        return self._start(self._ops.Checkpoint, req)

    def restore(
        self,
        snapshot: str,
        *,
        host_pid_namespace: bool = False,
        gpu_map: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        unset_env: Sequence[str] = (),
        values: Mapping[str, str] | None = None,
        private_network: bool = False,
        verify_buffers: bool = False,
        replicas: int = 1,
        terminal: str = "",
        no_standby: bool = False,
        request_id: str = "",
    ) -> OperationHandle:
        """Start a restore of ``snapshot`` (id or name); returns the running operation.

        ``env``, ``unset_env`` and ``values`` form the restore context handed to the restored worker;
        with ``replicas`` > 1, that many copies are restored, ``{i}`` in the context becoming each one's index.
        ``terminal`` (an absolute path) stands in for the terminals the tree was started from; default
        ``/dev/null``.
        """
        context = operations_pb2.WorkerContext(
            env=dict(env or {}), unset_env=list(unset_env), values=dict(values or {})
        )
        req = operations_pb2.RestoreRequest(
            snapshot=snapshot,
            host_pid_namespace=host_pid_namespace,
            gpu_map=dict(gpu_map or {}),
            timeout=_duration(timeout_s),
            context=context,
            private_network=private_network,
            verify_buffers=verify_buffers,
            replicas=replicas,
            terminal=terminal,
            no_standby=no_standby,
            request_id=request_id or str(uuid.uuid4()),
        )
        return self._start(self._ops.Restore, req)

    def standby(
        self,
        snapshot: str,
        *,
        count: int = 1,
        private_network: bool = False,
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> OperationHandle:
        """Start restoring ``count`` standbys of ``snapshot`` (ahead of demand: stopped, CUDA-checkpointed)."""
        req = operations_pb2.StandbyRequest(
            snapshot=snapshot,
            count=count,
            private_network=private_network,
            timeout=_duration(timeout_s),
            request_id=request_id or str(uuid.uuid4()),
        )
        return self._start(self._ops.Standby, req)

    def activate(
        self,
        standby: str,
        *,
        gpu: str = "",
        gpu_map: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        unset_env: Sequence[str] = (),
        values: Mapping[str, str] | None = None,
        verify_buffers: bool = False,
        timeout_s: float | None = None,
        request_id: str = "",
    ) -> OperationHandle:
        """Start activating ``standby`` on ``gpu`` (or ``gpu_map``); the operation is a restore of its
        snapshot when another activation took it first."""
        context = operations_pb2.WorkerContext(
            env=dict(env or {}), unset_env=list(unset_env), values=dict(values or {})
        )
        req = operations_pb2.ActivateRequest(
            standby=standby,
            gpu=gpu,
            gpu_map=dict(gpu_map or {}),
            context=context,
            verify_buffers=verify_buffers,
            timeout=_duration(timeout_s),
            request_id=request_id or str(uuid.uuid4()),
        )
        return self._start(self._ops.Activate, req)

    def list_standbys(self, snapshot: str = "") -> list[values.Standby]:
        """The caller's standbys (of ``snapshot``), oldest first."""
        found = self._call(self._park.ListStandbys, park_pb2.ListStandbysRequest(snapshot=snapshot)).standbys
        return [value(values.Standby, s) for s in found]

    def drop_standby(self, standby: str) -> str:
        return str(self._call(self._park.DropStandby, park_pb2.DropStandbyRequest(standby=standby)).id)

    def ladder(self) -> values.Ladder:
        """The park ladder: workloads, budgets, the latest moves."""
        return value(values.Ladder, self._call(self._park.GetLadder, park_pb2.GetLadderRequest()))

    def set_policy(
        self,
        *,
        snapshot: str = "",
        labels: Mapping[str, str] | None = None,
        keep_warm: int | None = None,
        priority: int | None = None,
        standby_idle_s: float | None = None,
    ) -> values.PolicyRule:
        """Set the park policy of ``snapshot`` or of the caller's snapshots carrying ``labels`` (``None``:
        inherit that knob)."""
        policy = park_pb2.Policy(keep_warm=keep_warm, priority=priority, standby_idle_seconds=standby_idle_s)
        selector = park_pb2.PolicySelector(snapshot=snapshot, labels=dict(labels or {}))
        rule = self._call(self._park.SetPolicy, park_pb2.SetPolicyRequest(selector=selector, policy=policy)).rule
        return value(values.PolicyRule, rule)

    def list_policies(self) -> list[values.PolicyRule]:
        return [
            value(values.PolicyRule, r)
            for r in self._call(self._park.ListPolicies, park_pb2.ListPoliciesRequest()).rules
        ]

    def delete_policy(self, *, snapshot: str = "", labels: Mapping[str, str] | None = None) -> None:
        selector = park_pb2.PolicySelector(snapshot=snapshot, labels=dict(labels or {}))
        self._call(self._park.DeletePolicy, park_pb2.DeletePolicyRequest(selector=selector))

    def suspend(self, pid: int, *, gpu_lock_timeout_s: float | None = None, request_id: str = "") -> OperationHandle:
        """Start suspending the GPU state of the tree rooted at ``pid`` in place (a ``request_id`` used
        before: that operation)."""
        req = operations_pb2.SuspendRequest(
            pid=pid, gpu_lock_timeout=_duration(gpu_lock_timeout_s), request_id=request_id or str(uuid.uuid4())
        )
        return self._start(self._ops.Suspend, req)

    def resume(self, pid: int, *, gpu_map: Mapping[str, str] | None = None, request_id: str = "") -> OperationHandle:
        """Start resuming a suspended tree, optionally onto other GPUs (``old -> new``, UUIDs or indexes; a
        ``request_id`` used before: that operation)."""
        req = operations_pb2.ResumeRequest(
            pid=pid, gpu_map=dict(gpu_map or {}), request_id=request_id or str(uuid.uuid4())
        )
        return self._start(self._ops.Resume, req)

    def push(self, snapshot: str, *, request_id: str = "") -> OperationHandle:
        """Start pushing a local snapshot (id or name) to the daemon's remote store (a ``request_id`` used
        before: that operation)."""
        req = operations_pb2.PushRequest(snapshot=snapshot, request_id=request_id or str(uuid.uuid4()))
        return self._start(self._ops.Push, req)

    def pull(self, snapshot: str, *, request_id: str = "") -> OperationHandle:
        """Start pulling a snapshot (id or name) of the daemon's remote store into its local store (a
        ``request_id`` used before: that operation)."""
        req = operations_pb2.PullRequest(snapshot=snapshot, request_id=request_id or str(uuid.uuid4()))
        return self._start(self._ops.Pull, req)

    def cancel(self, op_id: str) -> Operation:
        """Ask the operation to stop and roll back; returns it as it is now."""
        msg = self._call(self._ops.CancelOperation, operations_pb2.CancelOperationRequest(id=op_id)).operation
        return value(Operation, msg)

    def get_operation(self, op_id: str) -> Operation:
        msg = self._call(self._ops.GetOperation, operations_pb2.GetOperationRequest(id=op_id)).operation
        return value(Operation, msg)

    def list_operations(self, page_size: int = 0) -> list[Operation]:
        """Every operation the caller may see, oldest first, fetched page by page."""
        req = operations_pb2.ListOperationsRequest(page_size=page_size)
        return [value(Operation, m) for m in self._all_pages(self._ops.ListOperations, req, "operations")]

    def _all_pages(self, method: Callable[..., Any], request: Any, field: str) -> list[Any]:
        """Call a List RPC until its ``next_page_token`` is empty; the items of every page, in order."""
        out: list[Any] = []
        while True:
            resp = self._call(method, request)
            out.extend(getattr(resp, field))
            if not resp.next_page_token:
                return out
            request.page_token = resp.next_page_token

    def watch(self, op_id: str) -> Iterator[OperationEvent]:
        """The operation's events from its start until its final event."""
        try:
            for resp in self._ops.WatchOperation(operations_pb2.WatchOperationRequest(id=op_id)):
                yield value(OperationEvent, resp.event)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def wait(self, op_id: str, timeout_s: float | None = None) -> Operation:
        """Wait for the operation to end; raise its error if it failed."""
        msg = self._call(
            self._ops.WaitOperation, operations_pb2.WaitOperationRequest(id=op_id), timeout=timeout_s
        ).operation
        return raise_if_failed(value(Operation, msg))

    def list_snapshots(
        self, label_selector: Mapping[str, str] | None = None, page_size: int = 0, remote: bool = False
    ) -> list[Snapshot]:
        """Every snapshot the caller may see (matching ``label_selector``), oldest first, page by page."""
        req = snapshots_pb2.ListSnapshotsRequest(
            label_selector=dict(label_selector or {}), page_size=page_size, remote=remote
        )
        return [value(Snapshot, m) for m in self._all_pages(self._snaps.ListSnapshots, req, "snapshots")]

    def get_snapshot(self, snapshot: str) -> Snapshot:
        msg = self._call(self._snaps.GetSnapshot, snapshots_pb2.GetSnapshotRequest(snapshot=snapshot)).snapshot
        return value(Snapshot, msg)

    def delete_snapshot(self, snapshot: str, remote: bool = False) -> str:
        req = snapshots_pb2.DeleteSnapshotRequest(snapshot=snapshot, remote=remote)
        return str(self._call(self._snaps.DeleteSnapshot, req).id)

    def node_info(self) -> NodeInfo:
        return value(NodeInfo, self._call(self._node.GetNodeInfo, node_pb2.GetNodeInfoRequest()).node)

    def restored_trees(self) -> list[RestoredTree]:
        """The restored trees running now that the caller may stop (root: all), oldest first."""
        msg = self._call(self._snaps.ListRestoredTrees, snapshots_pb2.ListRestoredTreesRequest())
        return [value(RestoredTree, t) for t in msg.trees]

    def stop_restored_tree(self, pid: int = 0, operation_id: str = "") -> list[RestoredTree]:
        """Stop the restored tree whose root has host PID ``pid`` (as restore printed it), or every tree of restore
        ``operation_id``; returns them once they are gone (up to ``STOP_TIMEOUT_S``)."""
        req = snapshots_pb2.StopRestoredTreeRequest(pid=pid) if pid else snapshots_pb2.StopRestoredTreeRequest()
        if operation_id:
            req.operation_id = operation_id
        msg = self._call(self._snaps.StopRestoredTree, req, timeout=STOP_TIMEOUT_S)
        return [value(RestoredTree, t) for t in msg.stopped]


@dataclasses.dataclass(frozen=True)
class OperationHandle:
    """An operation this client started: its state when started, and the calls that follow it."""

    client: DaemonClient
    operation: Operation
    """The operation as the start call returned it (running, or ended when a retried start found it so)."""

    @property
    def id(self) -> str:
        return self.operation.id

    def get(self) -> Operation:
        """The operation as it is now."""
        return self.client.get_operation(self.id)

    def wait(self, timeout_s: float | None = None) -> Operation:
        """Wait for the operation to end; raise its error if it failed (``CancelledError`` when cancelled)."""
        return self.client.wait(self.id, timeout_s)

    def watch(self) -> Iterator[OperationEvent]:
        """Its events from its start until its final event."""
        return self.client.watch(self.id)

    def cancel(self) -> Operation:
        """Ask it to stop and roll back; returns it as it is now."""
        return self.client.cancel(self.id)


def raise_if_failed(op: Operation) -> Operation:
    """``op`` itself, unless it failed or was cancelled: then its domain error is raised."""
    if op.state in (OperationState.FAILED, OperationState.CANCELLED):
        raise op.error or GpusnapError(f"operation {op.id} failed without an error")
    return op
