"""A fake :class:`~gpusnap.daemon.drivers.cuda.CudaCheckpointApi` honouring the driver's state machine.

State machine (CUDA Driver API "CUDA Checkpointing")::

    RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED --restore--> LOCKED --unlock--> RUNNING

* A call from the wrong state raises ``CudaError(CUDA_ERROR_ILLEGAL_STATE)``; FAILED is terminal (every
  transition from it is ILLEGAL_STATE); an unknown PID gives ``CUDA_ERROR_INVALID_VALUE``.
* :meth:`FakeCudaApi.lock_timeout` makes a lock return ``CUDA_ERROR_NOT_READY`` and leave the PID RUNNING.
* Restore with GPU pairs must cover every GPU the PID was checkpointed on (FC-08) when those GPUs are known,
  else ``CUDA_ERROR_INVALID_VALUE``; the PID's GPUs are then remapped.

Fault injection, each for the Nth call (``on_call``, 1-based) of one method on one PID (or any PID), ``count``
times (``None`` = every later call too): :meth:`~FakeCudaApi.fail` (raise a result), :meth:`~FakeCudaApi.not_supported`,
:meth:`~FakeCudaApi.hang` (block until the returned event is set, then proceed or fail), :meth:`~FakeCudaApi.noop`
(report success without changing state: a silent driver failure), :meth:`~FakeCudaApi.die` (the process exits
during the call). Every call is recorded in :attr:`FakeCudaApi.calls`, in order, before faults apply.
"""

from __future__ import annotations

import shutil
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.daemon.drivers.cuda import CudaError, CudaResult, ProcessState, normalize_gpu_uuid

CALL_NAMES = {
    "get_state": "cuCheckpointProcessGetState",
    "get_restore_thread_id": "cuCheckpointProcessGetRestoreThreadId",
    "lock": "cuCheckpointProcessLock",
    "checkpoint": "cuCheckpointProcessCheckpoint",
    "restore": "cuCheckpointProcessRestore",
    "unlock": "cuCheckpointProcessUnlock",
}

# method -> (required state, state after)
TRANSITIONS = {
    "lock": (ProcessState.RUNNING, ProcessState.LOCKED),
    "checkpoint": (ProcessState.LOCKED, ProcessState.CHECKPOINTED),
    "restore": (ProcessState.CHECKPOINTED, ProcessState.LOCKED),
    "unlock": (ProcessState.LOCKED, ProcessState.RUNNING),
}


@dataclass(frozen=True)
class Call:
    """One recorded call: method name (``"lock"``…), PID and extra arguments."""

    method: str
    pid: int
    args: tuple[object, ...] = ()


@dataclass
class Fault:
    """One injected fault (see module doc)."""

    method: str
    pid: int | None
    kind: str  # "error" | "hang" | "noop" | "die"
    result: int = CudaResult.CUDA_ERROR_UNKNOWN
    on_call: int = 1
    count: int | None = 1
    release: threading.Event | None = None
    then_fail: bool = False
    fired: int = 0

    def matches(self, method: str, pid: int, nth: int) -> bool:
        if method != self.method or (self.pid is not None and self.pid != pid):
            return False
        if nth < self.on_call:
            return False
        return self.count is None or self.fired < self.count


@dataclass
class FakeCudaApi:
    """In-memory CUDA checkpoint driver for tests.

    Args:
        processes: CUDA PIDs and their initial states (an iterable of PIDs = all RUNNING).
        gpus: GPU UUIDs each PID uses (restore pair validation); unknown = not validated.
        proc_root: fake ``/proc``; :meth:`die` removes ``<proc_root>/<pid>``.
    """

    processes: Mapping[int, ProcessState] | Iterable[int] = ()
    gpus: Mapping[int, Sequence[str]] = field(default_factory=dict)
    proc_root: Path | None = None

    def __post_init__(self) -> None:
        self.states: dict[int, ProcessState] = (
            dict(self.processes)
            if isinstance(self.processes, Mapping)
            else {int(p): ProcessState.RUNNING for p in self.processes}
        )
        self.gpus_of: dict[int, list[str]] = {pid: [normalize_gpu_uuid(u) for u in us] for pid, us in self.gpus.items()}
        self.calls: list[Call] = []
        self.faults: list[Fault] = []
        self._counts: Counter[tuple[str, int]] = Counter()
        self._method_counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._events: list[threading.Event] = []

    # ------------------------------------------------------------------------------------- fault setup

    def fail(
        self,
        method: str,
        pid: int | None = None,
        *,
        result: int = CudaResult.CUDA_ERROR_UNKNOWN,
        on_call: int = 1,
        count: int | None = 1,
    ) -> None:
        """Make the ``on_call``-th ``method`` call on ``pid`` (any PID if ``None``) return ``result``.

        The state does not change.
        """
        self.faults.append(Fault(method, pid, "error", result=result, on_call=on_call, count=count))

    def not_supported(self, method: str, pid: int | None = None, *, on_call: int = 1, count: int | None = 1) -> None:
        """Shorthand for ``fail(..., result=CUDA_ERROR_NOT_SUPPORTED)`` (FC-15)."""
        self.fail(method, pid, result=CudaResult.CUDA_ERROR_NOT_SUPPORTED, on_call=on_call, count=count)

    def lock_timeout(self, pid: int, *, on_call: int = 1) -> None:
        """The lock's ``timeoutMs`` expires: ``CUDA_ERROR_NOT_READY``, the PID stays RUNNING."""
        self.fail("lock", pid, result=CudaResult.CUDA_ERROR_NOT_READY, on_call=on_call)

    def hang(
        self, method: str, pid: int | None = None, *, on_call: int = 1, then_fail: bool = False
    ) -> threading.Event:
        """Block the call until the returned event is set; then proceed normally (or fail with UNKNOWN)."""
        event = threading.Event()
        self._events.append(event)
        self.faults.append(Fault(method, pid, "hang", on_call=on_call, release=event, then_fail=then_fail))
        return event

    def noop(self, method: str, pid: int | None = None, *, on_call: int = 1, count: int | None = 1) -> None:
        """Report success without changing state (a silently failed driver call, FC-18)."""
        self.faults.append(Fault(method, pid, "noop", on_call=on_call, count=count))

    def die(self, method: str, pid: int, *, on_call: int = 1) -> None:
        """The target exits during the call (FC-13): it disappears, the call returns INVALID_VALUE."""
        self.faults.append(Fault(method, pid, "die", result=CudaResult.CUDA_ERROR_INVALID_VALUE, on_call=on_call))

    def release_all(self) -> None:
        """Unblock every hung call (test teardown)."""
        for event in self._events:
            event.set()

    # ------------------------------------------------------------------------------------- inspection

    def sequence(self, *, include_get_state: bool = True) -> list[tuple[str, int]]:
        """Recorded calls as ``[(method, pid), …]``."""
        with self._lock:
            return [(c.method, c.pid) for c in self.calls if include_get_state or c.method != "get_state"]

    def state(self, pid: int) -> ProcessState:
        """Current state of ``pid`` (KeyError if unknown)."""
        with self._lock:
            return self.states[pid]

    # ------------------------------------------------------------------------------------- CudaCheckpointApi

    def get_state(self, pid: int) -> ProcessState:
        self._enter("get_state", pid)
        with self._lock:
            return self._known(pid, "get_state")

    def get_restore_thread_id(self, pid: int) -> int:
        self._enter("get_restore_thread_id", pid)
        with self._lock:
            self._known(pid, "get_restore_thread_id")
            return pid + 1  # the restore thread is a thread of the process

    def lock(self, pid: int, timeout_ms: int) -> None:
        if self._enter("lock", pid, (timeout_ms,)):
            self._transition("lock", pid)

    def checkpoint(self, pid: int) -> None:
        if self._enter("checkpoint", pid):
            self._transition("checkpoint", pid)

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        pairs = tuple((normalize_gpu_uuid(o), normalize_gpu_uuid(n)) for o, n in gpu_pairs)
        if not self._enter("restore", pid, (pairs,)):
            return
        with self._lock:
            known = self.gpus_of.get(pid)
            if pairs and known is not None:
                olds = [o for o, _ in pairs]
                if sorted(olds) != sorted(known) or len(set(n for _, n in pairs)) != len(pairs):
                    raise CudaError(CALL_NAMES["restore"], pid, CudaResult.CUDA_ERROR_INVALID_VALUE)
        self._transition("restore", pid)
        if pairs:
            with self._lock:
                mapping = dict(pairs)
                if pid in self.gpus_of:
                    self.gpus_of[pid] = [mapping.get(u, u) for u in self.gpus_of[pid]]

    def unlock(self, pid: int) -> None:
        if self._enter("unlock", pid):
            self._transition("unlock", pid)

    # ------------------------------------------------------------------------------------- internals

    def _known(self, pid: int, method: str) -> ProcessState:
        if pid not in self.states:
            raise CudaError(CALL_NAMES[method], pid, CudaResult.CUDA_ERROR_INVALID_VALUE)
        return self.states[pid]

    def _enter(self, method: str, pid: int, args: tuple[object, ...] = ()) -> bool:
        """Record the call and apply faults; False = skip the transition (noop)."""
        with self._lock:
            self.calls.append(Call(method, pid, args))
            self._counts[(method, pid)] += 1
            self._method_counts[method] += 1
            nth_pid = self._counts[(method, pid)]
            fault = next(
                (
                    f
                    for f in self.faults
                    if f.matches(method, pid, nth_pid if f.pid is not None else self._method_counts[method])
                ),
                None,
            )
            if fault is not None:
                fault.fired += 1
        if fault is None:
            return True
        name = CALL_NAMES[method]
        if fault.kind == "error":
            raise CudaError(name, pid, fault.result)
        if fault.kind == "noop":
            return False
        if fault.kind == "die":
            with self._lock:
                self.states.pop(pid, None)
            if self.proc_root is not None:
                shutil.rmtree(self.proc_root / str(pid), ignore_errors=True)
            raise CudaError(name, pid, fault.result)
        assert fault.kind == "hang" and fault.release is not None
        fault.release.wait()
        if fault.then_fail:
            raise CudaError(name, pid, CudaResult.CUDA_ERROR_UNKNOWN)
        return True

    def _transition(self, method: str, pid: int) -> None:
        required, after = TRANSITIONS[method]
        with self._lock:
            state = self._known(pid, method)
            if state != required:
                raise CudaError(
                    CALL_NAMES[method], pid, CudaResult.CUDA_ERROR_ILLEGAL_STATE, detail=f"state {state.name}"
                )
            self.states[pid] = after


class FakeProc:
    """A fake ``/proc`` tree under ``root``: ``<pid>/{stat,fd/*,maps,environ,comm}``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def add(
        self,
        pid: int,
        *,
        fds: Sequence[str] = (),
        maps: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        comm: str = "python3",
        state: str = "S",
        cmdline: Sequence[str] = ("python3",),
    ) -> Path:
        """Create ``<root>/<pid>`` with fd symlinks to ``fds``, ``maps`` lines naming ``maps`` paths, ``environ``,
        ``cmdline``."""
        base = self.root / str(pid)
        (base / "fd").mkdir(parents=True, exist_ok=True)
        (base / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1\n")
        (base / "comm").write_text(comm + "\n")
        for i, target in enumerate(fds):
            link = base / "fd" / str(i + 3)
            if link.is_symlink():
                link.unlink()
            link.symlink_to(target)
        lines = ["55d0c0a00000-55d0c0a21000 r--p 00000000 08:01 131 /usr/bin/python3.11"]
        lines += [
            f"7f00{i:08x}000-7f00{i:08x}fff rw-s 00000000 00:05 {500 + i}                   {p}"
            for i, p in enumerate(maps)
        ]
        lines.append("7ffd1c9a8000-7ffd1c9c9000 rw-p 00000000 00:00 0                          [stack]")
        (base / "maps").write_text("\n".join(lines) + "\n")
        environ = env or {}
        (base / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))
        (base / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in cmdline))
        return base

    def remove(self, pid: int) -> None:
        """The process exits."""
        shutil.rmtree(self.root / str(pid), ignore_errors=True)
