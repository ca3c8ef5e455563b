"""What every operation shares: its record, its event log, and a phase runner with rollback.

An operation is a sequence of named phases. Each phase is timed and announced as events
(``PHASE_STARTED`` / ``PHASE_FINISHED`` / ``PHASE_FAILED``). Work that must be undone if a later phase
fails registers an undo step; on failure the undo steps run in reverse order, each guarded, so one
failing undo never skips the rest (containerd's deferred cleanup on a detached context, done here
with plain threads: operations never observe RPC cancellation).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

import structlog

from gpusnap.daemon.api.errors import CancelledError, GpusnapError, InternalError, ResourceExhaustedError
from gpusnap.daemon.api.types import EventType as EventType
from gpusnap.daemon.api.types import FinishedOperation, PhaseTiming, RestoreResult, Snapshot
from gpusnap.daemon.api.types import OperationKind as OperationKind
from gpusnap.daemon.api.types import OperationState as OperationState
from gpusnap.daemon.operations.failpoints import NONE as NO_FAULTS
from gpusnap.daemon.operations.failpoints import Failpoints
from gpusnap.daemon.park.standbys import Standby
from gpusnap.daemon.store import facts as journaled
from gpusnap.daemon.store.facts import CaptureFacts, Facts, RestoreFacts, TransferFacts
from gpusnap.daemon.store.journal import Entry, EntryError, EntryResult, Journal

F = TypeVar("F", CaptureFacts, RestoreFacts, TransferFacts)


class Phase(enum.StrEnum):
    """Every phase an operation runs, by the name its events, journal entry, timings and failpoints carry (a
    fan-out copy's get ``#<i>`` appended: ``restore#0``). The module docstring of each operation gives its order."""

    PREFLIGHT = "preflight"
    WAIT_READY = "wait-ready"
    WARM_UP = "warm-up"
    QUIESCE = "quiesce"
    OFFLOAD = "offload"
    GPU_LOCK = "gpu-lock"
    GPU_CHECKPOINT = "gpu-checkpoint"
    DUMP = "dump"
    DEV_SHM = "dev-shm"
    CHECKSUM = "checksum"
    PUBLISH = "publish"
    FINISH = "finish"
    GPU_RESUME = "gpu-resume"
    FETCH_BUFFERS = "fetch-buffers"
    VERIFY = "verify"
    RESTORE = "restore"
    WAKE = "wake"
    GPU_RESTORE = "gpu-restore"
    GPU_UNLOCK = "gpu-unlock"
    VALIDATE = "validate"
    RELOAD_BUFFERS = "reload-buffers"
    RESUME_WORKER = "resume-worker"
    UPLOAD = "upload"
    DOWNLOAD = "download"


@dataclasses.dataclass(frozen=True)
class OperationEvent:
    """One event of an operation; ``sequence`` counts from 0 within the operation."""

    sequence: int
    type: EventType
    time: datetime
    phase: str = ""
    duration_seconds: float = 0.0
    bytes: int = 0
    total_bytes: int = 0
    message: str = ""
    bytes_per_second: float = 0.0


def new_operation_id() -> str:
    """A fresh id: ``op-`` + 26 lowercase base32 characters."""
    return "op-" + base64.b32encode(os.urandom(16)).decode().lower().rstrip("=")


class OperationRecord:
    """The state of one operation, shared between its worker thread and any number of watchers."""

    def __init__(
        self,
        kind: OperationKind,
        *,
        target_pid: int = 0,
        target_snapshot: str = "",
        owner_uid: int = 0,
        request_id: str = "",
        journal: Journal | None = None,
        dry_run: bool = False,
    ):
        self.id = new_operation_id()
        self.dry_run = dry_run
        """A checkpoint that runs its preflight only (``dump --dry-run``)."""
        self.request_id = request_id
        self.journal = journal
        self.facts: Facts = journaled.empty(kind)
        """What recovery needs after a daemon crash (PIDs frozen or locked, the tree restored, …): written
        through :meth:`note` only."""
        self._facts_lock = threading.Lock()
        self.cancel_requested = threading.Event()
        self.kind = kind
        self.target_pid = target_pid
        self.target_snapshot = target_snapshot
        self.owner_uid = owner_uid
        self.started = datetime.now(UTC)
        self.finished: datetime | None = None
        self.state = OperationState.RUNNING
        self.phase = ""
        self.phases: list[PhaseTiming] = []
        self.result: Any = None
        self.error: GpusnapError | None = None
        self.events: list[OperationEvent] = []
        self._cond = threading.Condition()
        self._listeners: list[Callable[[], None]] = []
        self.cancel_note = ""
        """Once a cancel was requested: what it does (:meth:`request_cancel`)."""
        self.stops_now = False
        """A block that watches for a cancel request itself runs (:meth:`PhaseRunner.stoppable`): it stops at once."""
        self.past_return = ""
        """Why a cancel can no longer roll the operation back, once it cannot (:meth:`PhaseRunner.commit`)."""
        self._cancel_lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self.state is not OperationState.RUNNING

    def emit(self, type: EventType, **fields: Any) -> OperationEvent:
        """Append an event and wake watchers."""
        with self._cond:
            event = OperationEvent(sequence=len(self.events), type=type, time=datetime.now(UTC), **fields)
            self.events.append(event)
            self._cond.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()
        return event

    def request_cancel(self) -> str:
        """Ask the operation to stop and roll back (``cancel_requested``); returns what that does now, in words (also
        ``cancel_note``, and a ``CANCEL_REQUESTED`` event when it changed): the running phase stops at once, or it
        cannot be interrupted and the operation rolls back once it ends (and why), or it is too late (and why).
        Empty for an operation that has ended."""
        with self._cancel_lock:
            if self.done:
                return ""
            self.cancel_requested.set()
            note = _cancel_note(self)
            changed = note != self.cancel_note
            self.cancel_note = note
        if changed:
            self.emit(EventType.CANCEL_REQUESTED, phase=self.phase, message=note)
        return note

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (from the emitting thread; it must not block) after every new event."""
        with self._cond:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[], None]) -> None:
        with self._cond:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def note(self, kind: type[F], update: Callable[[F], F]) -> None:
        """Change what recovery reads of this operation (its facts, of type ``kind``: ``gpusnap.daemon.store.facts``)
        to ``update(facts)``, durable before returning; the one way facts are written.

        Raises:
            TypeError: this operation's facts are not of type ``kind``.
        """
        with self._facts_lock:
            facts = self.facts
            if not isinstance(facts, kind):
                raise TypeError(f"a {self.kind.value} journals {type(facts).__name__}, not {kind.__name__}")
            self.facts = update(facts)
            self.save()

    @property
    def capture_facts(self) -> CaptureFacts:
        """The facts of a checkpoint, suspend or resume."""
        if not isinstance(self.facts, CaptureFacts):
            raise TypeError(f"a {self.kind.value} journals no capture facts")
        return self.facts

    @property
    def restore_facts(self) -> RestoreFacts:
        """The facts of a restore, activation or standby operation."""
        if not isinstance(self.facts, RestoreFacts):
            raise TypeError(f"a {self.kind.value} journals no restore facts")
        return self.facts

    def save(self) -> None:
        """Write this operation's journal entry (see ``gpusnap.daemon.store.journal``), if it has a journal."""
        if self.journal is not None:
            self.journal.write(self.to_entry())

    def save_phase(self) -> None:
        """Record the phase just entered in the journal, without ``fsync`` (recovery only quotes it)."""
        if self.journal is not None:
            self.journal.write_phase(self.id, self.phase)

    def to_entry(self) -> Entry:
        """The journal entry of this operation."""
        error = None
        if self.error is not None:
            error = EntryError(code=int(self.error.code), reason=self.error.reason, message=self.error.message)
        return Entry(
            self.id,
            self.kind,
            self.owner_uid,
            self.started,
            self.state,
            request_id=self.request_id,
            finished=self.finished.isoformat() if self.finished else "",
            phase=self.phase,
            target_pid=self.target_pid,
            target_snapshot=self.target_snapshot,
            dry_run=self.dry_run,
            facts=journaled.raw(self.facts),
            error=error,
            result=entry_result(self.result),
        )

    def finish(self, *, result: Any = None, error: GpusnapError | None = None) -> None:
        """Record the outcome (durably, when journaled) and emit the final event."""
        with self._cond:
            self.result = result
            self.error = error
            self.finished = datetime.now(UTC)
            if error is None:
                self.state = OperationState.SUCCEEDED
            else:
                self.state = OperationState.CANCELLED if isinstance(error, CancelledError) else OperationState.FAILED
        try:
            self.save()
        except OSError as exc:  # the outcome stands; recovery redoes the safe part after a restart
            structlog.get_logger(__name__).warning("journal.write_failed", operation_id=self.id, error=str(exc))
        self.emit(EventType.OPERATION_FINISHED, phase=self.phase, message=str(error) if error else "")

    def ending(self) -> FinishedOperation:
        """How this finished operation ended (its record stays with the registry; watchers keep reading it).

        Raises:
            RuntimeError: it has not finished.
        """
        with self._cond:
            if self.finished is None:
                raise RuntimeError(f"operation {self.id} has not finished")
            fields = (self.id, self.kind, self.state, self.owner_uid, self.target_pid, self.target_snapshot)
            return FinishedOperation(*fields, self.started, self.finished, tuple(self.phases), self.result, self.error)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation is done or ``timeout`` seconds pass; True if done."""
        with self._cond:
            return self._cond.wait_for(lambda: self.done, timeout=timeout)

    def events_after(self, sequence: int, timeout: float) -> list[OperationEvent]:
        """Events with ``sequence`` greater than the given one, waiting up to ``timeout`` s for one."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.events) > sequence + 1, timeout=timeout)
            return self.events[sequence + 1 :]


RUNS_ON: dict[str, tuple[str, str]] = {
    Phase.DUMP: (
        "CRIU is writing the frozen tree's images and cannot be stopped safely before it has",
        "then the source is resumed, before anything is published, and the images are dropped",
    ),
    Phase.GPU_LOCK: ("the CUDA driver's lock waits for the GPU work in flight", ""),
    Phase.GPU_CHECKPOINT: ("the CUDA driver's checkpoint cannot be interrupted", ""),
    Phase.GPU_RESTORE: ("the CUDA driver's restore cannot be interrupted", ""),
    Phase.WARM_UP: ("the worker's agent finishes its warm-up request first", ""),
    Phase.QUIESCE: ("the worker's agent finishes quiescing first", "then the worker is resumed"),
    Phase.OFFLOAD: ("the worker's agents finish writing out their buffers first", "then the worker is resumed"),
    Phase.RESTORE: (
        "CRIU restores into gpusnapd's own PID namespace (--host-pidns), where stopping it could leave processes "
        "behind",
        "then the restored tree is killed",
    ),
}
"""Phases that do not stop at once: why, and what the rollback does once they end (default: nothing to add)."""


def _cancel_note(record: OperationRecord) -> str:
    """What a cancel requested now does (:meth:`OperationRecord.request_cancel`)."""
    what, phase = record.kind.value, record.phase or "its start"
    if record.past_return:
        return f"too late to cancel: {record.past_return}; the {what} runs to its end"
    if record.stops_now:
        return f"stopping {phase} now; then the {what} rolls back what it did"
    why, then = RUNS_ON.get(phase.partition("#")[0], (f"{phase} cannot be interrupted", ""))
    return f"{why}; the {what} stops when {phase} ends and rolls back" + (f": {then}" if then else "")


def entry_result(result: Any) -> EntryResult | None:
    """An operation's result as its journal entry keeps it: a snapshot by id, a restore's trees, a resume's GPU
    map, a standby operation's standbys by id; None for the others (a suspend's, a transfer's)."""
    if isinstance(result, tuple) and result and all(isinstance(r, Standby) for r in result):
        return EntryResult(standbys=tuple(r.id for r in result))
    if isinstance(result, Snapshot):
        return EntryResult(snapshot_id=result.id)
    if isinstance(result, RestoreResult):
        return EntryResult(restore=result)
    if isinstance(result, dict):
        return EntryResult(gpu_map=dict(result))
    return None


class Slot(Protocol):
    """A work slot an operation takes and gives back (``threading.BoundedSemaphore``, or a uid's share of
    the daemon's: ``registry.WorkSlots``)."""

    def acquire(self) -> bool: ...

    def release(self) -> None: ...


@dataclasses.dataclass(eq=False)
class Undo:
    """One undo step of an operation (:meth:`PhaseRunner.on_failure`): ``action`` undoes a piece of its work if
    the operation fails. The code that makes that work permanent (or undoes it itself) holds the step and drops
    it; no step is named across modules."""

    name: str
    action: Callable[[], None]
    _runner: PhaseRunner

    def drop(self) -> None:
        """The work is permanent, or undone already: the step no longer runs on failure."""
        self._runner._forget(self)

    def run_now(self) -> None:
        """The work is done with: undo it now, success or not, and drop the step."""
        self.drop()
        self.action()


class PhaseRunner:
    """Runs an operation's phases, times them and keeps the undo stack.

    Args:
        record: the operation's record; phases and events are written to it.
        slots: the daemon's work slots; the operation holds one from start to end except inside
            :meth:`waiting` (none: no bound).
        failpoints: faults to meet at phase boundaries (tests; none by default).
    """

    def __init__(self, record: OperationRecord, slots: Slot | None = None, failpoints: Failpoints = NO_FAULTS):
        self.record = record
        self._slots = slots
        self.failpoints = failpoints
        """The faults injected at this operation's phase boundaries (``operations.failpoints``)."""
        self.log = structlog.get_logger("gpusnap.operation").bind(operation_id=record.id, kind=record.kind.value)
        self._undo: list[Undo] = []
        self._open: tuple[str, float, PhaseProgress] | None = None
        self.phase_suffix = ""
        """Appended to every phase name (``restore#2``: fan-out copy 2); see :meth:`for_copy`."""

    @contextmanager
    def for_copy(self, suffix: str) -> Iterator[None]:
        """Name the phases run inside the block ``<phase><suffix>``."""
        self.phase_suffix = suffix
        try:
            yield
        finally:
            self.phase_suffix = ""

    @contextmanager
    def phase(self, phase: Phase) -> Iterator[PhaseProgress]:
        """Run the block as ``phase``; set ``progress.bytes`` to report bytes moved.

        Before the block runs, the operation's journal names the phase (``Journal.write_phase``), and a requested
        cancellation ends the operation (``CancelledError``, then rollback).
        """
        name, start, progress = self._start(phase)
        try:
            yield progress
        except BaseException as exc:
            self._failed(name, start, exc)
            raise
        self._finished(name, start, progress)

    def open_phase(self, phase: Phase) -> PhaseProgress:
        """Start ``phase`` without a block (closing any phase opened this way before).

        For phases whose end is signalled by a callback, such as CRIU's ``post-dump`` notification.
        A phase left open when the operation fails is reported as failed.
        """
        self.close_phase()
        self._open = self._start(phase)
        return self._open[2]

    def close_phase(self) -> None:
        """Finish the phase opened by :meth:`open_phase`, if any."""
        opened, self._open = self._open, None
        if opened is not None:
            self._finished(*opened)

    def _fail_open_phase(self, exc: BaseException) -> None:
        opened, self._open = self._open, None
        if opened is not None:
            self._failed(opened[0], opened[1], exc)

    def _start(self, phase: Phase) -> tuple[str, float, PhaseProgress]:
        """A phase's start (see :meth:`phase`): its name, start time and progress."""
        self.check_cancelled()
        name = phase.value + self.phase_suffix
        self.record.phase = name
        self.record.save_phase()
        self.failpoints.hit(self.record.kind.value, name)
        self.record.emit(EventType.PHASE_STARTED, phase=name)
        return name, time.monotonic(), PhaseProgress(self.record, name)

    def _finished(self, name: str, start: float, progress: PhaseProgress) -> None:
        elapsed = time.monotonic() - start
        self.record.phases.append(PhaseTiming(phase=name, duration_seconds=elapsed, bytes=progress.bytes))
        self.record.emit(EventType.PHASE_FINISHED, phase=name, duration_seconds=elapsed, bytes=progress.bytes)
        self.log.info("phase.finished", phase=name, duration_s=round(elapsed, 4), bytes=progress.bytes)

    def _failed(self, name: str, start: float, exc: BaseException) -> None:
        elapsed = time.monotonic() - start
        self.record.emit(EventType.PHASE_FAILED, phase=name, duration_seconds=elapsed, message=str(exc))
        self.log.warning("phase.failed", phase=name, duration_s=round(elapsed, 4), error=str(exc))

    def check_cancelled(self, *, during: bool = False, last: bool = False) -> None:
        """Raise ``CancelledError`` if the operation's cancellation was requested (and it is not past its point of no
        return, :meth:`commit`): at a phase boundary (before the next phase starts), ``during`` the phase that
        watched for it and stopped, or at the end of the ``last`` phase."""
        if self.record.cancel_requested.is_set() and not self.record.past_return:
            phase = self.record.phase
            how = (
                f"during {phase}, which stopped"
                if during
                else f"during {phase}, its last phase, which ran to its end first"
                if last
                else f"after {phase} ended"
                if phase
                else "before it started"
            )
            raise self.cancelled(how)

    def cancelled(self, how: str) -> CancelledError:
        """The ``CancelledError`` this operation ends with, cancelled ``how`` (``"during restore, which stopped"``)."""
        return CancelledError(
            f"operation {self.record.id} was cancelled {how}; what it had done was rolled back", reason="CANCELLED"
        )

    def commit(self, why: str) -> None:
        """The point of no return: from here on a cancel cannot roll the operation back (``why``, e.g. "the snapshot
        is published and its source ends"), and says so; a cancel requested before raises ``CancelledError`` now.
        Atomic with :meth:`OperationRecord.request_cancel`."""
        with self.record._cancel_lock:
            self.check_cancelled()
            self.record.past_return = why

    @contextmanager
    def stoppable(self) -> Iterator[Callable[[], bool]]:
        """A block that watches for a cancel request itself (it polls what this yields) and stops at once when there
        is one: a cancel note then says so (:meth:`OperationRecord.request_cancel`)."""
        self.record.stops_now = True
        try:
            yield self.record.cancel_requested.is_set
        finally:
            self.record.stops_now = False

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """A block that waits on something outside the daemon (a worker, a control directory): the
        operation's work slot is free for others meanwhile, and taken again after."""
        if self._slots is None:
            yield
            return
        self._slots.release()
        try:
            yield
        finally:
            self._slots.acquire()

    def on_failure(self, name: str, action: Callable[[], None]) -> Undo:
        """Register ``action`` to run (in reverse order of registration) if the operation fails; returns the step,
        which whoever makes the work permanent drops (:meth:`Undo.drop`). ``name`` names it in ``ROLLBACK`` events."""
        undo = Undo(name, action, self)
        self._undo.append(undo)
        return undo

    def _forget(self, undo: Undo) -> None:
        self._undo = [u for u in self._undo if u is not undo]

    def rollback(self) -> list[str]:
        """Run the undo steps in reverse; returns messages of undo steps that failed."""
        failures = []
        while self._undo:
            step = self._undo.pop()
            name, undo = step.name, step.action
            start = time.monotonic()
            try:
                undo()
                msg = "done"
            except Exception as exc:  # keep undoing the rest
                msg = f"failed: {exc}"
                failures.append(f"{name}: {exc}")
            elapsed = time.monotonic() - start
            self.record.emit(EventType.ROLLBACK, phase=name, duration_seconds=elapsed, message=msg)
            self.log.warning("rollback", step=name, result=msg, duration_s=round(elapsed, 4))
        return failures

    def run(self, body: Callable[[PhaseRunner], Any]) -> None:
        """Run ``body`` holding a work slot; on failure roll back, then record the outcome on the operation."""
        if self._slots is not None:
            self._slots.acquire()
        try:
            self._run(body)
        finally:
            if self._slots is not None:
                self._slots.release()

    def _run(self, body: Callable[[PhaseRunner], Any]) -> None:
        try:
            self.record.save()  # durable before anything with side effects
            result = body(self)
            self.close_phase()
            self.check_cancelled(last=True)  # a cancel during the last phase rolls back too, as it said it would
        except Exception as exc:
            self._fail(exc)
            return
        self.record.finish(result=result)
        self.log.info(
            "operation.succeeded",
            total_s=round(sum(p.duration_seconds for p in self.record.phases), 4),
            phases={p.phase: round(p.duration_seconds, 4) for p in self.record.phases},
        )

    def _fail(self, exc: Exception) -> None:
        """The one failure path: the open phase reported failed, the undo steps run, and the operation
        finishes with ``exc`` as a domain error (:func:`as_error`), naming any undo step that failed too."""
        if not isinstance(exc, GpusnapError | OSError):  # a bug: its traceback goes to the log
            self.log.exception("operation.crashed")
        err = as_error(exc, self.record.phase)
        self._fail_open_phase(exc)
        failures = self.rollback()
        if failures:
            err.message += "; rollback also failed: " + "; ".join(failures)
        self.record.finish(error=err)


def as_error(exc: Exception, phase: str) -> GpusnapError:
    """``exc`` as the domain error an operation fails with: a ``GpusnapError`` as it is, an ``OSError`` as the
    host's refusal (:func:`os_error`), anything else as a bug (``INTERNAL``, naming the phase)."""
    if isinstance(exc, GpusnapError):
        return exc
    if isinstance(exc, OSError):  # the host said no: name the resource, not a bug
        return os_error(exc, phase)
    return InternalError(f"internal error in {phase or 'operation'}: {type(exc).__name__}: {exc}")


def os_error(exc: OSError, phase: str) -> GpusnapError:
    """A host-level failure as a domain error: out of space or quota is RESOURCE_EXHAUSTED."""
    where = f" during {phase}" if phase else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhaustedError(
            f"no space left{where} ({exc}); free space in the snapshot store or delete snapshots with `gpusnap rm`",
            reason="STORE_FULL",
        )
    return InternalError(f"{exc.strerror or exc}{where} ({exc.filename or 'no file'})", reason="HOST_IO_ERROR")


RATE_WINDOW_S = 2.0
"""A progress event's rate is over the bytes of about the last this many seconds."""
TICK_S = 0.5
"""Progress of a phase that is measured from outside (a CRIU dump's images as they grow) is read this often."""
EVENT_GAP_S = 0.1
"""Progress reported from inside a phase (chunks digested, sent) makes at most one event this often."""
RATE_MIN_S = 0.1
"""A rate is measured over at least this long (a shorter window says 0: not known yet)."""


@dataclasses.dataclass
class PhaseProgress:
    """Handle a phase body uses to report bytes moved (``bytes``) and progress events."""

    record: OperationRecord
    phase: str
    bytes: int = 0
    _samples: list[tuple[float, int]] = dataclasses.field(default_factory=lambda: [(time.monotonic(), 0)])
    """(monotonic time, bytes done) of the reports of about the last ``RATE_WINDOW_S``, oldest first; the phase
    started with none done."""
    _reported: bool = False

    def report(self, done: int, total: int, message: str = "", rate: float | None = None) -> None:
        """Emit a ``PROGRESS`` event: ``done`` of ``total`` bytes (0: not known), at ``rate`` bytes a second (default:
        measured over the reports of the last ``RATE_WINDOW_S``); ``message``: e.g. which process, how long."""
        now = time.monotonic()
        earlier = [(t, b) for t, b in self._samples if b <= done]
        recent = [(t, b) for t, b in earlier if now - t <= RATE_WINDOW_S]
        # the window's samples, and the last before it: a report after a long gap still has a rate
        self._samples = earlier[len(earlier) - len(recent) - 1 :] if len(earlier) > len(recent) else recent
        if rate is None:
            first_t, first_b = self._samples[0] if self._samples else (now, done)
            rate = (done - first_b) / (now - first_t) if now - first_t >= RATE_MIN_S else 0.0
        self._samples.append((now, done))
        self._reported = True
        self.record.emit(
            EventType.PROGRESS,
            phase=self.phase,
            bytes=done,
            total_bytes=total,
            message=message,
            bytes_per_second=max(rate, 0.0),
        )

    def ticks(self, total: int = 0) -> Callable[[int], None]:
        """A ``done`` callback for a phase measured from outside every ``TICK_S`` (a CRIU dump's images as they
        grow, a restore's reads): sets :attr:`bytes` and reports ``done`` of ``total`` when it changed."""

        def report(done: int) -> None:
            done = min(done, total) if total else done
            if done != self.bytes or not self._reported:
                self.bytes = done
                self.report(done, total)

        return report

    def every_percent(self) -> Callable[[int, int], None]:
        """A ``(done, total)`` callback that sets :attr:`bytes` and reports the first time, at the end, and between
        at most every 1% and every ``EVENT_GAP_S``."""
        last = [-1, 0.0]

        def report(done: int, total: int) -> None:
            self.bytes = done
            now = time.monotonic()
            first, step = last[0] < 0, done - last[0] >= max(1, total // 100) and now - last[1] >= EVENT_GAP_S
            if done == total or first or step:
                last[:] = [done, now]
                self.report(done, total)

        return report
