"""The gRPC server on asyncio (``grpc.aio``), so that no caller can hold the threads every caller needs.

grpcio's synchronous server runs every call, streams included, on one thread of its pool until the call
ends: 32 ``gpusnap wait`` streams on one long operation took all 32 threads and every other RPC of every
user waited (measured: tests/daemon/service/test_stalls.py). Here the server runs on its own event loop:

- ``WaitOperation`` and ``WatchOperation`` are coroutines woken by the operation's events
  (:meth:`OperationRecord.subscribe`); they hold no thread, and a caller may hold
  ``max_streams_per_caller`` of them;
- every other RPC is the synchronous servicer method (``gpusnap.daemon.service.servicers``) run on the
  shared thread pool, at most ``max_calls_per_caller`` of one caller at a time (:class:`CallerLimits`);
  further calls of that caller wait without a thread;
- a response the client does not read waits in the loop, not on a thread; its bytes count against its
  connection and its caller until sent, and a call over either bound waits before it runs
  (:meth:`CallerLimits.room`), so a caller that never reads cannot pin the daemon's memory.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc
import structlog
from grpc_status import rpc_status

from gpusnap.daemon._proto import operations_pb2
from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.api.status import to_status_proto
from gpusnap.daemon.api.types import Caller
from gpusnap.daemon.operations.base import EventType, OperationRecord
from gpusnap.daemon.service import convert
from gpusnap.daemon.service.limits import CallerLimits
from gpusnap.daemon.service.servicers import OperationServicer, _Base

log = structlog.get_logger(__name__)
T = TypeVar("T")


class _PeerGone(logging.Filter):
    """Drop grpc core's traceback for a response that could not be sent because the client went away
    (``ExecuteBatchError``): an ordinary event on a server facing untrusted clients, not a daemon fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "ExecuteBatchError" not in record.getMessage()


logging.getLogger("grpc._cython.cygrpc").addFilter(_PeerGone())


def streams_per_connection(limits: CallerLimits) -> int:
    """HTTP/2 streams one connection may hold open: what one caller may have in flight over all its
    connections (unary calls running and waiting, and streams). A cap of 100 made more than 100 concurrent
    calls on one connection fail UNAVAILABLE (1-4 % of a 200-call burst, up to 10 % on fresh connections,
    where the client sends before it has the server's SETTINGS), well inside the caller's limits."""
    return limits.calls + limits.queued + limits.streams


class AioServer:
    """A ``grpc.aio`` server on its own event-loop thread, with a thread pool for synchronous handlers.

    The loop's thread is this server's own (a dedicated thread: the loop runs for the server's life and
    :meth:`stop` joins it); the pool is gpusnapd's ``rpc`` lane (``gpusnap.daemon.executor``), whose owner
    stops it after :meth:`stop`.

    Args:
        executor: the pool for synchronous handlers, shared by every caller's unary calls.
        max_streams: HTTP/2 concurrent streams per connection (``grpc.max_concurrent_streams``); more are
            refused (``REFUSED_STREAM``: the client sees UNAVAILABLE). It bounds streams whose request never
            arrives, which no caller limit sees; it should be at least what one caller may have in flight,
            so that a caller's own limits answer first (:func:`streams_per_connection`).
        options: gRPC channel arguments for the server.
    """

    def __init__(self, executor: ThreadPoolExecutor, max_streams: int, options: tuple[tuple[str, Any], ...] = ()):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gpusnap-grpc", daemon=True)
        self._thread.start()
        self.executor = executor
        all_options = (("grpc.max_concurrent_streams", max_streams), *options)

        async def make() -> grpc.aio.Server:
            return grpc.aio.server(migration_thread_pool=self.executor, options=all_options)

        self.server: grpc.aio.Server = self.run(make())

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30) -> T:
        """Run ``coro`` on the server's loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    def start(self) -> None:
        self.run(self.server.start())

    def stop(self, grace: float) -> None:
        """Stop the server (in-flight calls get ``grace`` seconds), then the loop (the pool is its owner's)."""
        try:
            self.run(self.server.stop(grace), timeout_s=grace + 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


class _Aborted(grpc.RpcError):
    """Raised by :class:`_SyncContext` where a synchronous context's ``abort`` would raise."""

    def __init__(self, status: grpc.Status):
        super().__init__(status.details)
        self.status = status


class _SyncContext:
    """What a synchronous servicer method may use of its call, taken from the asyncio context on the loop
    (peer, auth context, metadata) before the method runs on a pool thread; ``abort*`` raise."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any]):
        self._peer = context.peer()
        self._auth = context.auth_context()
        self._metadata = context.invocation_metadata()
        self.trailing: Any = None

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> Mapping[str, Any]:
        return self._auth

    def invocation_metadata(self) -> Any:
        return self._metadata

    def is_active(self) -> bool:
        return True

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = metadata

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        raise _Aborted(status)

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise _Aborted(_Status(code, details, ()))


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Any):
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


async def _abort(context: grpc.aio.ServicerContext[Any, Any], err: GpusnapError) -> NoReturn:
    await context.abort_with_status(rpc_status.to_status(to_status_proto(err)))
    raise AssertionError("unreachable")  # abort_with_status raises


def caller_key(caller: Caller) -> int:
    """The key limits count a caller under: its uid (anonymous TCP callers share one key)."""
    return caller.uid


class AsyncServicer:
    """The asyncio face of a synchronous servicer: attribute ``Name`` is an async handler for RPC ``Name``.

    Native handlers (streams) come from ``native``; every other method of ``sync`` runs on the pool.
    """

    def __init__(
        self,
        sync: _Base,
        server: AioServer,
        limits: CallerLimits,
        native: Mapping[str, Callable[..., Any]] | None = None,
    ):
        self._sync, self._server, self._limits = sync, server, limits
        self._native = dict(native or {})

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._native:
            return self._native[name]
        method = getattr(self._sync, name)

        async def handler(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            shim = _SyncContext(context)
            try:
                key = caller_key(self._sync.caller(shim))  # type: ignore[arg-type]
                async with self._limits.call(key):
                    await self._limits.room(key, shim.peer())  # the caller's earlier answers read first
                    response = await asyncio.get_running_loop().run_in_executor(
                        self._server.executor, method, request, shim
                    )
            except GpusnapError as err:
                await _abort(context, err)
            except _Aborted as aborted:
                await context.abort(aborted.status.code, aborted.status.details, aborted.status.trailing_metadata or ())
            if shim.trailing is not None:
                context.set_trailing_metadata(shim.trailing)
            sent = self._limits.unsent(key, shim.peer(), response.ByteSize())
            context.add_done_callback(lambda _call: sent())  # type: ignore[arg-type]  # sent, or the call ended
            return response

        handler.__name__ = name
        return handler


class OperationStreams:
    """``WaitOperation`` and ``WatchOperation`` as coroutines over an operation's events."""

    def __init__(self, sync: OperationServicer, limits: CallerLimits):
        self._sync, self._limits = sync, limits

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {"WaitOperation": self.WaitOperation, "WatchOperation": self.WatchOperation}

    def _record(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> tuple[int, OperationRecord]:
        caller = self._sync.caller(_SyncContext(context))  # type: ignore[arg-type]
        return caller_key(caller), self._sync.daemon.operation(request.id, caller)

    async def WaitOperation(
        self, request: operations_pb2.WaitOperationRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> operations_pb2.WaitOperationResponse:
        try:
            key, record = self._record(request, context)
            with self._limits.stream(key):
                async for _ in _events(record):
                    pass
        except GpusnapError as err:
            await _abort(context, err)
        return operations_pb2.WaitOperationResponse(operation=convert.operation(record))

    async def WatchOperation(
        self, request: operations_pb2.WatchOperationRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[operations_pb2.WatchOperationResponse]:
        try:
            key, record = self._record(request, context)
            with self._limits.stream(key):
                async for event in _events(record):
                    yield operations_pb2.WatchOperationResponse(event=convert.event(record, event))
        except GpusnapError as err:
            await _abort(context, err)


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
