"""gRPC servicers: decode the request, call one Daemon method, encode the answer. Nothing else."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import grpc
import structlog

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
from gpusnap.daemon.api import paging
from gpusnap.daemon.api.errors import GpusnapError, InternalError
from gpusnap.daemon.api.types import ANONYMOUS_CALLER, ROOT_CALLER, Caller
from gpusnap.daemon.core import Daemon, operation_key, snapshot_key
from gpusnap.daemon.service import convert, convert_park
from gpusnap.daemon.service.errors import abort
from gpusnap.daemon.service.peercred import PeerCredProxy

F = TypeVar("F", bound=Callable[..., Any])
log = structlog.get_logger(__name__)


def _rpc(method: F) -> F:
    """Turn domain errors into gRPC statuses; unexpected exceptions become INTERNAL."""

    @functools.wraps(method)
    def wrapper(self: _Base, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except GpusnapError as err:
            abort(context, err)
        except Exception as exc:  # a bug; keep serving
            if isinstance(exc, grpc.RpcError) or type(exc).__name__ == "_AbortedError":
                raise
            log.exception("rpc.crashed", method=method.__name__)
            abort(context, InternalError(f"internal error: {type(exc).__name__}: {exc}"))
        return None

    return wrapper  # type: ignore[return-value]


def common_names(subject: bytes) -> int:
    """How many common names (``CN`` attributes) an X.509 subject holds, given as gRPC's ``x509_subject``
    property writes it (RFC 2253: attributes joined by ``,`` and, within a multi-valued RDN, ``+``; those
    characters inside a value are escaped with ``\\``)."""
    count, attribute, escaped = 0, "", False
    for ch in subject.decode(errors="replace") + ",":
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in ",+":
            count += attribute.split("=", 1)[0].strip().upper() in ("CN", "COMMONNAME", "2.5.4.3")
            attribute = ""
            continue
        attribute += ch
    return count


def _values(found: bytes | Iterable[bytes] | None) -> list[bytes]:
    """An auth-context property's values (gRPC gives an iterable of bytes; its type stubs say bytes)."""
    return [found] if isinstance(found, bytes) else list(found or [])


class _Base:
    def __init__(self, daemon: Daemon, proxy: PeerCredProxy):
        self.daemon = daemon
        self.proxy = proxy

    def caller(self, context: grpc.ServicerContext) -> Caller:
        peer = context.peer()
        if peer.startswith(("ipv4:", "ipv6:")):
            # TCP listener: a client certificate verified against tls_client_ca (mutual TLS) gets the uid its
            # common name is mapped to in tls_client_identities, and nothing without a mapping; TLS without
            # a client certificate only encrypts. Unmapped callers are anonymous, and so is a certificate
            # whose subject holds more than one common name (gRPC's x509_common_name is only the first).
            auth = context.auth_context()
            names, subjects = _values(auth.get("x509_common_name")), _values(auth.get("x509_subject"))
            one = len(names) == 1 and len(subjects) == 1 and common_names(subjects[0]) == 1
            uid = self.daemon.deps.config.client_identities().get(names[0].decode(errors="replace")) if one else None
            if uid is None:
                return ANONYMOUS_CALLER
            return ROOT_CALLER if uid == 0 else Caller(pid=0, uid=uid, gid=uid)
        return self.proxy.caller_for(peer)


class OperationServicer(_Base, operations_pb2_grpc.OperationServiceServicer):
    @_rpc
    def Checkpoint(
        self, request: operations_pb2.CheckpointRequest, context: grpc.ServicerContext
    ) -> operations_pb2.CheckpointResponse:
        record = self.daemon.checkpoint(convert.checkpoint_options(request), self.caller(context), request.request_id)
        return operations_pb2.CheckpointResponse(operation=convert.operation(record))

    @_rpc
    def Restore(
        self, request: operations_pb2.RestoreRequest, context: grpc.ServicerContext
    ) -> operations_pb2.RestoreResponse:
        record = self.daemon.restore(convert.restore_options(request), self.caller(context), request.request_id)
        return operations_pb2.RestoreResponse(operation=convert.operation(record))

    @_rpc
    def Suspend(
        self, request: operations_pb2.SuspendRequest, context: grpc.ServicerContext
    ) -> operations_pb2.SuspendResponse:
        timeout = (
            convert.seconds("gpu_lock_timeout", request.gpu_lock_timeout)
            if request.HasField("gpu_lock_timeout")
            else None
        )
        record = self.daemon.suspend(request.pid, self.caller(context), timeout, request.request_id)
        return operations_pb2.SuspendResponse(operation=convert.operation(record))

    @_rpc
    def Resume(
        self, request: operations_pb2.ResumeRequest, context: grpc.ServicerContext
    ) -> operations_pb2.ResumeResponse:
        record = self.daemon.resume(request.pid, dict(request.gpu_map), self.caller(context), request.request_id)
        return operations_pb2.ResumeResponse(operation=convert.operation(record))

    @_rpc
    def Push(self, request: operations_pb2.PushRequest, context: grpc.ServicerContext) -> operations_pb2.PushResponse:
        record = self.daemon.push(request.snapshot, self.caller(context), request.request_id)
        return operations_pb2.PushResponse(operation=convert.operation(record))

    @_rpc
    def Pull(self, request: operations_pb2.PullRequest, context: grpc.ServicerContext) -> operations_pb2.PullResponse:
        record = self.daemon.pull(request.snapshot, self.caller(context), request.request_id)
        return operations_pb2.PullResponse(operation=convert.operation(record))

    @_rpc
    def GetOperation(
        self, request: operations_pb2.GetOperationRequest, context: grpc.ServicerContext
    ) -> operations_pb2.GetOperationResponse:
        record = self.daemon.operation(request.id, self.caller(context))
        return operations_pb2.GetOperationResponse(operation=convert.operation(record))

    # WaitOperation and WatchOperation are served by coroutines (gpusnap.daemon.service.aio.OperationStreams),
    # which hold no thread while they wait; the server never routes them here.
    def WaitOperation(self, request: Any, context: grpc.ServicerContext) -> Any:
        raise NotImplementedError("served by gpusnap.daemon.service.aio.OperationStreams")

    def WatchOperation(self, request: Any, context: grpc.ServicerContext) -> Any:
        raise NotImplementedError("served by gpusnap.daemon.service.aio.OperationStreams")

    @_rpc
    def CancelOperation(
        self, request: operations_pb2.CancelOperationRequest, context: grpc.ServicerContext
    ) -> operations_pb2.CancelOperationResponse:
        record = self.daemon.cancel(request.id, self.caller(context))
        return operations_pb2.CancelOperationResponse(operation=convert.operation(record))

    @_rpc
    def Standby(
        self, request: operations_pb2.StandbyRequest, context: grpc.ServicerContext
    ) -> operations_pb2.StandbyResponse:
        opts = convert_park.standby_options(request)
        record = self.daemon.standby(opts, self.caller(context), request.request_id)
        return operations_pb2.StandbyResponse(operation=convert.operation(record))

    @_rpc
    def Activate(
        self, request: operations_pb2.ActivateRequest, context: grpc.ServicerContext
    ) -> operations_pb2.ActivateResponse:
        opts = convert_park.activate_options(request)
        record = self.daemon.activate(request.standby, opts, self.caller(context), request.gpu, request.request_id)
        return operations_pb2.ActivateResponse(operation=convert.operation(record))

    @_rpc
    def ListOperations(
        self, request: operations_pb2.ListOperationsRequest, context: grpc.ServicerContext
    ) -> operations_pb2.ListOperationsResponse:
        page = self.daemon.operations(self.caller(context), request.page_size, request.page_token)
        ops = [convert.operation(r) for r in page.items]
        page = paging.fit(page, [m.ByteSize() for m in ops], operation_key)
        return operations_pb2.ListOperationsResponse(operations=ops[: len(page.items)], next_page_token=page.next_token)


class SnapshotServicer(_Base, snapshots_pb2_grpc.SnapshotServiceServicer):
    @_rpc
    def ListSnapshots(
        self, request: snapshots_pb2.ListSnapshotsRequest, context: grpc.ServicerContext
    ) -> snapshots_pb2.ListSnapshotsResponse:
        list_fn = self.daemon.remote_snapshots if request.remote else self.daemon.snapshots
        page = list_fn(self.caller(context), dict(request.label_selector), request.page_size, request.page_token)
        snaps = [convert.snapshot(s) for s in page.items]
        page = paging.fit(page, [m.ByteSize() for m in snaps], snapshot_key)
        return snapshots_pb2.ListSnapshotsResponse(snapshots=snaps[: len(page.items)], next_page_token=page.next_token)

    @_rpc
    def GetSnapshot(
        self, request: snapshots_pb2.GetSnapshotRequest, context: grpc.ServicerContext
    ) -> snapshots_pb2.GetSnapshotResponse:
        snap = self.daemon.snapshot(request.snapshot, self.caller(context))
        return snapshots_pb2.GetSnapshotResponse(snapshot=convert.snapshot(snap))

    @_rpc
    def DeleteSnapshot(
        self, request: snapshots_pb2.DeleteSnapshotRequest, context: grpc.ServicerContext
    ) -> snapshots_pb2.DeleteSnapshotResponse:
        delete = self.daemon.delete_remote_snapshot if request.remote else self.daemon.delete_snapshot
        return snapshots_pb2.DeleteSnapshotResponse(id=delete(request.snapshot, self.caller(context)))

    @_rpc
    def ListRestoredTrees(
        self, request: snapshots_pb2.ListRestoredTreesRequest, context: grpc.ServicerContext
    ) -> snapshots_pb2.ListRestoredTreesResponse:
        trees = self.daemon.restored_trees(self.caller(context))
        return snapshots_pb2.ListRestoredTreesResponse(trees=[convert.restored_tree(t) for t in trees])

    @_rpc
    def StopRestoredTree(
        self, request: snapshots_pb2.StopRestoredTreeRequest, context: grpc.ServicerContext
    ) -> snapshots_pb2.StopRestoredTreeResponse:
        stopped = self.daemon.stop_restored_trees(self.caller(context), request.pid, request.operation_id)
        return snapshots_pb2.StopRestoredTreeResponse(stopped=[convert.restored_tree(t) for t in stopped])


class NodeServicer(_Base, node_pb2_grpc.NodeServiceServicer):
    @_rpc
    def GetNodeInfo(
        self, request: node_pb2.GetNodeInfoRequest, context: grpc.ServicerContext
    ) -> node_pb2.GetNodeInfoResponse:
        return node_pb2.GetNodeInfoResponse(node=convert.node_info(self.daemon.node_info(self.caller(context))))


class ParkServicer(_Base, park_pb2_grpc.ParkServiceServicer):
    @_rpc
    def ListStandbys(
        self, request: park_pb2.ListStandbysRequest, context: grpc.ServicerContext
    ) -> park_pb2.ListStandbysResponse:
        found = self.daemon.standbys(self.caller(context), request.snapshot)
        return park_pb2.ListStandbysResponse(standbys=[convert.standby(s) for s in found])

    @_rpc
    def DropStandby(
        self, request: park_pb2.DropStandbyRequest, context: grpc.ServicerContext
    ) -> park_pb2.DropStandbyResponse:
        return park_pb2.DropStandbyResponse(id=self.daemon.drop_standby(request.standby, self.caller(context)))

    @_rpc
    def GetLadder(
        self, request: park_pb2.GetLadderRequest, context: grpc.ServicerContext
    ) -> park_pb2.GetLadderResponse:
        workloads, budgets, events = self.daemon.ladder_view(self.caller(context))
        return park_pb2.GetLadderResponse(
            workloads=[convert_park.workload(w) for w in workloads],
            budgets=[convert_park.budget(b) for b in budgets],
            events=[convert_park.event(e) for e in events],
        )

    @_rpc
    def SetPolicy(
        self, request: park_pb2.SetPolicyRequest, context: grpc.ServicerContext
    ) -> park_pb2.SetPolicyResponse:
        rule = self.daemon.set_policy(
            request.selector.snapshot,
            dict(request.selector.labels),
            convert_park.policy_of(request.policy),
            self.caller(context),
        )
        return park_pb2.SetPolicyResponse(rule=convert_park.rule(rule))

    @_rpc
    def ListPolicies(
        self, request: park_pb2.ListPoliciesRequest, context: grpc.ServicerContext
    ) -> park_pb2.ListPoliciesResponse:
        return park_pb2.ListPoliciesResponse(
            rules=[convert_park.rule(r) for r in self.daemon.policies(self.caller(context))]
        )

    @_rpc
    def DeletePolicy(
        self, request: park_pb2.DeletePolicyRequest, context: grpc.ServicerContext
    ) -> park_pb2.DeletePolicyResponse:
        self.daemon.delete_policy(request.selector.snapshot, dict(request.selector.labels), self.caller(context))
        return park_pb2.DeletePolicyResponse()
