"""Standbys on real CRIU with the fake CUDA driver: a snapshot restored ahead (stopped, CUDA-checkpointed,
holding no GPU memory), activated onto a chosen GPU later; a failed activation leaves nothing running; one
standby claimed by one activation; standbys found again (or dropped cleanly) after a daemon restart."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from gpusnap.daemon.api.types import RestoreOptions, RestoreResult, Snapshot
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.drivers.cuda import CudaResult, ProcessState
from gpusnap.daemon.operations.base import OperationKind, OperationRecord
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.operations.standby import StandbyOptions, drop, run_activate, run_standby
from gpusnap.daemon.park.standbys import Standby, StandbyRegistry
from tests.conftest import wait_for
from tests.daemon.operations.conftest import GPU_BYTES, GpuNode, Tree, phase_names, processes_with
from tests.daemon.operations.fakes_nvml import fake_uuid

U0, U1 = fake_uuid(0), fake_uuid(1)


@pytest.fixture
def deps(node: GpuNode, tmp_path: Path) -> Deps:
    return dataclasses.replace(node.deps, standbys=StandbyRegistry(tmp_path / "store" / "standbys.json"))


def checkpointed(node: GpuNode, tree: Tree) -> Snapshot:
    snap = node.checkpoint_ok(tree.root)
    tree.killed()
    wait_for(lambda: not processes_with(str(tree.workload.workdir)), 10, "the source tree survived its checkpoint")
    return snap


def stand_by(node: GpuNode, deps: Deps, snap: Snapshot, count: int = 1) -> list[Standby]:
    record = node.run(
        OperationKind.STANDBY, lambda run: run_standby(run, deps, StandbyOptions(snap.id, count=count), snap)
    )
    assert record.error is None, record.error
    for sb in record.result:
        node.workloads.adopt(sb.root)
    return list(record.result)


def activate(node: GpuNode, deps: Deps, sb: Standby, **opts: object) -> OperationRecord:
    assert deps.standbys is not None
    claimed = deps.standbys.claim(sb.id)
    assert claimed is not None
    options = RestoreOptions(snapshot=sb.snapshot_id, **opts)  # type: ignore[arg-type]
    snapshot = deps.store.get(sb.snapshot_id)
    return node.run(OperationKind.ACTIVATE, lambda run: run_activate(run, deps, claimed, options, snapshot))


def test_standby_holds_no_gpu_and_activation_brings_the_tree_back_on_the_chosen_gpu(node: GpuNode, deps: Deps) -> None:
    tree = node.start(cuda=("root",))
    snap = checkpointed(node, tree)
    dumped_at = tree.workload.last("parent.log")
    (sb,) = stand_by(node, deps, snap)
    assert deps.standbys is not None and deps.standbys.list() == [sb]
    assert node.nvml.processes_by_pid() == {}, "a standby holds no GPU memory"
    assert not [c for c in node.cuda.sequence() if c[1] == sb.root], (
        "nothing asks the CUDA checkpoint API about a stopped standby (the driver waits on a process that cannot answer)"
    )
    assert all(proc.stopped(p) for p in proc.tree_pids(sb.root)), "every task of the standby is stopped"
    assert sb.host_memory_bytes > 4 << 20, "its resident memory is counted (4 MiB of pattern at least)"
    assert tree.workload.last("parent.log") == dumped_at, "the standby does not run"
    assert (Path(deps.store.root) / "standbys.json").read_text().count(sb.id) == 1, "registered durably"

    record = activate(node, deps, sb, gpu_map={U0: U1})
    assert record.error is None, record.error
    assert phase_names(record) == ["preflight", "wake", "gpu-restore", "gpu-unlock", "validate"]
    result = record.result
    assert isinstance(result, RestoreResult) and result.pid == sb.root
    assert node.cuda.state(sb.root) is ProcessState.RUNNING
    assert node.nvml.processes_by_pid() == {sb.root: [(U1, GPU_BYTES)]}, "on the GPU the activation chose"
    wait_for(lambda: tree.workload.last("parent.log") > dumped_at + 2, 15, "the activated tree does not run")
    counts = tree.workload.read("parent.log").split()
    assert counts[counts.index(str(dumped_at)) + 1] == str(dumped_at + 1), "it goes on from where it was dumped"
    assert deps.standbys.list() == [], "an activated standby is gone"


def test_a_failed_activation_leaves_no_half_running_tree(node: GpuNode, deps: Deps) -> None:
    tree = node.start(cuda=("root",))
    snap = checkpointed(node, tree)
    (sb,) = stand_by(node, deps, snap)
    node.cuda.fail("unlock", sb.root, result=CudaResult.CUDA_ERROR_UNKNOWN)
    record = activate(node, deps, sb)
    assert record.error is not None and "cuCheckpointProcessUnlock" in record.error.message
    wait_for(lambda: not proc.alive(sb.root), 10, "the failed activation's tree survived")
    released = [m for m, p, alive in node.cuda.liveness if p == sb.root and m == "checkpoint"]
    assert released, "its GPU state was released before the kill (cuda-checkpoint#53)"
    assert deps.standbys is not None and deps.standbys.list() == []
    assert node.store.buffers._pins == {}


def test_one_standby_goes_to_one_activation(node: GpuNode, deps: Deps) -> None:
    tree = node.start(cuda=("root",))
    snap = checkpointed(node, tree)
    (sb,) = stand_by(node, deps, snap)
    assert deps.standbys is not None
    got: list[Standby | None] = []
    barrier = threading.Barrier(4)

    def claim() -> None:
        barrier.wait()
        got.append(deps.standbys.claim(sb.id))  # type: ignore[union-attr]

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(1 for g in got if g is not None) == 1, got


def test_standbys_are_adopted_after_a_restart_or_dropped_cleanly(node: GpuNode, deps: Deps, tmp_path: Path) -> None:
    tree = node.start(cuda=("root",), child=False)
    snap = checkpointed(node, tree)
    kept, lost = stand_by(node, deps, snap, count=2)
    proc.kill_tree([lost.root])  # its tree dies while gpusnapd is away
    wait_for(lambda: not proc.alive(lost.root), 10, "the standby did not die")
    again = StandbyRegistry(tmp_path / "store" / "standbys.json")  # gpusnapd's next start
    adopted, dropped = again.adopt(lambda sb: "")
    assert [s.id for s in adopted] == [kept.id]
    assert [(s.id, why) for s, why in dropped] == [(lost.id, "its tree is gone")]
    assert lost.id not in (tmp_path / "store" / "standbys.json").read_text()
    third = StandbyRegistry(tmp_path / "store" / "standbys.json")
    adopted, dropped = third.adopt(lambda sb: "its snapshot was deleted")
    assert adopted == [] and dropped[0][1] == "its snapshot was deleted"
    wait_for(lambda: not proc.alive(kept.root), 10, "a standby that could not be adopted was not killed")


def test_drop_kills_the_standby_and_unpins(node: GpuNode, deps: Deps) -> None:
    tree = node.start(cuda=("root",), child=False)
    snap = checkpointed(node, tree)
    (sb,) = stand_by(node, deps, snap)
    assert drop(deps, sb.id) == sb
    wait_for(lambda: not proc.alive(sb.root), 10, "the dropped standby survived")
    assert drop(deps, sb.id) is None
    gone = deps.standbys.gone(sb.id) if deps.standbys is not None else None
    assert gone is not None and gone.snapshot_id == snap.id
