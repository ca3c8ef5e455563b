"""Per-caller limits on what one caller may hold of the gRPC server at a time.

A caller is a uid (TCP callers: root or anonymous). Unary calls run on the server's shared thread pool,
at most ``calls`` of one caller at a time; further calls of that caller wait for a turn without a thread,
and beyond ``queued`` waiting ones they fail at once. Streams (``WaitOperation``, ``WatchOperation``) hold
no thread at all; a caller may hold ``streams`` of them. Everything here runs on the server's event loop,
so no lock is needed.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from gpusnap.daemon.api.errors import ResourceExhaustedError


class CallerLimits:
    """Bounds per caller key.

    Args:
        calls: unary calls of one caller running at once.
        queued: calls of one caller waiting for a turn; more are refused (RESOURCE_EXHAUSTED).
        streams: open streams of one caller.
    """

    def __init__(self, calls: int, queued: int, streams: int):
        self.calls, self.queued, self.streams = calls, queued, streams
        self._turns: dict[int, asyncio.Semaphore] = {}
        self._waiting: collections.Counter[int] = collections.Counter()
        self._running: collections.Counter[int] = collections.Counter()
        self._open: collections.Counter[int] = collections.Counter()

    @asynccontextmanager
    async def call(self, key: int) -> AsyncIterator[None]:
        """Hold one of ``key``'s call turns for the block.

        Raises:
            ResourceExhaustedError: ``queued`` calls of this caller already wait (reason ``TOO_MANY_CALLS``).
        """
        turns = self._turns.setdefault(key, asyncio.Semaphore(self.calls))
        if turns.locked() and self._waiting[key] >= self.queued:
            raise ResourceExhaustedError(
                f"this caller already has {self.calls} calls running and {self.queued} waiting; wait for their "
                "answers before sending more",
                reason="TOO_MANY_CALLS",
            )
        self._waiting[key] += 1
        try:
            await turns.acquire()
        finally:
            self._waiting[key] -= 1
        self._running[key] += 1
        try:
            yield
        finally:
            turns.release()
            self._running[key] -= 1
            if not self._waiting[key] and not self._running[key]:  # idle: forget it
                del self._turns[key], self._waiting[key], self._running[key]

    @contextmanager
    def stream(self, key: int) -> Iterator[None]:
        """Count one open stream of ``key`` for the block.

        Raises:
            ResourceExhaustedError: the caller holds ``streams`` already (reason ``TOO_MANY_STREAMS``).
        """
        if self._open[key] >= self.streams:
            raise ResourceExhaustedError(
                f"this caller already has {self.streams} streams open (gpusnap wait/watch); close some, or raise "
                "max_streams_per_caller",
                reason="TOO_MANY_STREAMS",
            )
        self._open[key] += 1
        try:
            yield
        finally:
            self._open[key] -= 1
            if not self._open[key]:
                del self._open[key]
