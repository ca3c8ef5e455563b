"""gRPC servicers, on the ``grpc.aio`` server's loop (``gpusnap.daemon.service.aio``): each RPC decodes the
request, calls one Daemon method and encodes the answer. Nothing else.

Every servicer is asynchronous. A unary RPC runs its work (decode, the Daemon call, encode) on the daemon's
``rpc`` lane (:meth:`_Servicer.unary`), at most ``max_calls_per_caller`` of one caller at a time
(:class:`CallerLimits`): further calls of that caller wait without a thread, and an answer the caller does
not read counts against its connection and its caller until sent (:meth:`CallerLimits.room`).
``WaitOperation`` and ``WatchOperation`` are coroutines woken by the operation's events
(:meth:`OperationRecord.subscribe`); they hold no thread, and a caller may hold ``max_streams_per_caller``
of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc
import structlog
from google.protobuf.message import Message
from grpc_status import rpc_status

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
from gpusnap.daemon.api.status import to_status_proto
from gpusnap.daemon.api.types import ANONYMOUS_CALLER, ROOT_CALLER, Caller
from gpusnap.daemon.core import Daemon, operation_key, snapshot_key
from gpusnap.daemon.operations.base import EventType, OperationRecord
from gpusnap.daemon.service import convert, convert_park
from gpusnap.daemon.service.limits import CallerLimits
from gpusnap.daemon.service.peercred import PeerCredProxy

SERVICE_NAMES = (
    operations_pb2.DESCRIPTOR.services_by_name["OperationService"].full_name,
    snapshots_pb2.DESCRIPTOR.services_by_name["SnapshotService"].full_name,
    node_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name,
    park_pb2.DESCRIPTOR.services_by_name["ParkService"].full_name,
)
"""The gpusnap services the servicers serve (health and reflection name them too)."""
R = TypeVar("R", bound=Message)
Context = grpc.aio.ServicerContext[Any, Any]
log = structlog.get_logger(__name__)


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


def caller_key(caller: Caller) -> int:
    """The key limits count a caller under: its uid (anonymous TCP callers share one key)."""
    return caller.uid


async def _abort(context: Context, err: GpusnapError) -> NoReturn:
    """End the RPC with ``err``'s status (``gpusnap.daemon.api.status``)."""
    await context.abort_with_status(rpc_status.to_status(to_status_proto(err)))
    raise AssertionError("unreachable")  # abort_with_status raises


class _Servicer:
    """What every servicer shares: the caller of a call, and the one way a unary RPC runs.

    Args:
        daemon: the domain API the RPCs call.
        proxy: the peer-credential proxy, which knows the caller behind a connection to the public socket.
        lane: the daemon's ``rpc`` lane (``gpusnap.daemon.executor``), where unary RPCs do their work.
        limits: the per-caller bounds on calls, streams and unsent answers.
    """

    def __init__(self, daemon: Daemon, proxy: PeerCredProxy, lane: ThreadPoolExecutor, limits: CallerLimits):
        self.daemon, self.proxy, self.lane, self.limits = daemon, proxy, lane, limits

    def caller(self, context: Context) -> Caller:
        """Who makes the call (runs on the loop: it reads only the context and the proxy's table).

        Raises:
            UnauthenticatedError: a proxied connection that is no longer known (reason ``PEER_UNKNOWN``).
        """
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

    async def unary(self, context: Context, work: Callable[[Caller], R]) -> R:
        """Run ``work(caller)`` (decode, one Daemon call, encode) on the ``rpc`` lane within the caller's
        limits, and answer with what it returns. A domain error ends the RPC with its status; any other
        exception is a bug, logged, and ends it ``INTERNAL``."""
        peer = context.peer()
        try:
            caller = self.caller(context)
            key = caller_key(caller)
            async with self.limits.call(key):
                await self.limits.room(key, peer)  # the caller's earlier answers read first
                response = await asyncio.get_running_loop().run_in_executor(self.lane, work, caller)
        except GpusnapError as err:
            await _abort(context, err)
        except Exception as exc:  # a bug; keep serving
            log.exception("rpc.crashed", method=getattr(work, "__qualname__", "?"))
            await _abort(context, InternalError(f"internal error: {type(exc).__name__}: {exc}"))
        sent = self.limits.unsent(key, peer, response.ByteSize())
        context.add_done_callback(lambda _call: sent())  # type: ignore[arg-type]  # sent, or the call ended
        return response


class OperationServicer(_Servicer, operations_pb2_grpc.OperationServiceServicer):
    async def Checkpoint(
        self, request: operations_pb2.CheckpointRequest, context: Context
    ) -> operations_pb2.CheckpointResponse:
        def answer(caller: Caller) -> operations_pb2.CheckpointResponse:
            record = self.daemon.checkpoint(convert.checkpoint_options(request), caller, request.request_id)
            return operations_pb2.CheckpointResponse(operation=convert.operation(record))

        return await self.unary(context, answer)

    async def Restore(self, request: operations_pb2.RestoreRequest, context: Context) -> operations_pb2.RestoreResponse:
        def answer(caller: Caller) -> operations_pb2.RestoreResponse:
            record = self.daemon.restore(convert.restore_options(request), caller, request.request_id)
            return operations_pb2.RestoreResponse(operation=convert.operation(record))

        return await self.unary(context, answer)

    async def Suspend(self, request: operations_pb2.SuspendRequest, context: Context) -> operations_pb2.SuspendResponse:
        def answer(caller: Caller) -> operations_pb2.SuspendResponse:
            timeout = (
                convert.seconds("gpu_lock_timeout", request.gpu_lock_timeout)
                if request.HasField("gpu_lock_timeout")
                else None
            )
            record = self.daemon.suspend(request.pid, caller, timeout, request.request_id)
            return operations_pb2.SuspendResponse(operation=convert.operation(record))

        return await self.unary(context, answer)

    async def Resume(self, request: operations_pb2.ResumeRequest, context: Context) -> operations_pb2.ResumeResponse:
        def answer(caller: Caller) -> operations_pb2.ResumeResponse:
            record = self.daemon.resume(request.pid, dict(request.gpu_map), caller, request.request_id)
            return operations_pb2.ResumeResponse(operation=convert.operation(record))

        return await self.unary(context, answer)

    async def Push(self, request: operations_pb2.PushRequest, context: Context) -> operations_pb2.PushResponse:
        def answer(caller: Caller) -> operations_pb2.PushResponse:
            record = self.daemon.push(request.snapshot, caller, request.request_id)
            return operations_pb2.PushResponse(operation=convert.operation(record))

        return await self.unary(context, answer)

    async def Pull(self, request: operations_pb2.PullRequest, context: Context) -> operations_pb2.PullResponse:
        def answer(caller: Caller) -> operations_pb2.PullResponse:
            record = self.daemon.pull(request.snapshot, caller, request.request_id)
            return operations_pb2.PullResponse(operation=convert.operation(record))

        return await self.unary(context, answer)

    async def GetOperation(
        self, request: operations_pb2.GetOperationRequest, context: Context
    ) -> operations_pb2.GetOperationResponse:
        def answer(caller: Caller) -> operations_pb2.GetOperationResponse:
            return operations_pb2.GetOperationResponse(
                operation=convert.operation(self.daemon.operation(request.id, caller))
            )

        return await self.unary(context, answer)

    async def WaitOperation(
        self, request: operations_pb2.WaitOperationRequest, context: Context
    ) -> operations_pb2.WaitOperationResponse:
        try:
            caller = self.caller(context)
            record = self.daemon.operation(request.id, caller)
            with self.limits.stream(caller_key(caller)):
                async for _ in _events(record):
                    pass
        except GpusnapError as err:
            await _abort(context, err)
        return operations_pb2.WaitOperationResponse(operation=convert.operation(record))

    async def WatchOperation(
        self, request: operations_pb2.WatchOperationRequest, context: Context
    ) -> AsyncIterator[operations_pb2.WatchOperationResponse]:
        try:
            caller = self.caller(context)
            record = self.daemon.operation(request.id, caller)
            with self.limits.stream(caller_key(caller)):
                async for event in _events(record):
                    yield operations_pb2.WatchOperationResponse(event=convert.event(record, event))
        except GpusnapError as err:
            await _abort(context, err)

    async def CancelOperation(
        self, request: operations_pb2.CancelOperationRequest, context: Context
    ) -> operations_pb2.CancelOperationResponse:
        def answer(caller: Caller) -> operations_pb2.CancelOperationResponse:
            record = self.daemon.cancel(request.id, caller)
            return operations_pb2.CancelOperationResponse(operation=convert.operation(record))

        return await self.unary(context, answer)

    async def Standby(self, request: operations_pb2.StandbyRequest, context: Context) -> operations_pb2.StandbyResponse:
        def answer(caller: Caller) -> operations_pb2.StandbyResponse:
            record = self.daemon.standby(convert_park.standby_options(request), caller, request.request_id)
            return operations_pb2.StandbyResponse(operation=convert.operation(record))

        return await self.unary(context, answer)

    async def Activate(
        self, request: operations_pb2.ActivateRequest, context: Context
    ) -> operations_pb2.ActivateResponse:
        def answer(caller: Caller) -> operations_pb2.ActivateResponse:
            opts = convert_park.activate_options(request)
            record = self.daemon.activate(request.standby, opts, caller, request.gpu, request.request_id)
            return operations_pb2.ActivateResponse(operation=convert.operation(record))

        return await self.unary(context, answer)

    async def ListOperations(
        self, request: operations_pb2.ListOperationsRequest, context: Context
    ) -> operations_pb2.ListOperationsResponse:
        def answer(caller: Caller) -> operations_pb2.ListOperationsResponse:
            page = self.daemon.operations(caller, request.page_size, request.page_token)
            ops = [convert.operation(r) for r in page.items]
            page = paging.fit(page, [m.ByteSize() for m in ops], operation_key)
            return operations_pb2.ListOperationsResponse(
                operations=ops[: len(page.items)], next_page_token=page.next_token
            )

        return await self.unary(context, answer)


class SnapshotServicer(_Servicer, snapshots_pb2_grpc.SnapshotServiceServicer):
    async def ListSnapshots(
        self, request: snapshots_pb2.ListSnapshotsRequest, context: Context
    ) -> snapshots_pb2.ListSnapshotsResponse:
        def answer(caller: Caller) -> snapshots_pb2.ListSnapshotsResponse:
            list_fn = self.daemon.remote_snapshots if request.remote else self.daemon.snapshots
            page = list_fn(caller, dict(request.label_selector), request.page_size, request.page_token)
            snaps = [convert.snapshot(s) for s in page.items]
            page = paging.fit(page, [m.ByteSize() for m in snaps], snapshot_key)
            return snapshots_pb2.ListSnapshotsResponse(
                snapshots=snaps[: len(page.items)], next_page_token=page.next_token
            )

        return await self.unary(context, answer)

    async def GetSnapshot(
        self, request: snapshots_pb2.GetSnapshotRequest, context: Context
    ) -> snapshots_pb2.GetSnapshotResponse:
        def answer(caller: Caller) -> snapshots_pb2.GetSnapshotResponse:
            return snapshots_pb2.GetSnapshotResponse(
                snapshot=convert.snapshot(self.daemon.snapshot(request.snapshot, caller))
            )

        return await self.unary(context, answer)

    async def DeleteSnapshot(
        self, request: snapshots_pb2.DeleteSnapshotRequest, context: Context
    ) -> snapshots_pb2.DeleteSnapshotResponse:
        def answer(caller: Caller) -> snapshots_pb2.DeleteSnapshotResponse:
            delete = self.daemon.delete_remote_snapshot if request.remote else self.daemon.delete_snapshot
            return snapshots_pb2.DeleteSnapshotResponse(id=delete(request.snapshot, caller))

        return await self.unary(context, answer)

    async def ListRestoredTrees(
        self, request: snapshots_pb2.ListRestoredTreesRequest, context: Context
    ) -> snapshots_pb2.ListRestoredTreesResponse:
        def answer(caller: Caller) -> snapshots_pb2.ListRestoredTreesResponse:
            trees = self.daemon.restored_trees(caller)
            return snapshots_pb2.ListRestoredTreesResponse(trees=[convert.restored_tree(t) for t in trees])

        return await self.unary(context, answer)

    async def StopRestoredTree(
        self, request: snapshots_pb2.StopRestoredTreeRequest, context: Context
    ) -> snapshots_pb2.StopRestoredTreeResponse:
        def answer(caller: Caller) -> snapshots_pb2.StopRestoredTreeResponse:
            stopped = self.daemon.stop_restored_trees(caller, request.pid, request.operation_id)
            return snapshots_pb2.StopRestoredTreeResponse(stopped=[convert.restored_tree(t) for t in stopped])

        return await self.unary(context, answer)


class NodeServicer(_Servicer, node_pb2_grpc.NodeServiceServicer):
    async def GetNodeInfo(self, request: node_pb2.GetNodeInfoRequest, context: Context) -> node_pb2.GetNodeInfoResponse:
        def answer(caller: Caller) -> node_pb2.GetNodeInfoResponse:
            return node_pb2.GetNodeInfoResponse(node=convert.node_info(self.daemon.node_info(caller)))

        return await self.unary(context, answer)


class ParkServicer(_Servicer, park_pb2_grpc.ParkServiceServicer):
    async def ListStandbys(
        self, request: park_pb2.ListStandbysRequest, context: Context
    ) -> park_pb2.ListStandbysResponse:
        def answer(caller: Caller) -> park_pb2.ListStandbysResponse:
            found = self.daemon.standbys(caller, request.snapshot)
            return park_pb2.ListStandbysResponse(standbys=[convert.standby(s) for s in found])

        return await self.unary(context, answer)

    async def DropStandby(self, request: park_pb2.DropStandbyRequest, context: Context) -> park_pb2.DropStandbyResponse:
        def answer(caller: Caller) -> park_pb2.DropStandbyResponse:
            return park_pb2.DropStandbyResponse(id=self.daemon.drop_standby(request.standby, caller))

        return await self.unary(context, answer)

    async def GetLadder(self, request: park_pb2.GetLadderRequest, context: Context) -> park_pb2.GetLadderResponse:
        def answer(caller: Caller) -> park_pb2.GetLadderResponse:
            workloads, budgets, events = self.daemon.ladder_view(caller)
            return park_pb2.GetLadderResponse(
                workloads=[convert_park.workload(w) for w in workloads],
                budgets=[convert_park.budget(b) for b in budgets],
                events=[convert_park.event(e) for e in events],
            )

        return await self.unary(context, answer)

    async def SetPolicy(self, request: park_pb2.SetPolicyRequest, context: Context) -> park_pb2.SetPolicyResponse:
        def answer(caller: Caller) -> park_pb2.SetPolicyResponse:
            rule = self.daemon.set_policy(
                request.selector.snapshot,
                dict(request.selector.labels),
                convert_park.policy_of(request.policy),
                caller,
            )
            return park_pb2.SetPolicyResponse(rule=convert_park.rule(rule))

        return await self.unary(context, answer)

    async def ListPolicies(
        self, request: park_pb2.ListPoliciesRequest, context: Context
    ) -> park_pb2.ListPoliciesResponse:
        def answer(caller: Caller) -> park_pb2.ListPoliciesResponse:
            return park_pb2.ListPoliciesResponse(rules=[convert_park.rule(r) for r in self.daemon.policies(caller)])

        return await self.unary(context, answer)

    async def DeletePolicy(
        self, request: park_pb2.DeletePolicyRequest, context: Context
    ) -> park_pb2.DeletePolicyResponse:
        def answer(caller: Caller) -> park_pb2.DeletePolicyResponse:
            self.daemon.delete_policy(request.selector.snapshot, dict(request.selector.labels), caller)
            return park_pb2.DeletePolicyResponse()

        return await self.unary(context, answer)


def serve(
    server: grpc.aio.Server, daemon: Daemon, proxy: PeerCredProxy, lane: ThreadPoolExecutor, limits: CallerLimits
) -> None:
    """Add every gpusnap servicer to ``server`` (on its loop, before it starts); see :class:`_Servicer`'s arguments."""
    operations_pb2_grpc.add_OperationServiceServicer_to_server(OperationServicer(daemon, proxy, lane, limits), server)
    snapshots_pb2_grpc.add_SnapshotServiceServicer_to_server(SnapshotServicer(daemon, proxy, lane, limits), server)
    node_pb2_grpc.add_NodeServiceServicer_to_server(NodeServicer(daemon, proxy, lane, limits), server)
    park_pb2_grpc.add_ParkServiceServicer_to_server(ParkServicer(daemon, proxy, lane, limits), server)


async def _events(record: OperationRecord) -> AsyncIterator[Any]:
    """The operation's events from its start, as they come, until its final event."""
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(changed.set)
        except RuntimeError:  # the loop closed (daemon stopping)
            pass

    record.subscribe(wake)
    try:
        last = -1
        while True:
            changed.clear()
            for event in record.events_after(last, timeout=0):
                last = event.sequence
                yield event
                if event.type is EventType.OPERATION_FINISHED:
                    return
            await changed.wait()
    finally:
        record.unsubscribe(wake)
