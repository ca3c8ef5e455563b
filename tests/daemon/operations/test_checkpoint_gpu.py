"""Checkpoint of a tree with (fake) CUDA processes: driver call order, and rollback on every failure.

Real CRIU dumps real processes; the CUDA driver and NVML are fakes (see ``conftest.py``).
"""

from __future__ import annotations

import dataclasses
import errno
import signal
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import Code, DeadlineExceededError, FailedPreconditionError
from gpusnap.daemon.api.types import CheckpointOptions, GpuProcess, Snapshot
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.drivers.criu import CriuError
from gpusnap.daemon.drivers.cuda import CudaError, ProcessState
from gpusnap.daemon.operations.base import OperationKind, OperationRecord, OperationState
from gpusnap.daemon.operations.checkpoint import run_checkpoint
from gpusnap.daemon.operations.registry import OperationRegistry
from tests.conftest import wait_for
from tests.daemon.operations.conftest import (
    GPU_BYTES,
    NCCL_ENV,
    GpuNode,
    RecordingCriu,
    Tree,
    failed_phase,
    phase_names,
    rollback_steps,
    started_phases,
)
from tests.daemon.operations.fakes_nvml import CUDA, DRIVER, fake_uuid

CAPTURE_PHASES = ["preflight", "gpu-lock", "gpu-checkpoint", "dump", "checksum", "publish", "finish"]


def assert_nothing_kept(node: GpuNode) -> None:
    assert node.listed() == [], "no snapshot listed"
    assert node.published_dirs() == [], "nothing under snapshots/"
    assert node.staging() == [], "staging removed"


def assert_source_unharmed(node: GpuNode, tree: Tree) -> None:
    """Every CUDA process RUNNING on its GPU again, and the whole tree alive, not frozen, making progress."""
    for pid in node.cuda.states:
        if pid in tree.pids:
            assert node.cuda.state(pid) is ProcessState.RUNNING, pid
    assert tree.running(), "source tree alive and not stopped"
    tree.assert_progressing()
    assert tree.root in node.nvml.processes_by_pid(), "NVML sees the root on its GPU again"


# -- happy paths ------------------------------------------------------------------------------------------


def test_checkpoint_locks_then_checkpoints_then_dumps_then_kills_the_source(node: GpuNode) -> None:
    tree = node.start()
    root, child = tree.root, tree.child
    opts = CheckpointOptions(pid=root, name="gpu-happy", gpu_lock_timeout_s=2.5)
    record = OperationRecord(OperationKind.CHECKPOINT, target_pid=root)
    registry = OperationRegistry(max_workers=2)
    try:
        registry.start(record, proc.tree_pids(root), lambda run: run_checkpoint(run, node.deps, opts, 0))
        assert record.wait(120), "checkpoint did not finish"
    finally:
        registry.shutdown()
    assert record.error is None, record.error
    assert record.state is OperationState.SUCCEEDED
    snap = record.result
    assert isinstance(snap, Snapshot)

    # The CUDA side is locked and checkpointed, and verified CHECKPOINTED, before CRIU touches the tree.
    assert node.cuda.sequence() == [
        ("get_restore_thread_id", root),
        ("get_restore_thread_id", child),
        ("lock", root),
        ("checkpoint", root),
        ("get_state", root),
        ("criu.dump", root),
        ("criu.post-dump", root),
        ("criu.dumped", root),
    ]
    assert node.cuda.args_of("lock", root) == [(2500,)], "lock timeout from the request, in ms"
    assert node.cuda.state(root) is ProcessState.CHECKPOINTED
    assert phase_names(record) == CAPTURE_PHASES
    assert next(p for p in record.phases if p.phase == "gpu-checkpoint").bytes == GPU_BYTES

    # CRIU killed the source once the snapshot was durable.
    assert tree.killed() == -signal.SIGKILL
    wait_for(lambda: not proc.alive(child), 10, "the source's child survived the checkpoint")

    assert node.listed() == [snap.id]
    assert node.staging() == []
    stored = node.store.get("gpu-happy")
    assert stored.id == snap.id
    assert stored.gpu_processes == (
        GpuProcess(
            pid=root,
            gpu_uuids=(fake_uuid(0),),
            gpu_memory_bytes=GPU_BYTES,
            visible_gpu_uuids=tuple(fake_uuid(i) for i in range(4)),  # CUDA_VISIBLE_DEVICES unset: all of them
        ),
    )
    assert stored.host.nvidia_driver_version == DRIVER
    assert stored.host.cuda_driver_version == CUDA
    assert stored.host.criu_version == node.deps.criu_version
    assert [p.phase for p in stored.phases] == ["preflight", "gpu-lock", "gpu-checkpoint", "dump", "checksum"]
    assert stored.source.tree_pids == (root, child)
    node.store.verify(stored)


def test_checkpoint_of_two_cuda_processes_locks_all_before_checkpointing_any(node: GpuNode) -> None:
    tree = node.start(cuda=("root", "child"), env=NCCL_ENV)
    root, child = tree.root, tree.child
    snap = node.checkpoint_ok(root)
    assert node.cuda.sequence(include_get_state=False) == [
        ("get_restore_thread_id", root),
        ("get_restore_thread_id", child),
        ("lock", root),
        ("lock", child),
        ("checkpoint", root),
        ("checkpoint", child),
        ("criu.dump", root),
        ("criu.post-dump", root),
        ("criu.dumped", root),
    ]
    assert node.cuda.args_of("lock", child) == [(4000,)], "lock timeout from the daemon config, in ms"
    assert {p.pid for p in snap.gpu_processes} == {root, child}
    assert tree.killed() == -signal.SIGKILL


def test_leave_running_resumes_the_gpu_side_after_the_dump(node: GpuNode) -> None:
    tree = node.start()
    root = tree.root
    record = node.checkpoint(root, leave_running=True)
    assert record.error is None, record.error
    assert phase_names(record) == CAPTURE_PHASES + ["gpu-resume"]
    seq = node.cuda.sequence()
    dumped = seq.index(("criu.dumped", root))
    assert seq[: dumped + 1] == [
        ("get_restore_thread_id", root),
        ("get_restore_thread_id", tree.child),
        ("lock", root),
        ("checkpoint", root),
        ("get_state", root),
        ("criu.dump", root),
        ("criu.post-dump", root),
        ("criu.dumped", root),
    ]
    assert seq[dumped + 1 :] == [("get_state", root), ("restore", root), ("unlock", root)]
    assert node.cuda.args_of("restore", root) == [((),)], "back onto its own GPUs: no GPU pairs"
    assert node.listed() == [record.result.id]
    assert_source_unharmed(node, tree)


# -- failures before the dump: nothing dumped, everything RUNNING ---------------------------------------------


@pytest.mark.parametrize("two_cuda", [False, True], ids=["one-cuda-pid", "second-of-two-times-out"])
def test_lock_timeout_unlocks_and_dumps_nothing(node: GpuNode, two_cuda: bool) -> None:
    tree = node.start(cuda=("root", "child") if two_cuda else ("root",), env=NCCL_ENV if two_cuda else None)
    root, child = tree.root, tree.child
    failing = child if two_cuda else root
    node.cuda.lock_timeout(failing)
    record = node.checkpoint(root, name="never")
    assert record.state is OperationState.FAILED
    err = record.error
    assert isinstance(err, CudaError)
    assert err.reason == "CUDA_ERROR_NOT_READY" and err.pid == failing
    assert err.metadata["rollback"] == "ok" and err.metadata["stranded_pids"] == ""
    assert failed_phase(record) == "gpu-lock"
    expected = [("get_restore_thread_id", root), ("get_restore_thread_id", child), ("lock", root)]
    if two_cuda:
        expected += [("lock", child), ("unlock", root)]  # the peer already locked is unlocked
    assert node.cuda.sequence(include_get_state=False) == expected, "no checkpoint, no CRIU dump"
    assert started_phases(record) == ["preflight", "gpu-lock"]
    assert rollback_steps(record) == [("resume-source", "done")]
    assert_nothing_kept(node)
    assert_source_unharmed(node, tree)
    node.store.check_name_free("never")  # the name reservation was released


def test_lock_that_hangs_is_abandoned_and_undone_when_it_returns(node: GpuNode) -> None:
    tree = node.start()
    root = tree.root
    node.gpu.call_timeout_s = 0.5
    release = node.cuda.hang("lock", root)
    record = node.checkpoint(root, gpu_lock_timeout_s=0.2)
    err = record.error
    assert isinstance(err, DeadlineExceededError), err
    assert err.reason == "DRIVER_CALL_TIMEOUT" and err.code is Code.DEADLINE_EXCEEDED
    assert failed_phase(record) == "gpu-lock"
    assert not any(m.startswith("criu.") for m, _ in node.cuda.sequence())
    assert_nothing_kept(node)
    assert node.cuda.state(root) is ProcessState.RUNNING
    release.set()  # the driver finally returns: the abandoned thread must unlock what it locked
    wait_for(lambda: ("unlock", root) in node.cuda.sequence(), 10, "a late lock was not undone")
    wait_for(lambda: node.cuda.state(root) is ProcessState.RUNNING, 10, "left LOCKED after a late lock")
    assert_source_unharmed(node, tree)


@pytest.mark.parametrize("two_cuda", [False, True], ids=["one-cuda-pid", "second-of-two"])
def test_checkpoint_not_supported_rolls_back_to_running(node: GpuNode, two_cuda: bool) -> None:
    """FC-15: CUDA_ERROR_NOT_SUPPORTED from cuCheckpointProcessCheckpoint leaves the worker running."""
    tree = node.start(cuda=("root", "child") if two_cuda else ("root",), env=NCCL_ENV if two_cuda else None)
    root, child = tree.root, tree.child
    failing = child if two_cuda else root
    node.cuda.not_supported("checkpoint", failing)
    record = node.checkpoint(root)
    err = record.error
    assert isinstance(err, CudaError)
    assert err.reason == "CUDA_ERROR_NOT_SUPPORTED" and err.pid == failing
    assert err.metadata["rollback"] == "ok"
    assert failed_phase(record) == "gpu-checkpoint"
    if two_cuda:
        tail = [
            ("lock", root),
            ("lock", child),
            ("checkpoint", root),
            ("checkpoint", child),
            ("restore", root),  # the one already checkpointed comes back first …
            ("unlock", root),
            ("unlock", child),  # … then every LOCKED one is unlocked
        ]
    else:
        tail = [("lock", root), ("checkpoint", root), ("unlock", root)]
    assert node.cuda.sequence(include_get_state=False)[2:] == tail, "no CRIU dump"
    assert rollback_steps(record) == [("gpu-rollback", "done"), ("resume-source", "done")]
    assert_nothing_kept(node)
    assert_source_unharmed(node, tree)


def test_checkpoint_that_silently_does_nothing_is_caught_before_the_dump(node: GpuNode) -> None:
    """The driver reports success but the process is still LOCKED: CRIU must not dump live GPU state (FC-16)."""
    tree = node.start()
    root = tree.root
    node.cuda.noop("checkpoint", root)
    record = node.checkpoint(root)
    err = record.error
    assert isinstance(err, FailedPreconditionError)
    assert err.reason == "CUDA_NOT_CHECKPOINTED" and err.metadata["state"] == "LOCKED"
    assert failed_phase(record) == "gpu-checkpoint"
    assert node.cuda.sequence(include_get_state=False)[2:] == [("lock", root), ("checkpoint", root), ("unlock", root)]
    assert_nothing_kept(node)
    assert_source_unharmed(node, tree)


# -- failures after the GPU checkpoint: CRIU resumes the tree, the GPU side is rolled back ---------------------


def test_criu_dump_failure_after_freezing_restores_the_gpu_side(node: GpuNode) -> None:
    """CRIU froze and dumped the tree, then the dump failed: CRIU resumes the tree, gpusnap restores + unlocks."""
    tree = node.start()
    root = tree.root
    node.criu.fail_post_dump = CriuError(
        "CRIU dump failed: injected", code_cls=FailedPreconditionError, reason="CRIU_DUMP_FAILED", log_lines=[]
    )
    record = node.checkpoint(root, name="lost")
    err = record.error
    assert isinstance(err, CriuError) and err.reason == "CRIU_DUMP_FAILED"
    assert failed_phase(record) == "dump"
    seq = node.cuda.sequence()
    post = seq.index(("criu.post-dump", root))
    assert seq[:post] == [
        ("get_restore_thread_id", root),
        ("get_restore_thread_id", tree.child),
        ("lock", root),
        ("checkpoint", root),
        ("get_state", root),
        ("criu.dump", root),
    ]
    assert seq[post + 1 :] == [("get_state", root), ("restore", root), ("unlock", root)]
    assert rollback_steps(record) == [("gpu-rollback", "done"), ("resume-source", "done")]
    assert_nothing_kept(node)
    assert_source_unharmed(node, tree)
    node.store.check_name_free("lost")


def test_criu_that_cannot_run_restores_the_gpu_side(node: GpuNode, tmp_path: Path) -> None:
    """The CRIU binary fails before freezing anything: same GPU rollback."""
    broken = tmp_path / "criu-broken"
    broken.write_text("#!/bin/sh\necho 'criu: simulated breakage' >&2\nexit 1\n")
    broken.chmod(0o755)
    node.deps = dataclasses.replace(node.deps, criu=RecordingCriu(str(broken), node.criu.pycriu_path, node.cuda))
    tree = node.start()
    root = tree.root
    record = node.checkpoint(root)
    assert isinstance(record.error, CriuError), record.error
    assert failed_phase(record) == "dump"
    seq = node.cuda.sequence()
    assert ("criu.post-dump", root) not in seq
    dump = seq.index(("criu.dump", root))
    assert seq[dump + 1 :] == [("get_state", root), ("restore", root), ("unlock", root)]
    assert_nothing_kept(node)
    assert_source_unharmed(node, tree)


def test_publish_failure_resumes_the_source_and_rolls_back_the_gpu(
    node: GpuNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publishing fails inside CRIU's post-dump (tree frozen, images complete): CRIU resumes, GPU rolled back."""
    tree = node.start()
    root = tree.root

    def full_disk(staging: object, snapshot: Snapshot) -> Snapshot:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(node.store, "publish", full_disk)
    record = node.checkpoint(root, name="full")
    assert record.state is OperationState.FAILED
    assert "No space left on device" in str(record.error)
    assert failed_phase(record) == "publish"
    assert phase_names(record)[-1] == "checksum", "images were complete when publishing failed"
    seq = node.cuda.sequence()
    post = seq.index(("criu.post-dump", root))
    assert ("criu.dumped", root) not in seq
    assert seq[post + 1 :] == [("get_state", root), ("restore", root), ("unlock", root)]
    assert rollback_steps(record) == [("gpu-rollback", "done"), ("resume-source", "done")]
    assert_nothing_kept(node)
    assert_source_unharmed(node, tree)
    node.store.check_name_free("full")


def test_leave_running_gpu_resume_failure_is_retried_by_the_rollback(node: GpuNode) -> None:
    """With leave_running, a failed GPU resume fails the operation; the rollback retries it, deletes the
    snapshot (nothing is listed after a failure) and the source ends up RUNNING."""
    tree = node.start()
    root = tree.root
    node.cuda.fail("restore", root)  # the first restore (gpu-resume) fails, the rollback's retry works
    record = node.checkpoint(root, leave_running=True, name="resume-fails")
    err = record.error
    assert isinstance(err, FailedPreconditionError) and err.reason == "GPU_ROLLBACK_INCOMPLETE", err
    assert failed_phase(record) == "gpu-resume"
    assert [s for s, _ in rollback_steps(record)] == ["unpublish", "gpu-rollback", "resume-source"]
    assert all(msg == "done" for _, msg in rollback_steps(record))
    assert node.cuda.sequence(include_get_state=False)[-3:] == [("restore", root), ("restore", root), ("unlock", root)]
    assert_nothing_kept(node)
    assert_source_unharmed(node, tree)
