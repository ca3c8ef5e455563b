"""Suspend (lock → checkpoint, in place) and resume (restore → unlock → verify) of live trees."""

from __future__ import annotations

import pytest

from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.api.types import ROOT_CALLER, GpuProcess
from gpusnap.daemon.core import Daemon
from gpusnap.daemon.drivers.cuda import CudaError, ProcessState
from gpusnap.daemon.operations import recovery
from gpusnap.daemon.operations.base import OperationState
from gpusnap.daemon.operations.registry import OperationRegistry
from gpusnap.daemon.store.journal import Journal
from tests.daemon.operations.conftest import GPU_BYTES, GpuNode, failed_phase, phase_names, rollback_steps
from tests.daemon.operations.fakes_nvml import fake_uuid

U0, U1, U2, U3 = (fake_uuid(i) for i in range(4))


@pytest.mark.parametrize(
    ("gpu_map", "target", "used_map"),
    [
        ({}, U0, {U0: U0}),
        # Moving GPU 0's state to GPU 2 permutes every visible GPU: GPU 2 takes GPU 0's place.
        ({U0: U2}, U2, {U0: U2, U1: U1, U2: U0, U3: U3}),
    ],
    ids=["same-gpu", "other-gpu"],
)
def test_suspend_then_resume(node: GpuNode, gpu_map: dict[str, str], target: str, used_map: dict[str, str]) -> None:
    tree = node.start()
    root, child = tree.root, tree.child

    suspended = node.suspend(root)
    assert suspended.error is None, suspended.error
    assert phase_names(suspended) == ["preflight", "gpu-lock", "gpu-checkpoint"]
    assert suspended.result == (
        GpuProcess(pid=root, gpu_uuids=(U0,), gpu_memory_bytes=GPU_BYTES, visible_gpu_uuids=(U0, U1, U2, U3)),
    )
    assert node.cuda.sequence() == [
        ("get_restore_thread_id", root),
        ("get_restore_thread_id", child),
        ("lock", root),
        ("checkpoint", root),
    ]
    assert node.cuda.args_of("lock", root) == [(4000,)]
    assert node.cuda.state(root) is ProcessState.CHECKPOINTED
    assert root in node.gpu.suspended
    assert root not in node.nvml.processes_by_pid(), "GPU memory released"
    assert tree.running(), "the processes stay alive on the CPU"
    tree.assert_progressing()

    mark = len(node.cuda.calls)
    resumed = node.resume(root, gpu_map)
    assert resumed.error is None, resumed.error
    assert phase_names(resumed) == ["preflight", "gpu-restore", "gpu-unlock", "validate"]
    assert resumed.result == used_map
    assert node.cuda.calls_since(mark) == [
        ("get_state", root),  # preflight: which processes are suspended
        ("get_state", child),
        ("restore", root),
        ("unlock", root),
        ("get_state", root),  # validate
    ]
    pairs = () if target == U0 else tuple(sorted(used_map.items()))
    assert node.cuda.args_of("restore", root) == [(pairs,)]
    assert node.cuda.state(root) is ProcessState.RUNNING
    assert node.nvml.processes_by_pid() == {root: [(target, GPU_BYTES)]}
    assert node.gpu.suspended == {}
    assert tree.running()


def test_resume_of_a_tree_that_is_not_suspended(node: GpuNode) -> None:
    tree = node.start()
    record = node.resume(tree.root)
    err = record.error
    assert isinstance(err, FailedPreconditionError) and err.reason == "NOT_SUSPENDED", err
    assert failed_phase(record) == "preflight"
    assert node.cuda.sequence() == [("get_state", tree.root), ("get_state", tree.child)], "nothing restored/unlocked"
    assert node.cuda.state(tree.root) is ProcessState.RUNNING
    assert tree.running()


def test_failed_suspend_leaves_the_tree_running(node: GpuNode) -> None:
    tree = node.start()
    root = tree.root
    node.cuda.not_supported("checkpoint", root)
    record = node.suspend(root)
    assert record.state is OperationState.FAILED
    err = record.error
    assert isinstance(err, CudaError) and err.reason == "CUDA_ERROR_NOT_SUPPORTED"
    assert failed_phase(record) == "gpu-checkpoint"
    assert node.cuda.sequence(include_get_state=False)[2:] == [("lock", root), ("checkpoint", root), ("unlock", root)]
    assert rollback_steps(record) == [("gpu-rollback", "done")]
    assert node.cuda.state(root) is ProcessState.RUNNING
    assert node.gpu.suspended == {}
    assert root in node.nvml.processes_by_pid()
    assert tree.running()


def test_suspend_of_a_cpu_only_tree(node: GpuNode) -> None:
    tree = node.start(cuda=())
    record = node.suspend(tree.root)
    err = record.error
    assert isinstance(err, FailedPreconditionError) and err.reason == "NO_CUDA_PROCESS", err
    assert node.cuda.sequence(include_get_state=False) == [
        ("get_restore_thread_id", tree.root),
        ("get_restore_thread_id", tree.child),
    ]


def test_resume_with_a_gpu_map_of_a_tree_the_daemon_forgot(node: GpuNode) -> None:
    tree = node.start()
    root = tree.root
    assert node.suspend(root).error is None
    node.gpu.suspended.clear()  # as after a gpusnapd restart
    record = node.resume(root, {U0: U2})
    pairs = node.cuda.args_of("restore", root)
    # Either the map is honoured, or the request is refused; silently restoring onto GPU 0 is wrong.
    honoured = pairs == [(((U0, U2), (U1, U1), (U2, U0), (U3, U3)),)]  # one-to-one over all visible GPUs
    refused = record.error is not None and node.cuda.state(root) is ProcessState.CHECKPOINTED
    assert honoured or refused, (record.result, pairs)


def test_suspend_and_resume_idempotency_keys(node: GpuNode) -> None:
    """A retried Suspend or Resume with its idempotency key gets the original operation, also from a daemon
    restarted on the same journal: the tree is suspended and resumed once (the GPU calls say so)."""
    tree = node.start()
    journal = Journal(node.tmp / "journal")
    journal.open()
    daemon = Daemon(node.deps, OperationRegistry(journal=journal))

    first = daemon.suspend(tree.root, ROOT_CALLER, None, "suspend-1")
    assert first.wait(30) and first.error is None, first.error
    assert daemon.suspend(tree.root, ROOT_CALLER, None, "suspend-1") is first
    assert [c for c in node.cuda.sequence() if c[0] == "checkpoint"] == [("checkpoint", tree.root)]

    restarted = Daemon(node.deps, OperationRegistry(journal=journal))  # a new daemon on the same journal
    recovery.recover(node.deps, journal, restarted.registry)
    again = restarted.suspend(tree.root, ROOT_CALLER, None, "suspend-1")
    assert again.id == first.id and again.state is OperationState.SUCCEEDED
    assert node.cuda.state(tree.root) is ProcessState.CHECKPOINTED, "recovery leaves a suspended tree suspended"

    resumed = restarted.resume(tree.root, {}, ROOT_CALLER, "resume-1")
    assert resumed.wait(30) and resumed.error is None, resumed.error
    assert restarted.resume(tree.root, {}, ROOT_CALLER, "resume-1") is resumed
    assert [c for c in node.cuda.sequence() if c[0] == "restore"] == [("restore", tree.root)]
    assert node.cuda.state(tree.root) is ProcessState.RUNNING
    other = restarted.resume(tree.root, {}, ROOT_CALLER, "resume-2")  # a new key is a new request
    assert other.wait(30) and other.error is not None and other.error.reason == "NOT_SUSPENDED"
