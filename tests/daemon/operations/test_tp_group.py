"""The ranks of a tensor-parallel job are one group on the GPU side: restored onto a swapped pair with a
one-to-one map, every rank restored before any is unlocked, and a failure on one rank releases and kills
the whole restored group (fake CUDA driver over real processes, real CRIU).

Capture-side group behaviour (every rank locked before any is checkpointed; a rank whose lock times out or
hangs unlocks the others and dumps nothing) is in ``test_checkpoint_gpu.py`` (``two_cuda`` cases).
"""

from __future__ import annotations

from gpusnap.daemon.api.errors import InvalidArgumentError
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.drivers.cuda import CudaError, CudaResult, ProcessState
from gpusnap.daemon.operations.base import OperationState
from tests.conftest import wait_for
from tests.daemon.operations.conftest import (
    GPU_BYTES,
    NCCL_ENV,
    GpuNode,
    Tree,
    failed_phase,
    processes_with,
    rollback_steps,
)
from tests.daemon.operations.fakes_nvml import fake_uuid
from tests.daemon.operations.test_restore_gpu import checkpointed, host_pid_of

U0, U1, U2 = (fake_uuid(i) for i in range(3))


def _two_ranks(node: GpuNode) -> Tree:
    """Rank 0 (root) on GPU 0 and rank 1 (child) on GPU 1; each sees both, as NCCL ranks of one node do."""
    tree = node.start(cuda=("root", "child"), visible=(0, 1), env=NCCL_ENV)
    node.cuda.used[tree.child] = [U1]
    return tree


def test_ranks_restore_onto_the_swapped_pair(node: GpuNode) -> None:
    tree = _two_ranks(node)
    snap = checkpointed(node, tree)
    mark = len(node.cuda.calls)
    record = node.restore(snap.id, gpu_map={U0: U1, U1: U0})
    assert record.error is None, record.error
    r, c = record.result.pid, host_pid_of(record.result, tree.child)
    assert node.cuda.calls_since(mark, include_get_state=False) == [
        ("criu.restored", tree.root),
        ("restore", r),
        ("restore", c),
        ("unlock", r),
        ("unlock", c),
    ], "every rank restored before any is unlocked"
    swap = ((U0, U1), (U1, U0))
    assert node.cuda.args_of("restore", r) == [(swap,)] and node.cuda.args_of("restore", c) == [(swap,)]
    assert node.nvml.processes_by_pid() == {r: [(U1, GPU_BYTES)], c: [(U0, GPU_BYTES)]}, "ranks swapped GPUs"
    assert all(node.cuda.state(p) is ProcessState.RUNNING for p in (r, c))


def test_two_ranks_onto_one_gpu_is_refused_before_criu(node: GpuNode) -> None:
    tree = _two_ranks(node)
    snap = checkpointed(node, tree)
    mark = len(node.cuda.calls)
    record = node.restore(snap.id, gpu_map={U0: U2, U1: U2})
    err = record.error
    assert isinstance(err, InvalidArgumentError) and err.reason == "GPU_MAP_DUPLICATE_TARGET", err
    assert node.cuda.calls_since(mark) == [] and node.criu.restored == []


def test_a_rank_that_fails_to_restore_releases_and_kills_the_whole_group(node: GpuNode) -> None:
    tree = _two_ranks(node)
    snap = checkpointed(node, tree)
    restores_so_far = sum(1 for call in node.cuda.calls if call.method == "restore")
    node.cuda.fail("restore", result=CudaResult.CUDA_ERROR_INVALID_VALUE, on_call=restores_so_far + 2)  # rank 1
    mark = len(node.cuda.calls)
    record = node.restore(snap.id, gpu_map={U0: U1, U1: U0})
    assert record.state is OperationState.FAILED
    assert isinstance(record.error, CudaError) and failed_phase(record) == "gpu-restore", record.error
    assert "restored (LOCKED)" in record.error.message
    (r,) = [p for p, src in node.cuda.adopted.items() if src == tree.root]
    (c,) = [p for p, src in node.cuda.adopted.items() if src == tree.child]
    after = node.cuda.calls_since(mark, include_get_state=False)
    assert after[:3] == [("criu.restored", tree.root), ("restore", r), ("restore", c)]
    assert ("unlock", r) not in after and ("unlock", c) not in after, "no rank runs while another is not back"
    assert after[3:] == [("checkpoint", r)], "rank 0 (restored, LOCKED) released its GPU memory before the kill"
    assert [s for s, _ in rollback_steps(record)] == ["release-gpus", "kill-restored"]
    wait_for(lambda: not proc.alive(r) and not proc.alive(c), 15, "the restored ranks survived")
    wait_for(lambda: not processes_with(str(tree.workload.workdir)), 15, "part of the restored tree survived")
    assert node.listed() == [snap.id], "the snapshot is kept"
