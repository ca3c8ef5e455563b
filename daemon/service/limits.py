"""Per-caller limits on what one caller may hold of the gRPC server at a time.

A caller is a uid (TCP callers: root or anonymous). Unary calls run on the server's shared thread pool,
at most ``calls`` of one caller at a time; further calls of that caller wait for a turn without a thread,
and beyond ``queued`` waiting ones they fail at once. Streams (``WaitOperation``, ``WatchOperation``) hold
no thread at all; a caller may hold ``streams`` of them.

An answer stays in the daemon until the caller has read it, whatever HTTP/2 flow-control windows the
caller advertised: a caller that sends calls and never reads would otherwise pin gigabytes (issue 19:
three raw connections took gpusnapd from 116 MB to 2.46 GB). So the bytes of answers made and not yet
sent are counted per connection and per caller (:meth:`CallerLimits.unsent`); a call whose connection
holds ``unsent_per_connection`` bytes, or whose caller holds ``unsent_per_caller``, waits before it runs
(without a thread) until the caller reads. Everything here runs on the server's event loop, so no lock is
needed.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

from gpusnap.daemon.api.errors import ResourceExhaustedError


class CallerLimits:
    """Bounds per caller key.

    Args:
        calls: unary calls of one caller running at once.
        queued: calls of one caller waiting for a turn; more are refused (RESOURCE_EXHAUSTED).
        streams: open streams of one caller.
    """

    def __init__(
        self, calls: int, queued: int, streams: int, unsent_per_connection: int = 0, unsent_per_caller: int = 0
    ):
        self.calls, self.queued, self.streams = calls, queued, streams
        self.unsent_per_connection, self.unsent_per_caller = unsent_per_connection, unsent_per_caller
        self._unsent_by_connection: collections.Counter[str] = collections.Counter()
        self._unsent_by_key: collections.Counter[int] = collections.Counter()
        self._sent_waiters: list[asyncio.Future[None]] = []
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

    def _over(self, key: int, connection: str) -> bool:
        return (0 < self.unsent_per_connection <= self._unsent_by_connection[connection]) or (
            0 < self.unsent_per_caller <= self._unsent_by_key[key]
        )

    async def room(self, key: int, connection: str) -> None:
        """Wait until ``connection`` and caller ``key`` hold fewer unsent answer bytes than their bounds."""
        while self._over(key, connection):
            waiter = asyncio.get_running_loop().create_future()
            self._sent_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._sent_waiters:
                    self._sent_waiters.remove(waiter)

    def unsent(self, key: int, connection: str, size: int) -> Callable[[], None]:
        """Count an answer of ``size`` bytes as unsent; the returned function (call it once the answer is
        sent or the call ended) takes it off again and wakes the calls waiting in :meth:`room`."""
        self._unsent_by_connection[connection] += size
        self._unsent_by_key[key] += size
        done = False

        def sent() -> None:
            nonlocal done
            if done:
                return
            done = True
            self._unsent_by_connection[connection] -= size
            if self._unsent_by_connection[connection] <= 0:
                del self._unsent_by_connection[connection]
            self._unsent_by_key[key] -= size
            if self._unsent_by_key[key] <= 0:
                del self._unsent_by_key[key]
            waiters, self._sent_waiters = self._sent_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

        return sent
