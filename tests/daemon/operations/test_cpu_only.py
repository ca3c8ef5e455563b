"""Trees without CUDA processes: no GPU phase, no GPU driver call beyond discovery."""

from __future__ import annotations

import dataclasses
import signal

from gpusnap.daemon.api.errors import FailedPreconditionError, InvalidArgumentError
from gpusnap.daemon.gpu.support import GpuSupport
from tests.conftest import wait_for
from tests.daemon.operations.conftest import MIB, GpuNode, failed_phase, phase_names, processes_with, started_phases
from tests.daemon.operations.fakes_nvml import DRIVER, fake_uuid

GPU_PHASES = {"gpu-lock", "gpu-checkpoint", "gpu-resume", "gpu-restore", "gpu-unlock"}


def test_cpu_only_tree_has_no_gpu_phases(node: GpuNode) -> None:
    tree = node.start(cuda=())
    root, child = tree.root, tree.child
    record = node.checkpoint(root)
    assert record.error is None, record.error
    snap = record.result
    assert phase_names(record) == ["preflight", "dump", "checksum", "publish", "finish"]
    assert node.cuda.sequence() == [
        ("get_restore_thread_id", root),  # discovery: the driver rejects both PIDs
        ("get_restore_thread_id", child),
        ("criu.dump", root),
        ("criu.post-dump", root),
        ("criu.dumped", root),
    ]
    assert snap.gpu_processes == ()
    assert node.store.get(snap.id).gpu_processes == ()
    assert snap.host.nvidia_driver_version == DRIVER, "host facts still name the node's driver"
    assert tree.killed() == -signal.SIGKILL

    refused = node.restore(snap.id, gpu_map={fake_uuid(0): fake_uuid(1)})
    err = refused.error
    assert isinstance(err, InvalidArgumentError) and err.reason == "GPU_MAP_UNEXPECTED", err
    assert started_phases(refused) == ["preflight"]

    mark = len(node.cuda.calls)
    restored = node.restore(snap.id)
    assert restored.error is None, restored.error
    assert phase_names(restored) == ["preflight", "verify", "restore", "validate"]
    assert node.cuda.calls_since(mark) == [("criu.restored", root)], "no CUDA call on restore"
    assert not GPU_PHASES & {e.phase for e in restored.events}
    assert len(restored.result.pids) == 2
    parent = tree.workload.last("parent.log")
    wait_for(lambda: tree.workload.last("parent.log") > parent + 2, 15, "the restored tree does not run")


def test_gpu_user_the_cuda_driver_does_not_know_is_refused_before_anything_is_locked(node: GpuNode) -> None:
    """NVML shows a tree process on a GPU but it has no checkpointable CUDA context (graphics, MPS, …)."""
    tree = node.start(cuda=())
    node.nvml.gpu(0).other_used.append((tree.child, 64 * MIB))
    record = node.checkpoint(tree.root)
    err = record.error
    assert isinstance(err, FailedPreconditionError) and err.reason == "GPU_PROCESS_NOT_CHECKPOINTABLE", err
    assert err.metadata["pids"] == str(tree.child)
    assert failed_phase(record) == "preflight"
    assert [m for m, _ in node.cuda.sequence()] == ["get_restore_thread_id", "get_restore_thread_id"]
    assert node.listed() == [] and node.staging() == []
    assert tree.running()
    tree.assert_progressing()


def test_node_without_gpu_support_still_checkpoints_cpu_trees(node: GpuNode) -> None:
    reason = "libnvidia-ml.so.1 not found; install the NVIDIA driver"
    node.deps = dataclasses.replace(node.deps, gpu=GpuSupport(None, None, reason, call_timeout_s=5))
    tree = node.start(cuda=())
    record = node.checkpoint(tree.root)
    assert record.error is None, record.error
    assert phase_names(record) == ["preflight", "dump", "checksum", "publish", "finish"]
    assert record.result.host.nvidia_driver_version == "" and record.result.gpu_processes == ()
    assert [m for m, _ in node.cuda.sequence()] == ["criu.dump", "criu.post-dump", "criu.dumped"]
    tree.killed()

    other = node.start(cuda=())
    suspended = node.suspend(other.root)
    err = suspended.error
    assert isinstance(err, FailedPreconditionError) and err.reason == "GPU_UNAVAILABLE" and reason in err.message
    assert other.running()
    assert not processes_with(str(tree.workload.workdir))
