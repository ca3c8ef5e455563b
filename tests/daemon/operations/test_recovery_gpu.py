"""Fault matrix, GPU rows: gpusnapd dies right after a GPU phase; recovery from the journal brings the
source's CUDA state back to RUNNING, or releases and kills a half-restored tree.

In process, with the fake CUDA driver (its state must survive the "crash", so the daemon cannot be a
separate process here): the crash is a ``BaseException`` raised at the next phase boundary, which skips
rollback and the operation's end just as a SIGKILL does; the journal on disk is all recovery gets.
Real CRIU, real store and processes.
"""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from gpusnap.daemon.api.types import CheckpointOptions, RestoreOptions
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.drivers.cuda import ProcessState
from gpusnap.daemon.operations import recovery
from gpusnap.daemon.operations.base import OperationKind, OperationRecord, OperationState, PhaseRunner
from gpusnap.daemon.operations.checkpoint import run_checkpoint
from gpusnap.daemon.operations.failpoints import Failpoints
from gpusnap.daemon.operations.registry import OperationRegistry
from gpusnap.daemon.operations.restore import run_restore
from gpusnap.daemon.store.facts import RestoreFacts
from gpusnap.daemon.store.journal import Journal
from tests.conftest import wait_for
from tests.daemon.operations.conftest import NCCL_ENV, GpuNode


class Crash(BaseException):
    """gpusnapd dying at a phase boundary: nothing after it runs, rollback included."""


class CrashAt(Failpoints):
    """A daemon that dies at the start of ``phase`` of operations of ``kind``."""

    def __init__(self, kind: str, phase: str):
        super().__init__()
        self.at = (kind, phase)

    def hit(self, kind: str, phase: str) -> None:
        if (kind, phase) == self.at:
            raise Crash(phase)


def _crashed(node: GpuNode, kind: OperationKind, phase: str, body: object, **kw: object) -> Journal:
    journal = Journal(node.tmp / "journal")
    journal.open()
    record = OperationRecord(kind, journal=journal, **kw)  # type: ignore[arg-type]
    with pytest.raises(Crash):
        PhaseRunner(record, failpoints=CrashAt(kind.value, phase)).run(body)  # type: ignore[arg-type]
    assert not record.done
    return journal


@pytest.mark.parametrize("phase", ["gpu-checkpoint", "dump", "checksum"])
def test_capture_crash_after_gpu_phases(node: GpuNode, phase: str) -> None:
    """After gpu-lock (LOCKED), after gpu-checkpoint (CHECKPOINTED), and with the tree frozen by CRIU."""
    tree = node.start(cuda=("root", "child"), env=NCCL_ENV)
    opts = CheckpointOptions(pid=tree.root)
    journal = _crashed(
        node,
        OperationKind.CHECKPOINT,
        phase,
        lambda run: run_checkpoint(run, node.deps, opts, 0),
        target_pid=tree.root,
    )
    locked = {node.cuda.get_state(p) for p in (tree.root, tree.child)}
    assert locked & {ProcessState.LOCKED, ProcessState.CHECKPOINTED}, "the crash left GPU state to recover"
    [record] = recovery.recover(node.deps, journal, OperationRegistry(journal=journal))
    assert record.state is OperationState.FAILED and record.error is not None
    assert record.error.reason == "DAEMON_RESTARTED" and "keeps running" in record.error.message
    assert {node.cuda.get_state(p) for p in (tree.root, tree.child)} == {ProcessState.RUNNING}
    tree.assert_progressing()
    assert node.listed() == []
    assert journal.entries()[0].state is OperationState.FAILED, "the outcome is durable"


def test_capture_crash_with_the_gpu_locked_waits_for_a_criu_still_dumping(node: GpuNode) -> None:
    """Issue 26, item 4, with the GPU locked: the daemon died with the CUDA processes CHECKPOINTED and its dump
    CRIU still running (stood in for by a process group the journal names as that helper's). Recovery leaves
    the CUDA state alone, and the operation running, until that group is gone; then restores and unlocks."""
    tree = node.start(cuda=("root", "child"), env=NCCL_ENV)
    opts = CheckpointOptions(pid=tree.root)
    journal = _crashed(
        node,
        OperationKind.CHECKPOINT,
        "dump",
        lambda run: run_checkpoint(run, node.deps, opts, 0),
        target_pid=tree.root,
    )
    criu = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        [entry] = journal.entries()
        entry.facts.update(criu_helper=criu.pid, criu_helper_start=proc.start_time(criu.pid))
        journal.write(entry)
        registry = OperationRegistry(journal=journal)
        [record] = recovery.recover(node.deps, journal, registry)
        time.sleep(0.5)
        assert not record.done, "the operation ended while the earlier daemon's CRIU still ran"
        assert {node.cuda.get_state(p) for p in (tree.root, tree.child)} == {ProcessState.CHECKPOINTED}
    finally:
        criu.kill()
        criu.wait()
    wait_for(lambda: record.done, 10, "recovery did not go on once that CRIU was gone")
    assert record.error is not None and "CRIU ended" in record.error.message, record.error
    assert {node.cuda.get_state(p) for p in (tree.root, tree.child)} == {ProcessState.RUNNING}
    tree.assert_progressing()
    registry.shutdown(wait=True)


@pytest.mark.parametrize("phase", ["gpu-unlock", "validate"])
def test_restore_crash_after_gpu_phases(node: GpuNode, phase: str) -> None:
    """A restored tree that had not passed validate: GPUs released (cuda-checkpoint#53), then killed."""
    tree = node.start(cuda=("root",), child=False)
    snap = node.checkpoint_ok(tree.root)
    opts = RestoreOptions(snapshot=snap.id)
    journal = _crashed(node, OperationKind.RESTORE, phase, lambda run: run_restore(run, node.deps, opts, snap))
    restored = node.criu.restored[-1]
    assert psutil.pid_exists(restored.init_pid)
    [record] = recovery.recover(node.deps, journal, OperationRegistry(journal=journal))
    assert record.state is OperationState.FAILED and record.error is not None
    assert "was killed" in record.error.message and record.facts.recovery == "killed"
    wait_for(
        lambda: not psutil.pid_exists(restored.init_pid) or psutil.Process(restored.init_pid).status() == "zombie",
        15,
        "the half-restored tree still runs",
    )
    assert isinstance(record.facts, RestoreFacts) and record.facts.tree is not None
    gpu_pids = list(record.facts.tree.cuda_pids)
    assert all(
        node.cuda.get_state(p) in (ProcessState.CHECKPOINTED, ProcessState.FAILED)
        for p in gpu_pids
        if p in node.cuda.usage()
    ), "GPU state released before the kill"
    assert node.listed() == [snap.id], "the snapshot is kept"
