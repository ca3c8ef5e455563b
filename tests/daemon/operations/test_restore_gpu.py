"""Restore of a snapshot holding (fake) CUDA state: CRIU restore → cuCheckpointProcessRestore (with GPU pairs
when moving) → unlock → RUNNING verified; and what a failure leaves behind.

The fake driver models the real one around CRIU: a process it checkpointed comes back CHECKPOINTED under its
new host PID when CRIU restores it (``ProcessCuda.adopted``).
"""

from __future__ import annotations

import pytest

from gpusnap.daemon.api.errors import FailedPreconditionError, InvalidArgumentError
from gpusnap.daemon.api.types import RestoreResult, Snapshot
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.drivers.cuda import CudaError, CudaResult, ProcessState
from gpusnap.daemon.operations.base import OperationState
from tests.conftest import wait_for
from tests.daemon.operations.conftest import (
    GPU_BYTES,
    MIB,
    NCCL_ENV,
    GpuNode,
    Tree,
    failed_phase,
    phase_names,
    processes_with,
    rollback_steps,
    started_phases,
)
from tests.daemon.operations.fakes_nvml import GIB, fake_uuid

RESTORE_PHASES = ["preflight", "verify", "restore", "gpu-restore", "gpu-unlock", "validate"]
U0, U1, U2, U3 = (fake_uuid(i) for i in range(4))


def checkpointed(node: GpuNode, tree: Tree) -> Snapshot:
    """Checkpoint ``tree`` (its source is killed) and return the snapshot."""
    snap = node.checkpoint_ok(tree.root)
    tree.killed()
    wait_for(lambda: not processes_with(str(tree.workload.workdir)), 10, "the source tree survived its checkpoint")
    return snap


def host_pid_of(result: RestoreResult, source_pid: int) -> int:
    """The restored host PID whose namespace PID is ``source_pid``."""
    matches = [p for p in result.pids if proc.namespace_pid(p) == source_pid]
    assert len(matches) == 1, (result, source_pid)
    return matches[0]


def test_restore_restores_unlocks_and_verifies_every_cuda_process(node: GpuNode) -> None:
    tree = node.start(cuda=("root", "child"), env=NCCL_ENV)
    node.cuda.used[tree.child] = [U1]  # root on GPU 0, child on GPU 1 (both see all four)
    snap = checkpointed(node, tree)
    mark = len(node.cuda.calls)
    record = node.restore(snap.id)
    assert record.error is None, record.error
    result = record.result
    assert isinstance(result, RestoreResult)
    r, c = result.pid, host_pid_of(result, tree.child)
    assert result.namespace_pid == tree.root and proc.namespace_pid(r) == tree.root
    assert node.cuda.adopted == {r: tree.root, c: tree.child}, "both came back CHECKPOINTED"
    assert node.cuda.calls_since(mark) == [
        ("criu.restored", tree.root),
        ("restore", r),
        ("restore", c),
        ("unlock", r),
        ("unlock", c),
        ("get_state", r),
        ("get_state", c),
    ]
    assert node.cuda.args_of("restore", r) == [((),)], "identity: no GPU pairs"
    assert phase_names(record) == RESTORE_PHASES
    assert next(p for p in record.phases if p.phase == "gpu-restore").bytes == 2 * GPU_BYTES
    assert node.cuda.state(r) is ProcessState.RUNNING and node.cuda.state(c) is ProcessState.RUNNING
    assert node.nvml.processes_by_pid() == {r: [(U0, GPU_BYTES)], c: [(U1, GPU_BYTES)]}
    assert all(proc.alive(p) and not proc.stopped(p) for p in (r, c))
    parent = tree.workload.last("parent.log")  # the restored parent keeps appending to the same file
    kid = tree.workload.last("child.log")
    wait_for(lambda: tree.workload.last("parent.log") > parent + 2, 15, "the restored parent does not run")
    wait_for(lambda: tree.workload.last("child.log") > kid + 2, 15, "the restored child does not run")
    assert node.listed() == [snap.id]


@pytest.mark.parametrize(
    ("how", "visible", "pairs"),
    [
        # The pairs permute every GPU the process sees (a lone (U0, U1) pair is refused by the driver).
        ("explicit-map", None, ((U0, U1), (U1, U0), (U2, U2), (U3, U3))),
        ("original-gpu-full", None, ((U0, U1), (U1, U0), (U2, U2), (U3, U3))),
        ("explicit-map", (0, 1), ((U0, U1), (U1, U0))),
        ("explicit-map", (0, 2), ((U0, U1), (U2, U2))),
    ],
    ids=["explicit-all-visible", "original-gpu-full", "explicit-sees-0-1", "explicit-sees-0-2"],
)
def test_restore_onto_another_gpu_of_the_same_model_passes_gpu_pairs(
    node: GpuNode, how: str, visible: tuple[int, ...] | None, pairs: tuple[tuple[str, str], ...]
) -> None:
    tree = node.start(visible=visible)
    snap = checkpointed(node, tree)
    seen = (U0, U1, U2, U3) if visible is None else tuple(fake_uuid(i) for i in visible)
    assert snap.gpu_processes[0].visible_gpu_uuids == seen
    gpu_map: dict[str, str] = {}
    if how == "explicit-map":
        gpu_map = {U0: U1}
    else:  # someone else filled GPU 0 meanwhile: gpusnap picks the free H200 with the lowest index
        node.nvml.gpu(0).other_used.append((424242, 141 * GIB - 100 * MIB))
    mark = len(node.cuda.calls)
    record = node.restore(snap.id, gpu_map=gpu_map)
    assert record.error is None, record.error
    r = record.result.pid
    assert node.cuda.calls_since(mark) == [
        ("criu.restored", tree.root),
        ("restore", r),
        ("unlock", r),
        ("get_state", r),
    ]
    assert node.cuda.args_of("restore", r) == [(pairs,)]
    assert node.cuda.state(r) is ProcessState.RUNNING
    assert node.nvml.processes_by_pid()[r] == [(U1, GPU_BYTES)], "NVML sees it on the new GPU"
    assert phase_names(record) == RESTORE_PHASES


@pytest.mark.parametrize(
    ("gpus", "gpu_map", "reason"),
    [
        ((0, 1), {U0: U2}, "GPU_MAP_INCOMPLETE"),
        ((0,), {U0: U3}, "GPU_MODEL_MISMATCH"),
        ((0,), {U1: U2}, "GPU_NOT_CHECKPOINTED"),
    ],
    ids=["incomplete", "other-model", "wrong-source"],
)
def test_bad_gpu_map_is_refused_before_criu_restores_anything(
    node: GpuNode, gpus: tuple[int, ...], gpu_map: dict[str, str], reason: str
) -> None:
    tree = node.start(gpus=gpus)
    snap = checkpointed(node, tree)
    assert snap.gpu_processes[0].gpu_uuids == tuple(fake_uuid(i) for i in gpus)
    mark = len(node.cuda.calls)
    record = node.restore(snap.id, gpu_map=gpu_map)
    err = record.error
    assert isinstance(err, InvalidArgumentError), err
    assert err.reason == reason
    assert started_phases(record) == ["preflight"] and failed_phase(record) == "preflight"
    assert node.cuda.calls_since(mark) == [], "no CRIU restore, no driver call"
    assert node.criu.restored == []
    assert not processes_with(str(tree.workload.workdir)), "no process restored"
    assert node.listed() == [snap.id], "the snapshot is kept"


@pytest.mark.parametrize(
    ("faults", "reason", "phase", "released"),
    [
        # FC-18: restore and unlock "succeed" but the process never leaves CHECKPOINTED.
        ({"restore": "noop", "unlock": "noop"}, "CUDA_NOT_RUNNING", "validate", False),
        # The unlock "succeeds" but the process stays LOCKED, holding its GPU memory.
        ({"unlock": "noop"}, "CUDA_NOT_RUNNING", "validate", True),
        # The unlock fails outright: LOCKED, holding GPU memory.
        ({"unlock": "error"}, "CUDA_ERROR_UNKNOWN", "gpu-unlock", True),
        # Restore "succeeds" without effect; the unlock then finds it CHECKPOINTED.
        ({"restore": "noop"}, "CUDA_ERROR_ILLEGAL_STATE", "gpu-unlock", False),
    ],
    ids=["stays-checkpointed", "unlock-noop", "unlock-error", "restore-noop"],
)
def test_unhealthy_gpu_restore_kills_the_restored_tree_and_keeps_the_snapshot(
    node: GpuNode, faults: dict[str, str], reason: str, phase: str, released: bool
) -> None:
    tree = node.start()
    snap = checkpointed(node, tree)
    for method, kind in faults.items():  # the next call of that method, i.e. on the restored process
        if kind == "noop":
            node.cuda.noop(method)
        else:
            node.cuda.fail(method, result=CudaResult.CUDA_ERROR_UNKNOWN)
    mark = len(node.cuda.calls)
    record = node.restore(snap.id)
    assert record.state is OperationState.FAILED
    err = record.error
    assert isinstance(err, (FailedPreconditionError, CudaError)), err
    assert err.reason == reason
    assert failed_phase(record) == phase
    assert [s for s, _ in rollback_steps(record)] == ["release-gpus", "kill-restored"], "GPUs released, then kill"
    assert all(msg == "done" for _, msg in rollback_steps(record)), rollback_steps(record)

    (r,) = node.cuda.adopted  # the restored root, as the driver saw it
    after = node.cuda.calls_since(mark, include_get_state=False)
    assert after[:3] == [("criu.restored", tree.root), ("restore", r), ("unlock", r)]
    if released:  # LOCKED with GPU memory: checkpointed (memory released) while still alive, before the kill
        assert after[3:] == [("checkpoint", r)]
        assert ("checkpoint", r, True) in node.cuda.liveness
        assert node.cuda.state(r) is ProcessState.CHECKPOINTED
    else:
        assert after[3:] == [], "a CHECKPOINTED process holds no GPU state: nothing to release"
    wait_for(lambda: not proc.alive(r), 15, "the restored root survived a failed restore")
    wait_for(lambda: not processes_with(str(tree.workload.workdir)), 15, "part of the restored tree survived")
    assert node.listed() == [snap.id], "the snapshot is kept"
    node.store.verify(node.store.get(snap.id))


def test_restore_of_the_same_snapshot_works_again_after_a_failed_one(node: GpuNode) -> None:
    tree = node.start()
    snap = checkpointed(node, tree)
    node.cuda.noop("restore")
    node.cuda.noop("unlock")
    assert node.restore(snap.id).state is OperationState.FAILED
    wait_for(lambda: not processes_with(str(tree.workload.workdir)), 15, "the failed restore left processes")
    record = node.restore(snap.id)
    assert record.error is None, record.error
    assert node.cuda.state(record.result.pid) is ProcessState.RUNNING


def test_restore_that_cannot_find_its_root_kills_what_was_restored(
    node: GpuNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = node.start(cuda=())
    snap = checkpointed(node, tree)
    # As if the restored root had exited at once: the namespace init has no child with the root's PID.
    monkeypatch.setattr(proc, "children", lambda pid: [])
    record = node.restore(snap.id)
    monkeypatch.undo()
    err = record.error
    assert isinstance(err, FailedPreconditionError) and err.reason == "RESTORE_INCOMPLETE", err
    (restored,) = node.criu.restored
    wait_for(lambda: not proc.alive(restored.init_pid), 3, "the restored namespace init was left running")
    assert not processes_with(str(tree.workload.workdir)), "restored processes were left running"
