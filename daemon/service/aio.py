"""The gRPC server on asyncio (``grpc.aio``), so that no caller can hold the threads every caller needs.

grpcio's synchronous server runs every call, streams included, on one thread of its pool until the call
ends: 32 ``gpusnap wait`` streams on one long operation took all 32 threads and every other RPC of every
user waited (measured: tests/daemon/service/test_stalls.py). Here the server runs on its own event loop:

- every servicer is a coroutine on the loop (``gpusnap.daemon.service.servicers``): ``WaitOperation`` and
  ``WatchOperation`` are woken by the operation's events and hold no thread; every other RPC does its work
  on the daemon's ``rpc`` lane, at most ``max_calls_per_caller`` of one caller at a time
  (``gpusnap.daemon.service.limits.CallerLimits``); further calls of that caller wait without a thread;
- a response the client does not read waits in the loop, not on a thread; its bytes count against its
  connection and its caller until sent, and a call over either bound waits before it runs
  (``CallerLimits.room``), so a caller that never reads cannot pin the daemon's memory.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from gpusnap.daemon.service.limits import CallerLimits

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
    """A ``grpc.aio`` server on its own event-loop thread. Its handlers are coroutines only (the servicers do
    their work on gpusnapd's ``rpc`` lane, whose owner stops it after :meth:`stop`).

    The loop's thread is this server's own (a dedicated thread: the loop runs for the server's life and
    :meth:`stop` joins it).

    Args:
        max_streams: HTTP/2 concurrent streams per connection (``grpc.max_concurrent_streams``); more are
            refused (``REFUSED_STREAM``: the client sees UNAVAILABLE). It bounds streams whose request never
            arrives, which no caller limit sees; it should be at least what one caller may have in flight,
            so that a caller's own limits answer first (:func:`streams_per_connection`).
        options: gRPC channel arguments for the server.
    """

    def __init__(self, max_streams: int, options: tuple[tuple[str, Any], ...] = ()):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gpusnap-grpc", daemon=True)
        self._thread.start()
        all_options = (("grpc.max_concurrent_streams", max_streams), *options)

        async def make() -> grpc.aio.Server:
            return grpc.aio.server(options=all_options)

        self.server: grpc.aio.Server = self.run(make())

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30) -> T:
        """Run ``coro`` on the server's loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    def start(self) -> None:
        self.run(self.server.start())

    def stop(self, grace: float) -> None:
        """Stop the server (in-flight calls get ``grace`` seconds), then the loop."""
        try:
            self.run(self.server.stop(grace), timeout_s=grace + 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
