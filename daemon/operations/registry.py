"""OperationRegistry: starts operations, finds them, and keeps one operation per process tree at a time.

Each operation runs on a thread of its own, named after it (``gpusnap-<id>``), not on a lane of
``gpusnap.daemon.executor``: the registry bounds them (``max_running_operations``), and :meth:`shutdown`
joins them; an operation waits on every lane, so it must not hold one.

Each operation runs on its own thread. Work is bounded by ``max_workers`` slots: an operation holds one
while it works and gives it back while it waits on something outside the daemon (a control directory, a
worker's agent: :meth:`PhaseRunner.waiting`), so waiting operations never keep others from working. A
non-root uid holds at most half of them (:class:`WorkSlots`), so others always find room (issue 19: one
user's fan-out restores held every slot, and root's dump went from 0.24 s to 7.65 s).
Callers are bounded too: at most ``max_per_caller`` operations of one uid, ``max_running`` in all, a
restore counting once per copy it makes (``weight``: each copy is a tree with a namespace init of root's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime

import structlog

from gpusnap.daemon.api import validate
from gpusnap.daemon.api.errors import AbortedError, NotFoundError, ResourceExhaustedError, UnavailableError
from gpusnap.daemon.api.types import FinishedOperation
from gpusnap.daemon.operations.base import EventType, OperationRecord, PhaseRunner, os_error
from gpusnap.daemon.operations.failpoints import NONE as NO_FAULTS
from gpusnap.daemon.operations.failpoints import Failpoints
from gpusnap.daemon.store.journal import Journal, kept

JOURNAL_TRIM_EVERY = 64
"""Finished operations between two trims of the journal to its newest entries."""
log = structlog.get_logger(__name__)


class WorkSlots:
    """The daemon's work slots, of which a non-root uid may hold at most ``max(1, total // 2)`` at once."""

    def __init__(self, total: int):
        self.total = total
        self.share = max(1, total // 2)
        self._all = threading.BoundedSemaphore(total)
        self._lock = threading.Lock()
        self._per_uid: dict[int, threading.BoundedSemaphore] = {}

    def of(self, uid: int) -> _UidSlot:
        """The slot ``uid``'s operations take and give back (root's: any of the daemon's)."""
        if uid == 0:
            return _UidSlot(self._all, None)
        with self._lock:
            mine = self._per_uid.setdefault(uid, threading.BoundedSemaphore(self.share))
        return _UidSlot(self._all, mine)


class _UidSlot:
    """One uid's way to a work slot: its own share first, then one of the daemon's."""

    def __init__(self, daemon_wide: threading.BoundedSemaphore, mine: threading.BoundedSemaphore | None):
        self._all, self._mine = daemon_wide, mine

    def acquire(self) -> bool:
        if self._mine is not None:
            self._mine.acquire()
        return self._all.acquire()

    def release(self) -> None:
        self._all.release()
        if self._mine is not None:
            self._mine.release()


class OperationRegistry:
    """All operations of this daemon's lifetime (finished ones as ``store.journal.kept`` keeps them: the newest
    256, and each caller's keyed ones for 24 h).

    Args:
        max_workers: operations that may do work at once (waiting ones excluded).
        max_per_caller: running operations of one uid.
        max_running: running operations in all, waiting ones included.
        journal: where operations are journaled (none: not at all).
        subscribers: each is called with every operation's end (:class:`FinishedOperation`, published once,
            from the operation's thread, in order: the park ladder, the metrics, the prefill); their
            exceptions are logged, never the operation's.
        failpoints: faults its operations meet at phase boundaries (``operations.failpoints``; tests).
    """

    def __init__(
        self,
        max_workers: int = 8,
        max_per_caller: int = 16,
        max_running: int = 256,
        journal: Journal | None = None,
        subscribers: Sequence[Callable[[FinishedOperation], None]] = (),
        failpoints: Failpoints = NO_FAULTS,
    ):
        self.journal = journal
        self.failpoints = failpoints
        self._subscribers = tuple(subscribers)
        self.slots = WorkSlots(max_workers)
        self._weights: dict[str, int] = {}
        """Running operations that count more than once against their caller (fan-out restores)."""
        self.max_per_caller, self.max_running = max_per_caller, max_running
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._ops: dict[str, OperationRecord] = {}
        self._claimed: dict[int, str] = {}
        self._by_request: dict[tuple[int, str, str], str] = {}
        """(owner uid, kind, request_id) -> operation id: a key is its caller's, for one kind of operation."""
        self._finished_count = 0
        self._closing = False
        """Set by :meth:`shutdown`: no operation starts any more."""

    def start(
        self, record: OperationRecord, pids: Iterable[int], body: Callable[[PhaseRunner], object], weight: int = 1
    ) -> OperationRecord:
        """Claim ``pids`` for ``record`` and run ``body`` in the background; a record whose idempotency key
        (``request_id``) this caller used before gets the earlier operation instead. ``weight``: how many
        of the caller's ``max_per_caller`` it takes (a restore's copies).

        Raises:
            AbortedError: another running operation holds one of ``pids`` (reason ``TREE_BUSY``).
            ResourceExhaustedError: the caller has ``max_per_caller`` operations running, or the daemon
                ``max_running`` (reason ``TOO_MANY_OPERATIONS``).
            UnavailableError: gpusnapd is stopping (reason ``DAEMON_UNAVAILABLE``): a call that outlived the
                server's grace period starts nothing the stop would cut short.
        """
        pids = list(pids)
        record.journal = self.journal
        with self._lock:
            if self._closing:
                raise UnavailableError(
                    "gpusnapd is stopping; retry once it is back (systemctl status gpusnapd)",
                    reason="DAEMON_UNAVAILABLE",
                )
            if record.request_id and _key(record) in self._by_request:
                earlier = self._ops.get(self._by_request[_key(record)])
                if earlier is not None:  # a retry: the original operation
                    return earlier
            self._check_room(record.owner_uid, weight)
            try:
                record.save()  # durable, with its idempotency key, before the caller hears of it
            except OSError as exc:
                raise os_error(exc, "") from exc
            # (an operation that has ended holds its PIDs only until its thread lets go of them: a caller woken by
            # its end may already start the next one on the same tree)
            busy = {p: self._claimed[p] for p in pids if p in self._claimed and not self._ended(self._claimed[p])}
            if busy:
                pid, other = next(iter(busy.items()))
                raise AbortedError(
                    f"PID {pid} is already part of running operation {other}; wait for it "
                    f"(`gpusnap wait {other}`) and try again",
                    reason="TREE_BUSY",
                    metadata={"pid": str(pid), "operation_id": other},
                )
            for p in pids:
                self._claimed[p] = record.id
            if weight > 1:
                self._weights[record.id] = weight
            self._add(record)
        self._run(record, pids, body)
        return record

    def find_request(self, owner_uid: int, kind: str, request_id: str) -> OperationRecord | None:
        """The operation of ``kind`` (``OperationKind`` value) ``owner_uid`` started with idempotency key
        ``request_id``, if this daemon (or its journal) knows it."""
        with self._lock:
            op_id = self._by_request.get((owner_uid, kind, request_id))
            return self._ops.get(op_id) if op_id else None

    def adopt(self, record: OperationRecord) -> None:
        """Know ``record`` (an operation recovered from the journal) without running anything. One that
        finished before this daemon started gets its final event, which waits and watches end on."""
        if record.done and not any(e.type is EventType.OPERATION_FINISHED for e in record.events):
            record.emit(EventType.OPERATION_FINISHED, phase=record.phase, message=str(record.error or ""))
        with self._lock:
            self._add(record)

    def resume(self, record: OperationRecord, pids: Iterable[int], body: Callable[[PhaseRunner], object]) -> None:
        """Run ``body`` as the rest of the recovered, unfinished ``record`` (claiming ``pids``)."""
        pids = list(pids)
        with self._lock:
            for p in pids:
                self._claimed[p] = record.id
            self._add(record)
        self._run(record, pids, body)

    def _add(self, record: OperationRecord) -> None:
        self._ops[record.id] = record
        if record.request_id:
            self._by_request[_key(record)] = record.id
        self._trim()

    def _run(self, record: OperationRecord, pids: list[int], body: Callable[[PhaseRunner], object]) -> None:
        def run() -> None:
            try:
                PhaseRunner(record, self.slots.of(record.owner_uid), self.failpoints).run(body)
                self._publish(record.ending())
            finally:
                with self._lock:
                    for p in pids:
                        if self._claimed.get(p) == record.id:
                            del self._claimed[p]
                    self._threads.pop(record.id, None)
                    self._weights.pop(record.id, None)
                    self._finished_count += 1
                    trim = self.journal is not None and self._finished_count % JOURNAL_TRIM_EVERY == 0
                if trim and self.journal is not None:
                    self.journal.trim()

        thread = threading.Thread(target=run, name=f"gpusnap-{record.id[:11]}")
        with self._lock:
            self._threads[record.id] = thread
        thread.start()

    def _publish(self, finished: FinishedOperation) -> None:
        """Hand an operation's end to every subscriber, each guarded: one's bug must not fail the operation or
        keep the end from the others."""
        for subscriber in self._subscribers:
            try:
                subscriber(finished)
            except Exception:
                log.exception("operation.observer_failed", operation_id=finished.id)

    def _ended(self, op_id: str) -> bool:
        op = self._ops.get(op_id)
        return op is not None and op.done

    def _check_room(self, uid: int, weight: int = 1) -> None:
        running = [r for r in self._ops.values() if not r.done]
        mine = sum(self._weights.get(r.id, 1) for r in running if r.owner_uid == uid)
        if mine + weight > self.max_per_caller:
            raise ResourceExhaustedError(
                f"uid {uid} already has {mine} operations running (the limit is {self.max_per_caller}, a restore "
                f"counting once per copy; this one needs {weight}); wait for one to end (`gpusnap ops`)",
                reason="TOO_MANY_OPERATIONS",
            )
        if len(running) >= self.max_running:
            raise ResourceExhaustedError(
                f"gpusnapd already runs {len(running)} operations (the limit is {self.max_running}); try again later",
                reason="TOO_MANY_OPERATIONS",
            )

    def get(self, op_id: str) -> OperationRecord:
        """The operation ``op_id``.

        Raises:
            InvalidArgumentError: malformed id.
            NotFoundError: unknown (or long finished) operation (reason ``OPERATION_NOT_FOUND``).
        """
        validate.operation_id(op_id)
        with self._lock:
            record = self._ops.get(op_id)
        if record is None:
            raise NotFoundError(f"no operation {op_id!r} in this daemon", reason="OPERATION_NOT_FOUND")
        return record

    def list(self) -> list[OperationRecord]:
        """Known operations, oldest first."""
        with self._lock:
            return sorted(self._ops.values(), key=lambda r: (r.started, r.id))

    def shutdown(self, wait: bool = True) -> None:
        """Start no operation any more (:meth:`start` raises ``UnavailableError``); with ``wait``, let the
        running ones finish (and roll back if they fail)."""
        with self._lock:
            self._closing = True
            threads = list(self._threads.values())
        if wait:
            for thread in threads:
                thread.join()

    def _trim(self) -> None:
        finished = [r for r in self._ops.values() if r.done]
        keep = kept([(r.id, r.owner_uid, r.request_id, r.started) for r in finished], datetime.now(UTC))
        for record in finished:
            if record.id in keep:
                continue
            del self._ops[record.id]
            if self._by_request.get(_key(record)) == record.id:
                del self._by_request[_key(record)]


def _key(record: OperationRecord) -> tuple[int, str, str]:
    return record.owner_uid, record.kind.value, record.request_id
