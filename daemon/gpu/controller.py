"""Ordering and rollback of CUDA checkpoint calls across the CUDA processes of one tree.

Sequences (docs/cuda-checkpoint.md, "The order of calls"; failure cases FC-02, FC-03, FC-12, FC-13, FC-15, FC-16,
FC-18 in docs/failure-cases.md)::

    capture:  lock(all) → checkpoint(all) → assert_ready_for_dump → [CRIU dump] → rollback_to_running (leave-running)
    restore:  [CRIU restore] → restore(all, gpu_pairs) → unlock(all) → verify_running
    kill:     release_gpus_for_kill (lock → checkpoint) → [SIGKILL]                          (FC-12)

Rules this module enforces:

* Every driver call runs under :func:`~gpusnap.daemon.drivers.deadline.call_with_deadline` (FC-03). Lock gets
  ``timeout_ms/1000 + call_timeout_s``; checkpoint/restore get ``transfer_timeout_s`` (they move all GPU memory
  over PCIe, ~1.5 GB/s D2H measured, see :func:`suggest_transfer_timeout_s`); the rest ``call_timeout_s``.
* A group is never left half-locked (FC-02): a failed lock unlocks the PIDs already locked (newest first) and
  then checks the failing PID; a failed checkpoint brings every PID back to RUNNING (restore + unlock those
  checkpointed, unlock the rest), so NOT_SUPPORTED (FC-15) leaves the worker running.
* A lock or checkpoint that returns only after its deadline is undone by a compensating action in the
  abandoned thread (unlock; restore + unlock), recorded in :attr:`GpuTreeController.late_actions`.
* Errors are re-raised with what the rollback did appended to the message and ``metadata`` (``rollback``,
  ``stranded_pids``), and, when the target vanished during the call, a "target died" note (FC-13).

Timings: each group method returns a :class:`StepTiming` (seconds, per PID).

A controller is meant for one operation at a time; it is not thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from gpusnap.daemon.api.errors import FailedPreconditionError, GpusnapError, InternalError, NotFoundError
from gpusnap.daemon.drivers.cuda import CudaCheckpointApi, CudaError, ProcessState
from gpusnap.daemon.drivers.deadline import call_with_deadline
from gpusnap.daemon.drivers.procfs import open_paths, pid_alive

T = TypeVar("T")

#: Device-file prefix a CUDA process holds until it is checkpointed (``/dev/nvidia0``, ``/dev/nvidiactl``,
#: ``/dev/nvidia-uvm``, ``/dev/nvidia-caps/…``).
NVIDIA_DEVICE_PREFIX = "/dev/nvidia"

_CALL_NAMES = {
    "lock": "cuCheckpointProcessLock",
    "checkpoint": "cuCheckpointProcessCheckpoint",
    "restore": "cuCheckpointProcessRestore",
    "unlock": "cuCheckpointProcessUnlock",
}

_FAILED_REMEDY = (
    "CUDA state FAILED is terminal: the process's GPU state is lost; kill and restart the worker (keep any "
    "snapshot image)"
)
_LOCKED_REMEDY = "a LOCKED process blocks on its next CUDA call: kill the worker tree if unlocking keeps failing"
_CHECKPOINTED_REMEDY = (
    "a CHECKPOINTED process has no GPU state and blocks on its next CUDA call: retry the restore onto its "
    "original GPUs or kill it"
)


def suggest_transfer_timeout_s(gpu_bytes: int, *, floor_s: float = 60.0, bytes_per_s: float = 0.5e9) -> float:
    """A deadline for one checkpoint or restore call that moves ``gpu_bytes`` of device memory.

    Args:
        gpu_bytes: device memory the process holds (NVML ``usedGpuMemory``), in bytes.
        floor_s: fixed allowance in seconds for context teardown/creation.
        bytes_per_s: pessimistic copy rate; an H200 moved 16 GiB at ≈2.2 GB/s device → host and ≈5.5 GB/s
            host → device (docs/cuda-checkpoint.md, "Host memory and copy rates").

    Returns:
        Seconds: ``floor_s + gpu_bytes / bytes_per_s``.
    """
    return floor_s + max(gpu_bytes, 0) / bytes_per_s


@dataclass(frozen=True)
class StepTiming:
    """How long one group step took.

    Attributes:
        step: ``"lock"``, ``"checkpoint"``, ``"verify_dump"``, ``"restore"``, ``"unlock"`` or ``"verify"``.
        seconds: wall-clock duration of the whole step, in seconds.
        per_pid: seconds spent in the driver call(s) for each PID.
    """

    step: str
    seconds: float
    per_pid: Mapping[int, float] = field(default_factory=dict)


@dataclass
class RollbackResult:
    """Outcome of :meth:`GpuTreeController.rollback_to_running` or :meth:`~GpuTreeController.release_gpus_for_kill`.

    Attributes:
        states: final state per PID as last read or reached; ``None`` = unknown (call failed or hung).
        actions: driver calls issued, in order, e.g. ``["restore(12)", "unlock(12)"]``.
        problems: one sentence per PID that did not reach the goal, with a remedy.
        seconds: wall-clock duration.
        goal: the state every PID should be in (RUNNING for rollback, CHECKPOINTED for kill preparation).
    """

    states: dict[int, ProcessState | None] = field(default_factory=dict)
    actions: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    goal: ProcessState = ProcessState.RUNNING

    @property
    def ok(self) -> bool:
        """True when every PID reached :attr:`goal` and nothing went wrong."""
        return not self.problems and all(s == self.goal for s in self.states.values())

    @property
    def stranded(self) -> list[int]:
        """PIDs that did not reach :attr:`goal`."""
        return [pid for pid, s in self.states.items() if s != self.goal]

    def summary(self) -> str:
        """One line for error messages, e.g. ``"rollback: unlock(12); all 2 process(es) RUNNING"``."""
        did = ", ".join(self.actions) if self.actions else "nothing to undo"
        if self.ok:
            return f"rollback: {did}; all {len(self.states)} process(es) {self.goal.name}"
        return f"rollback: {did}; NOT all {self.goal.name}: " + "; ".join(self.problems)

    def raise_for_problems(self) -> None:
        """Raise when :attr:`ok` is false.

        Raises:
            FailedPreconditionError: reason ``GPU_ROLLBACK_INCOMPLETE``, metadata ``stranded_pids``.
        """
        if not self.ok:
            raise FailedPreconditionError(
                f"could not bring every CUDA process to {self.goal.name}: " + "; ".join(self.problems),
                reason="GPU_ROLLBACK_INCOMPLETE",
                metadata={"stranded_pids": ",".join(map(str, self.stranded))},
            )


def _unique(pids: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(int(p) for p in pids))


def _reraise(err: GpusnapError, cause: BaseException) -> NoReturn:
    """Raise ``err``, chained to ``cause`` unless it *is* ``cause`` (annotated in place)."""
    if err is cause:
        raise err
    raise err from cause


def _annotate(err: GpusnapError, note: str, **metadata: str) -> GpusnapError:
    """Append ``note`` to ``err``'s message (keeping its class, reason and code) and merge ``metadata``."""
    err.message = f"{err.message}. {note}" if note else err.message
    err.args = (err.message,)
    err.metadata.update(metadata)
    return err


class GpuTreeController:
    """Drives :class:`~gpusnap.daemon.drivers.cuda.CudaCheckpointApi` across the CUDA PIDs of one tree.

    Args:
        api: the driver (``CudaDriver`` in the daemon, a fake in tests).
        call_timeout_s: deadline in seconds for quick calls (get_state, restore thread id, unlock) and the
            slack added to a lock's own ``timeout_ms``.
        transfer_timeout_s: default deadline in seconds for checkpoint and restore calls; ``None`` = use
            ``call_timeout_s``. Per-call overrides: ``timeout_s`` of :meth:`checkpoint_all`/:meth:`restore_all`.
        proc_root: ``/proc`` (tests pass a fake tree); ``None`` disables liveness checks.
        clock: monotonic clock in seconds.
    """

    def __init__(
        self,
        api: CudaCheckpointApi,
        *,
        call_timeout_s: float,
        transfer_timeout_s: float | None = None,
        proc_root: Path | None = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s!r}")
        self.api = api
        self.call_timeout_s = call_timeout_s
        self.transfer_timeout_s = transfer_timeout_s if transfer_timeout_s is not None else call_timeout_s
        self.proc_root = proc_root
        self._clock = clock
        #: Compensating actions run by abandoned (late) calls, e.g. ``"late lock(12) succeeded: unlocked"``.
        self.late_actions: list[str] = []
        self._late_lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ discovery

    def find_cuda_pids(self, pids: Iterable[int], *, nvml_pids: Collection[int] | None = None) -> list[int]:
        """The CUDA processes among ``pids``: those for which ``cuCheckpointProcessGetRestoreThreadId`` works.

        Args:
            pids: candidate PIDs (e.g. the whole tree), any order; duplicates ignored.
            nvml_pids: PIDs NVML lists as compute processes, to cross-check; ``None`` skips the check.

        Returns:
            The CUDA PIDs in the order given.

        Raises:
            FailedPreconditionError: a PID NVML shows using a GPU is not a checkpointable CUDA process (reason
                ``GPU_PROCESS_NOT_CHECKPOINTABLE``): it may use the GPU without CUDA, through MPS, or live in
                another PID namespace.
            DeadlineExceededError: the driver did not answer (the driver is wedged; nothing was changed).
        """
        found: list[int] = []
        rejected: dict[int, str] = {}
        for pid in _unique(pids):
            try:
                self._call("cuCheckpointProcessGetRestoreThreadId", pid, self.api.get_restore_thread_id, pid)
            except CudaError as exc:
                rejected[pid] = exc.result_name
            else:
                found.append(pid)
        if nvml_pids is not None:
            bad = [pid for pid in rejected if pid in set(nvml_pids)]
            if bad:
                detail = ", ".join(f"{pid} ({rejected[pid]})" for pid in bad)
                raise FailedPreconditionError(
                    f"process(es) {detail} hold GPU memory according to NVML but the CUDA driver reports no "
                    "checkpointable CUDA context: they may use the GPU without CUDA (graphics/Vulkan), through MPS, "
                    "or sit in another PID namespace than gpusnapd; stop them or leave them out of the tree",
                    reason="GPU_PROCESS_NOT_CHECKPOINTABLE",
                    metadata={"pids": ",".join(map(str, bad))},
                )
        return found

    # ------------------------------------------------------------------------------------------ capture

    def lock_all(self, pids: Sequence[int], timeout_ms: int) -> StepTiming:
        """Lock every PID, in order, as one group (FC-02).

        Args:
            pids: the CUDA PIDs of the tree, all RUNNING.
            timeout_ms: driver-side lock timeout per PID in milliseconds (0 = none); the external deadline is
                ``timeout_ms/1000 + call_timeout_s``.

        Returns:
            Step ``"lock"``.

        Raises:
            CudaError: a lock failed (e.g. timeout result, ILLEGAL_STATE, NOT_SUPPORTED); the PIDs already locked
                were unlocked (message and ``metadata["rollback"]`` say how that went).
            DeadlineExceededError: a lock did not return in time; same rollback; if it completes later it is
                undone by an unlock from the abandoned thread.
        """
        start = self._clock()
        order = _unique(pids)
        locked: list[int] = []
        per: dict[int, float] = {}
        deadline = timeout_ms / 1000.0 + self.call_timeout_s
        for pid in order:
            t0 = self._clock()
            try:
                self._call(
                    "cuCheckpointProcessLock",
                    pid,
                    self.api.lock,
                    pid,
                    timeout_ms,
                    timeout_s=deadline,
                    on_late=self._late_unlock(pid),
                )
            except Exception as exc:
                err = self._as_error(exc, "cuCheckpointProcessLock", pid)
                rollback = self._undo_locks(locked, failed_pid=pid)
                _reraise(
                    self._fail(err, f"lock failed at pid {pid} ({len(locked)} of {len(order)} locked)", pid, rollback),
                    exc,
                )
            per[pid] = self._clock() - t0
            locked.append(pid)
        return StepTiming("lock", self._clock() - start, per)

    def checkpoint_all(self, pids: Sequence[int], *, timeout_s: float | None = None) -> StepTiming:
        """Checkpoint every (LOCKED) PID, in order; on any failure bring them all back to RUNNING.

        Args:
            pids: the CUDA PIDs, all LOCKED by :meth:`lock_all`.
            timeout_s: deadline per checkpoint call in seconds; default ``transfer_timeout_s``.

        Returns:
            Step ``"checkpoint"``.

        Raises:
            CudaError: a checkpoint failed, e.g. ``CUDA_ERROR_NOT_SUPPORTED`` (FC-15); every PID was rolled back
                (restore + unlock / unlock), so the worker keeps running.
            DeadlineExceededError: a checkpoint hung (FC-03); same rollback for what can be reached; a late
                success is undone by restore + unlock in the abandoned thread.
        """
        start = self._clock()
        order = _unique(pids)
        per: dict[int, float] = {}
        for pid in order:
            t0 = self._clock()
            try:
                self._call(
                    "cuCheckpointProcessCheckpoint",
                    pid,
                    self.api.checkpoint,
                    pid,
                    timeout_s=timeout_s or self.transfer_timeout_s,
                    on_late=self._late_restore_unlock(pid),
                )
            except Exception as exc:
                err = self._as_error(exc, "cuCheckpointProcessCheckpoint", pid)
                rollback = self.rollback_to_running(order)
                _reraise(self._fail(err, f"checkpoint failed at pid {pid}", pid, rollback), exc)
            per[pid] = self._clock() - t0
        return StepTiming("checkpoint", self._clock() - start, per)

    def assert_no_device_files(self, pid: int, proc_root: Path | None = None) -> None:
        """Refuse to dump a process that still holds ``/dev/nvidia*`` fds or mappings (FC-16).

        Reads ``<proc_root>/<pid>/fd/*`` (link targets) and ``<proc_root>/<pid>/maps``.

        Args:
            pid: any PID of the tree (CUDA PIDs after checkpoint; fork-without-exec children too).
            proc_root: overrides the controller's ``proc_root``.

        Raises:
            FailedPreconditionError: reason ``GPU_DEVICE_FILES_OPEN``, naming the PID and up to 5 paths.
            NotFoundError: the process does not exist (reason ``PROCESS_NOT_FOUND``).
        """
        root = proc_root or self.proc_root or Path("/proc")
        if not (root / str(pid)).is_dir():
            raise NotFoundError(
                f"process {pid} does not exist (looked in {root})",
                reason="PROCESS_NOT_FOUND",
                metadata={"pid": str(pid)},
            )
        held = sorted({p for p in open_paths(pid, root) if p.startswith(NVIDIA_DEVICE_PREFIX)})
        if held:
            shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
            raise FailedPreconditionError(
                f"process {pid} still holds NVIDIA device files after checkpoint ({shown}); CRIU cannot dump them "
                "(FC-16). Every CUDA process of the tree must be CHECKPOINTED first, and children created by fork "
                "without exec keep /dev/nvidia* references: make the worker spawn (not fork) its CUDA children",
                reason="GPU_DEVICE_FILES_OPEN",
                metadata={"pid": str(pid), "paths": ",".join(held)},
            )

    def assert_ready_for_dump(self, cuda_pids: Sequence[int], tree_pids: Iterable[int] = ()) -> StepTiming:
        """Before CRIU dump: every CUDA PID is CHECKPOINTED and no PID of the tree holds ``/dev/nvidia*`` (FC-16).

        Args:
            cuda_pids: the checkpointed CUDA PIDs.
            tree_pids: every other PID CRIU will dump (checked for device files only).

        Returns:
            Step ``"verify_dump"``.

        Raises:
            FailedPreconditionError: a CUDA PID is not CHECKPOINTED (``CUDA_NOT_CHECKPOINTED``) or a PID holds
                device files (``GPU_DEVICE_FILES_OPEN``). Nothing is rolled back here: call
                :meth:`rollback_to_running` (a checkpoint's ``gpu-rollback`` undo does).
            CudaError / DeadlineExceededError: reading a state failed.
        """
        start = self._clock()
        per: dict[int, float] = {}
        for pid in _unique(cuda_pids):
            t0 = self._clock()
            state = self._call("cuCheckpointProcessGetState", pid, self.api.get_state, pid)
            per[pid] = self._clock() - t0
            if state != ProcessState.CHECKPOINTED:
                raise FailedPreconditionError(
                    f"CUDA process {pid} is {state.name}, not CHECKPOINTED, right before the CRIU dump; refusing to "
                    "dump a process with live GPU state (FC-16)",
                    reason="CUDA_NOT_CHECKPOINTED",
                    metadata={"pid": str(pid), "state": state.name},
                )
        for pid in _unique([*cuda_pids, *tree_pids]):
            self.assert_no_device_files(pid)
        return StepTiming("verify_dump", self._clock() - start, per)

    # ------------------------------------------------------------------------------------------ back to RUNNING

    def rollback_to_running(self, pids: Sequence[int]) -> RollbackResult:
        """Bring every PID back to RUNNING from any mix of RUNNING/LOCKED/CHECKPOINTED; never raises per PID.

        Order: read every state first; restore (original GPUs, no pairs) every CHECKPOINTED PID; then unlock every
        LOCKED PID. Also used after a leave-running CRIU dump to resume the source.

        Args:
            pids: CUDA PIDs of one tree.

        Returns:
            :class:`RollbackResult`; its ``problems`` name PIDs left FAILED, LOCKED, CHECKPOINTED, busy, dead or
            unknown, each with a remedy. Call ``raise_for_problems()`` to turn them into an error.
        """
        start = self._clock()
        result = RollbackResult()
        order = _unique(pids)
        for pid in order:
            result.states[pid] = self._probe(pid, result)
        for pid in order:
            if result.states[pid] == ProcessState.CHECKPOINTED:
                err = self._attempt(result, "restore", pid, self.api.restore, pid, timeout_s=self.transfer_timeout_s)
                if err is None:
                    result.states[pid] = ProcessState.LOCKED
                else:
                    result.states[pid] = self._probe(pid, None)
                    result.problems.append(f"pid {pid}: restore failed ({err}); {_CHECKPOINTED_REMEDY}")
        for pid in order:
            if result.states[pid] == ProcessState.LOCKED:
                self._unlock_one(pid, result)
        for pid in order:
            state = result.states[pid]
            if state == ProcessState.FAILED:
                result.problems.append(f"pid {pid}: {_FAILED_REMEDY}")
            elif state in (ProcessState.CHECKPOINTING, ProcessState.RESTORING):
                result.problems.append(
                    f"pid {pid}: still {state.name} (a driver call on it has not finished; it may be hung, FC-03): "
                    "wait and run the rollback again, or kill the worker"
                )
        result.seconds = self._clock() - start
        return result

    # ------------------------------------------------------------------------------------------ restore

    def restore_all(
        self, pids: Sequence[int], gpu_pairs: Sequence[tuple[str, str]] = (), *, timeout_s: float | None = None
    ) -> StepTiming:
        """Restore every (CHECKPOINTED) PID, in order, onto ``gpu_pairs`` (CHECKPOINTED → LOCKED).

        No rollback: after a CRIU restore a failed CUDA restore means the restored tree is unusable; the caller
        prepares it with :meth:`release_gpus_for_kill`, kills it and keeps the image (FC-18).

        Args:
            pids: the CUDA PIDs of the restored tree.
            gpu_pairs: ``[(old_uuid, new_uuid), …]`` from
                :func:`~gpusnap.daemon.gpu.gpumap.gpu_pairs_for_restore`: empty (all identity) or covering every
                checkpointed GPU (FC-08). Explicit pairs, never toggle semantics (FC-09).
            timeout_s: deadline per call in seconds; default ``transfer_timeout_s``.

        Returns:
            Step ``"restore"``.

        Raises:
            CudaError / DeadlineExceededError: with ``metadata["restored_pids"]``/``["pending_pids"]``.
        """
        start = self._clock()
        order = _unique(pids)
        per: dict[int, float] = {}
        pairs = list(gpu_pairs)
        for i, pid in enumerate(order):
            t0 = self._clock()
            try:
                self._call(
                    "cuCheckpointProcessRestore",
                    pid,
                    self.api.restore,
                    pid,
                    pairs,
                    timeout_s=timeout_s or self.transfer_timeout_s,
                )
            except Exception as exc:
                err = self._as_error(exc, "cuCheckpointProcessRestore", pid)
                done, pending = order[:i], order[i + 1 :]
                note = (
                    f"restore failed at pid {pid}; restored (LOCKED): {done or 'none'}; not attempted: "
                    f"{pending or 'none'}; prepare the tree with release_gpus_for_kill, kill it, keep the image"
                )
                annotated = _annotate(
                    err,
                    note + self._death_note(pid),
                    restored_pids=",".join(map(str, done)),
                    pending_pids=",".join(map(str, pending)),
                )
                _reraise(annotated, exc)
            per[pid] = self._clock() - t0
        return StepTiming("restore", self._clock() - start, per)

    def unlock_all(self, pids: Sequence[int]) -> StepTiming:
        """Unlock every PID (LOCKED → RUNNING), continuing past failures so nothing else stays LOCKED.

        An unlock error is tolerated when the PID then reads RUNNING (as Dynamo does).

        Args:
            pids: the CUDA PIDs.

        Returns:
            Step ``"unlock"``.

        Raises:
            CudaError / DeadlineExceededError: the first failure, annotated with every PID left not RUNNING
                (``metadata["stranded_pids"]``).
        """
        start = self._clock()
        per: dict[int, float] = {}
        first: GpusnapError | None = None
        first_exc: BaseException | None = None
        stranded: list[str] = []
        for pid in _unique(pids):
            t0 = self._clock()
            try:
                self._call("cuCheckpointProcessUnlock", pid, self.api.unlock, pid)
            except Exception as exc:
                state = self._probe(pid, None)
                if state == ProcessState.RUNNING:
                    per[pid] = self._clock() - t0
                    continue
                stranded.append(f"{pid} ({state.name if state is not None else 'unknown'})")
                if first is None:
                    first, first_exc = self._as_error(exc, "cuCheckpointProcessUnlock", pid), exc
            per[pid] = self._clock() - t0
        if first is not None and first_exc is not None:
            annotated = _annotate(
                first,
                f"not RUNNING after unlock: {', '.join(stranded)}; {_LOCKED_REMEDY}",
                stranded_pids=",".join(s.split()[0] for s in stranded),
            )
            _reraise(annotated, first_exc)
        return StepTiming("unlock", self._clock() - start, per)

    def verify_running(self, pids: Sequence[int]) -> StepTiming:
        """After restore: every PID exists and reads RUNNING (FC-18: CRIU's exit status is not enough).

        Args:
            pids: the CUDA PIDs of the restored tree.

        Returns:
            Step ``"verify"``.

        Raises:
            FailedPreconditionError: naming every PID that is missing (``PROCESS_MISSING``) or not RUNNING
                (``CUDA_NOT_RUNNING``) with its state; fix: kill the restored tree, keep the image, check the
                driver/GPU map. Reason is ``PROCESS_MISSING`` if any PID is missing.
        """
        start = self._clock()
        per: dict[int, float] = {}
        missing: list[int] = []
        wrong: list[str] = []
        for pid in _unique(pids):
            if self.proc_root is not None and not pid_alive(pid, self.proc_root):
                missing.append(pid)
                continue
            t0 = self._clock()
            try:
                state: ProcessState | None = self._call("cuCheckpointProcessGetState", pid, self.api.get_state, pid)
            except Exception as exc:
                wrong.append(f"{pid} (state unreadable: {self._as_error(exc, 'cuCheckpointProcessGetState', pid)})")
                state = None
            per[pid] = self._clock() - t0
            if state is not None and state != ProcessState.RUNNING:
                wrong.append(f"{pid} ({state.name})")
        if missing or wrong:
            parts = []
            if missing:
                parts.append(f"missing: {', '.join(map(str, missing))}")
            if wrong:
                parts.append(f"not RUNNING: {', '.join(wrong)}")
            raise FailedPreconditionError(
                "restored worker is not healthy on the GPU side (" + "; ".join(parts) + "). CRIU can report success "
                "while the CUDA side never came back (FC-18): kill the restored tree, keep the image, and check the "
                "driver version and GPU map",
                reason="PROCESS_MISSING" if missing else "CUDA_NOT_RUNNING",
                metadata={
                    "missing_pids": ",".join(map(str, missing)),
                    "not_running": ",".join(w.split()[0] for w in wrong),
                },
            )
        return StepTiming("verify", self._clock() - start, per)

    # ------------------------------------------------------------------------------------------ kill path

    def release_gpus_for_kill(self, pids: Sequence[int], *, lock_timeout_ms: int) -> RollbackResult:
        """Bring every PID to CHECKPOINTED (GPU memory released) before it is killed (FC-12).

        Killing a *restored* process that still holds GPU state hard-hung hosts on r595 (cuda-checkpoint#53).
        RUNNING → lock → checkpoint; LOCKED → checkpoint; CHECKPOINTED/FAILED/gone → left alone.

        Args:
            pids: CUDA PIDs about to be killed.
            lock_timeout_ms: driver lock timeout in milliseconds.

        Returns:
            :class:`RollbackResult` with ``goal`` CHECKPOINTED; ``problems`` lists PIDs that still hold GPU state
            (kill them anyway only if the host's driver is known not to hang).
        """
        start = self._clock()
        result = RollbackResult(goal=ProcessState.CHECKPOINTED)
        for pid in _unique(pids):
            if self.proc_root is not None and not pid_alive(pid, self.proc_root):
                continue  # already gone: nothing left to release
            state = self._probe(pid, result)
            if state == ProcessState.RUNNING:
                lock_s = lock_timeout_ms / 1000.0 + self.call_timeout_s
                err = self._attempt(result, "lock", pid, self.api.lock, pid, lock_timeout_ms, timeout_s=lock_s)
                if err is None:
                    state = ProcessState.LOCKED
                else:
                    result.problems.append(f"pid {pid}: lock failed ({err})")
            if state == ProcessState.LOCKED:
                err = self._attempt(
                    result, "checkpoint", pid, self.api.checkpoint, pid, timeout_s=self.transfer_timeout_s
                )
                if err is None:
                    state = ProcessState.CHECKPOINTED
                else:
                    result.problems.append(f"pid {pid}: checkpoint failed ({err})")
                    state = self._probe(pid, None)
            if state == ProcessState.FAILED:
                result.problems.append(f"pid {pid}: {_FAILED_REMEDY}")
            result.states[pid] = state
        result.seconds = self._clock() - start
        return result

    # ------------------------------------------------------------------------------------------ internals

    def _call(
        self,
        name: str,
        pid: int,
        fn: Callable[..., T],
        *args: Any,
        timeout_s: float | None = None,
        on_late: Callable[[T], object] | None = None,
    ) -> T:
        return call_with_deadline(
            fn,
            *args,
            timeout_s=timeout_s if timeout_s is not None else self.call_timeout_s,
            what=f"{name}(pid={pid})",
            on_late_result=on_late,
        )

    @staticmethod
    def _as_error(exc: BaseException, call: str, pid: int | None) -> GpusnapError:
        if isinstance(exc, GpusnapError):
            return exc
        target = f"(pid={pid})" if pid is not None else ""
        return InternalError(
            f"{call}{target} raised {type(exc).__name__}: {exc}",
            reason="CUDA_CALL_CRASHED",
            metadata={"call": call, "pid": str(pid) if pid is not None else ""},
        )

    def _probe(self, pid: int, result: RollbackResult | None) -> ProcessState | None:
        """Read the state, bounded; ``None`` (and a problem on ``result``) when it cannot be read."""
        try:
            return self._call("cuCheckpointProcessGetState", pid, self.api.get_state, pid)
        except Exception as exc:
            if result is not None:
                if self.proc_root is not None and not pid_alive(pid, self.proc_root):
                    result.problems.append(f"pid {pid}: the process no longer exists")
                else:
                    result.problems.append(
                        f"pid {pid}: state unknown ({self._as_error(exc, 'cuCheckpointProcessGetState', pid)}); "
                        f"{_LOCKED_REMEDY}"
                    )
            return None

    def _attempt(
        self,
        result: RollbackResult,
        action: str,
        pid: int,
        fn: Callable[..., object],
        *args: Any,
        timeout_s: float | None = None,
    ) -> GpusnapError | None:
        """One best-effort driver call of a rollback-like sequence, logged in ``result.actions``.

        Returns:
            ``None`` on success, else the error (never raises).
        """
        result.actions.append(f"{action}({pid})")
        name = _CALL_NAMES[action]
        try:
            self._call(name, pid, fn, *args, timeout_s=timeout_s)
        except Exception as exc:
            return self._as_error(exc, name, pid)
        return None

    def _unlock_one(self, pid: int, result: RollbackResult) -> None:
        err = self._attempt(result, "unlock", pid, self.api.unlock, pid)
        if err is None:
            result.states[pid] = ProcessState.RUNNING
            return
        state = self._probe(pid, None)
        result.states[pid] = state
        if state != ProcessState.RUNNING:
            result.problems.append(
                f"pid {pid}: unlock failed ({err}), state {state.name if state is not None else 'unknown'}; "
                f"{_LOCKED_REMEDY}"
            )

    def _undo_locks(self, locked: Sequence[int], *, failed_pid: int) -> RollbackResult:
        """Unlock ``locked`` newest first, then make sure ``failed_pid`` is not left LOCKED."""
        start = self._clock()
        result = RollbackResult()
        for pid in reversed(locked):
            result.states[pid] = ProcessState.LOCKED
            self._unlock_one(pid, result)
        # Peers are unlocked first: calls on one rank can hang while another is locked (FC-02).
        state = self._probe(failed_pid, result)
        result.states[failed_pid] = state
        if state == ProcessState.LOCKED:
            self._unlock_one(failed_pid, result)
        elif state == ProcessState.FAILED:
            result.problems.append(f"pid {failed_pid}: {_FAILED_REMEDY}")
        result.seconds = self._clock() - start
        return result

    def _death_note(self, pid: int | None) -> str:
        if pid is None or self.proc_root is None or pid_alive(pid, self.proc_root):
            return ""
        return (
            f". Target process {pid} is gone: it died during the driver call (lock has crashed targets on some "
            "drivers, FC-13); do not retry, report the driver and engine versions"
        )

    def _fail(self, err: GpusnapError, what: str, pid: int | None, rollback: RollbackResult) -> GpusnapError:
        return _annotate(
            err,
            f"{what}; {rollback.summary()}{self._death_note(pid)}",
            rollback="ok" if rollback.ok else "incomplete",
            stranded_pids=",".join(map(str, rollback.stranded)),
        )

    def _late_unlock(self, pid: int) -> Callable[[object], None]:
        def undo(_: object) -> None:
            try:
                self.api.unlock(pid)
                note = f"late lock({pid}) succeeded after its deadline: unlocked"
            except Exception as exc:  # noqa: BLE001 - nobody waits for this thread
                note = f"late lock({pid}) succeeded after its deadline: unlock failed: {exc}"
            with self._late_lock:
                self.late_actions.append(note)

        return undo

    def _late_restore_unlock(self, pid: int) -> Callable[[object], None]:
        def undo(_: object) -> None:
            try:
                self.api.restore(pid)
                self.api.unlock(pid)
                note = f"late checkpoint({pid}) succeeded after its deadline: restored and unlocked"
            except Exception as exc:  # noqa: BLE001
                note = f"late checkpoint({pid}) succeeded after its deadline: restore/unlock failed: {exc}"
            with self._late_lock:
                self.late_actions.append(note)

        return undo
