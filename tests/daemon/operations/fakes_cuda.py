"""A :class:`~tests.fakes.cuda.FakeCudaApi` whose "CUDA processes" are real (CPU) processes.

On top of the state machine, fault injection and call log of ``FakeCudaApi`` it models what the real driver does
around CRIU:

* :meth:`ProcessCuda.add` registers a live PID as a CUDA process that sees some GPUs (``CUDA_VISIBLE_DEVICES``;
  ``FakeCudaApi.gpus_of``, which a restore's GPU pairs must permute) and holds memory on some of them.
* A process the driver has checkpointed comes back CHECKPOINTED when CRIU restores its image: any PID the fake is
  asked about that it does not know, whose innermost-namespace PID (``/proc/<pid>/status`` ``NSpid``) is a
  checkpointed PID, is adopted in that state with the same GPUs and memory (:attr:`ProcessCuda.adopted`).
* A restore with GPU pairs moves the process's memory along with its visible GPUs.
* :meth:`ProcessCuda.usage` is what NVML reports: RUNNING/LOCKED processes that are alive, on their GPUs
  (checkpointed processes hold no device memory).
* :meth:`ProcessCuda.note` adds non-driver events (CRIU dump/restore) to the same ordered call log, and every
  driver call also records whether its target process was alive (:attr:`ProcessCuda.liveness`), so tests can
  check that GPUs are released *before* a restored tree is killed (FC-12).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpusnap.daemon.drivers import proc
from gpusnap.daemon.drivers.cuda import ProcessState, normalize_gpu_uuid
from tests.fakes.cuda import Call, FakeCudaApi


def namespace_pid(pid: int) -> int | None:
    """``pid``'s PID in its innermost PID namespace, or None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except OSError:
        return None
    return pid


class ProcessCuda(FakeCudaApi):
    """FakeCudaApi over real processes (see module doc)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.memory: dict[int, int] = {}
        self.used: dict[int, list[str]] = {}
        """PID -> GPUs it holds memory on (``memory`` bytes on each); ``gpus_of`` are the GPUs it sees."""
        self.comes_back: dict[int, ProcessState] = {}
        """Source PID -> state a CRIU-restored copy of it is in (CHECKPOINTED once the driver checkpointed it)."""
        self.adopted: dict[int, int] = {}
        """Host PID of a restored copy -> the source PID it was adopted for."""
        self.liveness: list[tuple[str, int, bool]] = []
        """``(method, pid, alive)`` for every driver call, in order."""

    # -- setup -------------------------------------------------------------------------------------------

    def add(
        self,
        pid: int,
        *,
        gpus: Sequence[str] = (),
        visible: Sequence[str] = (),
        memory_bytes: int = 0,
        state: ProcessState = ProcessState.RUNNING,
    ) -> None:
        """Make live ``pid`` a CUDA process in ``state`` that sees ``visible`` GPUs and holds ``memory_bytes`` on
        each of ``gpus``."""
        with self._lock:
            self.states[pid] = state
            self.gpus_of[pid] = [normalize_gpu_uuid(u) for u in visible]
            self.used[pid] = [normalize_gpu_uuid(u) for u in gpus]
            self.memory[pid] = memory_bytes

    def note(self, event: str, pid: int, *args: object) -> None:
        """Append a non-driver event (``"criu.dump"`` …) to the call log."""
        with self._lock:
            self.calls.append(Call(event, pid, tuple(args)))

    # -- inspection --------------------------------------------------------------------------------------

    def usage(self) -> dict[int, list[tuple[str, int]]]:
        """What NVML sees: ``{pid: [(uuid, bytes), …]}`` of live RUNNING/LOCKED CUDA processes."""
        with self._lock:
            items = [(p, s, list(self.used.get(p, [])), self.memory.get(p, 0)) for p, s in self.states.items()]
        return {
            pid: [(u, nbytes) for u in gpus]
            for pid, state, gpus, nbytes in items
            if state in (ProcessState.RUNNING, ProcessState.LOCKED) and gpus and proc.alive(pid)
        }

    def calls_since(self, mark: int, *, include_get_state: bool = True) -> list[tuple[str, int]]:
        """``sequence()`` from call number ``mark`` on (``mark = len(fake.calls)`` taken earlier)."""
        with self._lock:
            calls = self.calls[mark:]
        return [(c.method, c.pid) for c in calls if include_get_state or c.method != "get_state"]

    def args_of(self, method: str, pid: int) -> list[tuple[object, ...]]:
        """Arguments of every ``method`` call on ``pid``."""
        with self._lock:
            return [c.args for c in self.calls if c.method == method and c.pid == pid]

    # -- FakeCudaApi hooks -------------------------------------------------------------------------------

    def _enter(self, method: str, pid: int, args: tuple[object, ...] = ()) -> bool:
        self._adopt(pid)
        alive = proc.alive(pid)
        with self._lock:
            self.liveness.append((method, pid, alive))
        return super()._enter(method, pid, args)

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        self._adopt(pid)
        with self._lock:
            before = list(self.gpus_of.get(pid, []))
        super().restore(pid, gpu_pairs)
        with self._lock:
            moved = dict(zip(before, self.gpus_of.get(pid, []), strict=False))  # a process may lose GPUs
            self.used[pid] = [moved.get(u, u) for u in self.used.get(pid, [])]

    def _transition(self, method: str, pid: int) -> None:
        super()._transition(method, pid)
        if method == "checkpoint":
            with self._lock:
                self.comes_back[pid] = ProcessState.CHECKPOINTED

    def _adopt(self, pid: int) -> None:
        with self._lock:
            if pid in self.states or not self.comes_back:
                return
        source = namespace_pid(pid)
        with self._lock:
            if source is None or source == pid or source not in self.comes_back or pid in self.states:
                return
            self.states[pid] = self.comes_back[source]
            self.gpus_of[pid] = list(self.gpus_of.get(source, []))
            self.used[pid] = list(self.used.get(source, []))
            self.memory[pid] = self.memory.get(source, 0)
            self.adopted[pid] = source
