"""An in-process gpusnap node for operation tests: real CRIU, store and processes; fake CUDA driver and NVML.

``node`` builds a real :class:`~gpusnap.daemon.operations.deps.Deps` (CRIU from the ``.criu`` prefix, a
:class:`SnapshotStore` under ``tmp_path``, a :class:`DaemonConfig`) whose :class:`GpuSupport` drives a
:class:`~tests.daemon.operations.fakes_cuda.ProcessCuda` and a :class:`~tests.daemon.operations.fakes_nvml.FakeNvml`.
``node.start(...)`` runs a ``workloads/tree.py`` tree and registers chosen PIDs of it as CUDA processes; the
operation bodies run synchronously through ``PhaseRunner`` (or ``OperationRegistry``). Everything started,
restored trees included, is killed at teardown.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpusnap.adapters.contract import capture_settings
from gpusnap.daemon.api.types import (
    CheckpointOptions,
    RestoreOptions,
    Snapshot,
)
from gpusnap.daemon.config import DaemonConfig
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.drivers.criu import CriuDriver, RestoredTree
from gpusnap.daemon.gpu.support import GpuSupport
from gpusnap.daemon.operations.base import EventType, OperationKind, OperationRecord, PhaseRunner
from gpusnap.daemon.operations.checkpoint import run_checkpoint
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.operations.restore import run_restore
from gpusnap.daemon.operations.suspend import run_resume, run_suspend
from gpusnap.daemon.store import SnapshotStore
from tests.conftest import Workload, Workloads, criu_prefix, wait_for
from tests.daemon.operations.fakes_cuda import ProcessCuda
from tests.daemon.operations.fakes_nvml import GIB, FakeGpu, FakeNvml, fake_uuid
from tests.lanes import LANES
from tests.starts import starts

MIB = 1 << 20
GPU_BYTES = 512 * MIB
"""Device memory a fake CUDA process holds (small: the host-RAM preflight counts it)."""

NCCL_ENV = capture_settings.env_defaults()
"""What ``configure_capture_env()`` sets: a multi-CUDA-process tree configured so passes the preflight."""


class RecordingCriu(CriuDriver):
    """The real CriuDriver, noting dump/post-dump/restore in the fake driver's call log.

    ``fail_post_dump``: raised from CRIU's ``post-dump`` notification *instead of* the operation's own callback, so
    CRIU (which has frozen and dumped the tree) fails the dump and resumes the tree for real.
    """

    def __init__(self, binary: str, pycriu_path: str, log: ProcessCuda) -> None:
        super().__init__(binary, pycriu_path)
        self.log = log
        self.fail_post_dump: BaseException | None = None
        self.restored: list[RestoredTree] = []

    def dump(self, *, pid: int, on_post_dump: Callable[[dict[int, int]], None] | None = None, **kw: Any) -> None:
        self.log.note("criu.dump", pid)

        def post_dump(image_bytes: dict[int, int]) -> None:
            self.log.note("criu.post-dump", pid)
            if self.fail_post_dump is not None:
                raise self.fail_post_dump
            if on_post_dump is not None:
                on_post_dump(image_bytes)

        super().dump(pid=pid, on_post_dump=post_dump, **kw)
        self.log.note("criu.dumped", pid)

    def restore(self, **kw: Any) -> RestoredTree:
        tree = super().restore(**kw)
        self.restored.append(tree)
        self.log.note("criu.restored", tree.ns_pid)
        return tree


@dataclasses.dataclass
class Tree:
    """A started workload tree: ``root`` and its forked ``child`` (0 with ``--no-child``)."""

    workload: Workload
    child: int

    @property
    def root(self) -> int:
        return self.workload.pid

    @property
    def pids(self) -> list[int]:
        return [self.root] + ([self.child] if self.child else [])

    def running(self) -> bool:
        """Every process of the tree exists, is no zombie and is not stopped (e.g. left frozen by CRIU)."""
        assert self.workload.proc is not None
        if self.workload.proc.poll() is not None:
            return False
        return all(proc.alive(p) and not proc.stopped(p) for p in self.pids)

    def assert_progressing(self, timeout: float = 15) -> None:
        """The tree runs: both the parent's and the child's counters advance."""
        parent, child = self.workload.last("parent.log"), self._child_count()
        wait_for(lambda: self.workload.last("parent.log") > parent + 2, timeout, "the tree's parent does not run")
        if self.child:
            wait_for(lambda: self._child_count() > child + 2, timeout, "the tree's child does not run")

    def killed(self, timeout: float = 15) -> int:
        """Wait for the source root to exit; returns its exit status (negative: signal)."""
        assert self.workload.proc is not None
        return self.workload.proc.wait(timeout=timeout)

    def _child_count(self) -> int:
        path = self.workload.workdir / "child.log"
        return self.workload.last("child.log") if path.exists() else 0


@dataclasses.dataclass
class GpuNode:
    tmp: Path
    cuda: ProcessCuda
    nvml: FakeNvml
    gpu: GpuSupport
    criu: RecordingCriu
    store: SnapshotStore
    config: DaemonConfig
    deps: Deps
    workloads: Workloads
    monkeypatch: pytest.MonkeyPatch

    # -- processes ---------------------------------------------------------------------------------------

    def start(
        self,
        *,
        cuda: Sequence[str] = ("root",),
        gpus: Sequence[int] = (0,),
        visible: Sequence[int] | None = None,
        memory_bytes: int = GPU_BYTES,
        env: Mapping[str, str] | None = None,
        mem_mb: int = 4,
        child: bool = True,
    ) -> Tree:
        """Start a tree.py tree (no listener) and make its ``cuda`` members (``"root"``/``"child"``) CUDA processes
        holding ``memory_bytes`` on each GPU of ``gpus`` (indexes) and seeing ``visible`` (``CUDA_VISIBLE_DEVICES``;
        ``None`` = unset, every GPU of the node)."""
        if visible is None:
            self.monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            self.monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, visible)))
        for key, value in (env or {}).items():
            self.monkeypatch.setenv(key, value)
        args = ["--mem-mb", str(mem_mb), "--no-listener"] + ([] if child else ["--no-child"])
        w = self.workloads.start(*args)
        kid = 0
        if child:
            wait_for(lambda: bool(psutil.Process(w.pid).children()), 10, "tree.py did not fork its child")
            kid = psutil.Process(w.pid).children()[0].pid
        tree = Tree(w, kid)
        seen = [g.index for g in self.nvml.devices] if visible is None else list(visible)
        for member in cuda:
            pid = tree.root if member == "root" else tree.child
            self.cuda.add(
                pid, gpus=[fake_uuid(i) for i in gpus], visible=[fake_uuid(i) for i in seen], memory_bytes=memory_bytes
            )
        return tree

    # -- operations --------------------------------------------------------------------------------------

    def run(self, kind: OperationKind, body: Callable[[PhaseRunner], object], **record_kw: Any) -> OperationRecord:
        record = OperationRecord(kind, **record_kw)
        PhaseRunner(record).run(body)
        assert record.done
        return record

    def checkpoint(self, pid: int, **opts: Any) -> OperationRecord:
        options = CheckpointOptions(pid=pid, **opts)
        return self.run(
            OperationKind.CHECKPOINT, lambda run: run_checkpoint(run, self.deps, options, 0), target_pid=pid
        )

    def checkpoint_ok(self, pid: int, **opts: Any) -> Snapshot:
        record = self.checkpoint(pid, **opts)
        assert record.error is None, f"checkpoint failed: {record.error!r}"
        assert isinstance(record.result, Snapshot)
        return record.result

    def restore(self, snapshot: str, **opts: Any) -> OperationRecord:
        options = RestoreOptions(snapshot=snapshot, **opts)
        record = self.run(
            OperationKind.RESTORE, lambda run: run_restore(run, self.deps, options, self.deps.store.get(snapshot))
        )
        if record.result is not None:
            self.workloads.adopt(record.result.pid)
        return record

    def suspend(self, pid: int, lock_timeout_s: float | None = None) -> OperationRecord:
        return self.run(
            OperationKind.SUSPEND, lambda run: run_suspend(run, self.deps, pid, lock_timeout_s), target_pid=pid
        )

    def resume(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> OperationRecord:
        return self.run(
            OperationKind.RESUME, lambda run: run_resume(run, self.deps, pid, gpu_map or {}), target_pid=pid
        )

    # -- store -------------------------------------------------------------------------------------------

    def listed(self) -> list[str]:
        return [s.id for s in self.store.list()]

    def staging(self) -> list[Path]:
        return list(self.store.staging_dir.iterdir())

    def published_dirs(self) -> list[Path]:
        return list(self.store.snapshots_dir.iterdir())


# -- record helpers -----------------------------------------------------------------------------------------


def phase_names(record: OperationRecord) -> list[str]:
    """Phases that finished, in order."""
    return [p.phase for p in record.phases]


def events(record: OperationRecord, type: EventType) -> list[tuple[str, str]]:
    """``(phase, message)`` of the record's events of one type."""
    return [(e.phase, e.message) for e in record.events if e.type is type]


def started_phases(record: OperationRecord) -> list[str]:
    return [p for p, _ in events(record, EventType.PHASE_STARTED)]


def failed_phase(record: OperationRecord) -> str:
    failed = events(record, EventType.PHASE_FAILED)
    assert len(failed) == 1, failed
    return failed[0][0]


def rollback_steps(record: OperationRecord) -> list[tuple[str, str]]:
    return events(record, EventType.ROLLBACK)


def processes_with(text: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line mentions ``text``."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(p.info["cmdline"] or ()):
                out.append(p)
        except psutil.Error:
            continue
    return out


# -- fixtures -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
@starts("CRIU")
def criu_version() -> str:
    prefix = criu_prefix()
    return CriuDriver(str(prefix / "bin" / "criu"), str(prefix / "python")).require_supported()


@pytest.fixture
def node(tmp_path: Path, workloads: Workloads, criu_version: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[GpuNode]:
    cuda = ProcessCuda()
    # Three H200s and one A100 (another model: never a valid restore target for H200 state).
    a100 = FakeGpu(3, name="NVIDIA A100-SXM4-80GB", memory_total_bytes=80 * GIB)
    nvml = FakeNvml([FakeGpu(0), FakeGpu(1), FakeGpu(2), a100], usage=cuda.usage)
    gpu = GpuSupport(cuda, nvml, "", call_timeout_s=5)  # type: ignore[arg-type]
    prefix = criu_prefix()
    criu = RecordingCriu(str(prefix / "bin" / "criu"), str(prefix / "python"), cuda)
    store = SnapshotStore(tmp_path / "store", executor=LANES)
    store.open()
    config = DaemonConfig(
        store=tmp_path / "store",
        criu_binary=criu.binary,
        pycriu_path=criu.pycriu_path,
        checkpoint_timeout=120,
        restore_timeout=120,
        gpu_lock_timeout=4.0,
        gpu_call_timeout=5.0,
    )
    deps = Deps(config=config, store=store, criu=criu, criu_version=criu_version, gpu=gpu, **_optional_deps(tmp_path))
    n = GpuNode(tmp_path, cuda, nvml, gpu, criu, store, config, deps, workloads, monkeypatch)
    try:
        yield n
    finally:
        cuda.release_all()
        for tree in criu.restored:  # a restore's namespace init takes its whole tree with it
            if tree.init_pid:
                _kill(tree.init_pid)
        for p in processes_with(str(tmp_path)):  # anything else running from this test's directories
            _kill(p.pid)
        store.close()


def _optional_deps(tmp_path: Path) -> dict[str, Any]:
    """Deps fields beyond the core ones: a worker-agent registry that never started (no agent attaches)."""
    names = {f.name for f in dataclasses.fields(Deps)}
    extra: dict[str, Any] = {}
    if "agents" in names:
        from gpusnap.daemon.workers.agents import AgentRegistry

        extra["agents"] = AgentRegistry(tmp_path / "agents.sock")
    return extra


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
