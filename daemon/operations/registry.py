"""OperationRegistry: starts operations on a bounded executor, finds them, and keeps one operation
per process tree at a time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import structlog

from gpusnap.daemon.api import validate
from gpusnap.daemon.api.errors import AbortedError, NotFoundError
from gpusnap.daemon.operations.base import OperationRecord, PhaseRunner

KEEP_FINISHED = 256
log = structlog.get_logger(__name__)


class OperationRegistry:
    """All operations of this daemon's lifetime (the last ``KEEP_FINISHED`` finished ones are kept).

    Args:
        max_workers: operations that may run at once.
        on_finished: called with each record once it has finished (metrics); its exceptions are logged.
    """

    def __init__(self, max_workers: int = 8, on_finished: Callable[[OperationRecord], None] | None = None):
        self._on_finished = on_finished
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="gpusnap-op")
        self._lock = threading.Lock()
        self._ops: dict[str, OperationRecord] = {}
        self._claimed: dict[int, str] = {}

    def start(self, record: OperationRecord, pids: Iterable[int], body: Callable[[PhaseRunner], object]) -> OperationRecord:
        """Claim ``pids`` for ``record`` and run ``body`` in the background.

        Raises:
            AbortedError: another running operation holds one of ``pids`` (reason ``TREE_BUSY``).
        """
        pids = list(pids)
        with self._lock:
            busy = {p: self._claimed[p] for p in pids if p in self._claimed}
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
            self._ops[record.id] = record
            self._trim()

        def run() -> None:
            try:
                PhaseRunner(record).run(body)
                if self._on_finished is not None:
                    try:
                        self._on_finished(record)
                    except Exception:  # a metrics bug must not fail the operation
                        log.exception("operation.observer_failed", operation_id=record.id)
            finally:
                with self._lock:
                    for p in pids:
                        if self._claimed.get(p) == record.id:
                            del self._claimed[p]

        self._executor.submit(run)
        return record

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
        """Stop accepting work; with ``wait`` let running operations finish."""
        self._executor.shutdown(wait=wait, cancel_futures=False)

    def _trim(self) -> None:
        finished = [r for r in self._ops.values() if r.done]
        for record in sorted(finished, key=lambda r: r.started)[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._ops[record.id]
