"""Suspend and resume: checkpoint a process tree's GPU state in place, and bring it back.

Suspend: ``preflight`` → ``gpu-lock`` → ``gpu-checkpoint``. Device memory is copied to host memory and
released; the processes stay alive on the CPU (their CUDA calls block until resumed). Resume:
``preflight`` (GPU map) → ``gpu-restore`` (``gpuPairs`` when moving to other GPUs) → ``gpu-unlock`` →
``validate`` (every CUDA process RUNNING). A failed suspend leaves every process RUNNING.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpusnap.daemon.api.errors import FailedPreconditionError, InvalidArgumentError
from gpusnap.daemon.api.types import GpuProcess
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.drivers.cuda import ProcessState
from gpusnap.daemon.gpu import gpumap
from gpusnap.daemon.gpu.support import GpuTree
from gpusnap.daemon.operations.base import Phase, PhaseRunner
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.preflight import gpu as gpu_preflight


def run_suspend(run: PhaseRunner, deps: Deps, pid: int, lock_timeout_s: float | None) -> tuple[GpuProcess, ...]:
    """The body of a suspend operation; returns what was checkpointed.

    Raises:
        FailedPreconditionError: no GPU support, no CUDA process in the tree (reason ``NO_CUDA_PROCESS``),
            or a capture precondition.
    """
    with run.phase(Phase.PREFLIGHT):
        deps.gpu.require("suspend")
        tree_pids = proc.tree_pids(pid)
        tree = deps.gpu.find_tree(tree_pids)
        if tree is None:
            raise FailedPreconditionError(
                f"the tree of PID {pid} has no CUDA process to suspend",
                reason="NO_CUDA_PROCESS",
                metadata={"pid": str(pid)},
            )
        gpu_preflight.check_tree(deps.gpu, tree, tree_pids, deps.agents.capture_env(tree_pids))
    ctl = deps.gpu.controller(tree.gpu_bytes)
    timeout_ms = int((lock_timeout_s or deps.config.gpu_lock_timeout) * 1000)
    with run.phase(Phase.GPU_LOCK):
        ctl.lock_all(tree.cuda_pids, timeout_ms)
    run.on_failure("gpu-rollback", lambda: ctl.rollback_to_running(tree.cuda_pids).raise_for_problems())
    with run.phase(Phase.GPU_CHECKPOINT) as progress:
        ctl.checkpoint_all(tree.cuda_pids)
        progress.bytes = tree.gpu_bytes
    deps.gpu.suspended[pid] = tree
    return tree.processes


def run_resume(run: PhaseRunner, deps: Deps, pid: int, requested_map: Mapping[str, str]) -> dict[str, str]:
    """The body of a resume operation; returns the GPU map used (old UUID → new UUID).

    Raises:
        FailedPreconditionError: no GPU support, or no suspended CUDA process in the tree (reason ``NOT_SUSPENDED``).
        InvalidArgumentError, ResourceExhaustedError: the GPU map (see :func:`gpumap.resolve_gpu_map`).
    """
    with run.phase(Phase.PREFLIGHT):
        cuda, _ = deps.gpu.require("resume")
        tree_pids = proc.tree_pids(pid)
        known_root = next((p for p in tree_pids if p in deps.gpu.suspended), None)
        known = deps.gpu.suspended.get(known_root) if known_root is not None else None
        if known is None and requested_map:
            raise InvalidArgumentError(
                f"gpusnapd does not know which GPUs the tree of PID {pid} used (it was suspended before a daemon "
                "restart, or by another PID); resume it without --gpu-map, onto its original GPUs",
                reason="SUSPENDED_TREE_UNKNOWN",
            )
        states = {p: _state(cuda, p) for p in tree_pids}
        suspended = [p for p, s in states.items() if s is ProcessState.CHECKPOINTED]
        locked = [p for p, s in states.items() if s is ProcessState.LOCKED]  # left by an earlier failed resume
        if not suspended and not locked:
            raise FailedPreconditionError(
                f"no process of the tree of PID {pid} is suspended (CHECKPOINTED); suspend it first with `gpusnap suspend {pid}`",
                reason="NOT_SUSPENDED",
                metadata={"pid": str(pid)},
            )
        tree = known or GpuTree(cuda_pids=tuple(suspended), processes=())
        gpu_map, _ = gpumap.resolve_for_processes(requested_map, tree.processes, deps.gpu.gpus())
    ctl = deps.gpu.controller(tree.gpu_bytes)
    run.commit("the GPU state is being brought back, which has nothing to roll back to")
    with run.phase(Phase.GPU_RESTORE) as progress:
        visible_of = {g.pid: g.visible_gpu_uuids for g in tree.processes}
        for p in suspended:
            pairs = gpumap.pairs_for_process(gpu_map, visible_of.get(p, ()))
            ctl.restore_all([p], gpumap.gpu_pairs_for_restore(pairs))
        progress.bytes = tree.gpu_bytes
    with run.phase(Phase.GPU_UNLOCK):
        ctl.unlock_all(suspended + locked)
    with run.phase(Phase.VALIDATE):
        ctl.verify_running(suspended + locked)
    if known_root is not None:
        deps.gpu.suspended.pop(known_root, None)
    return gpu_map


def _state(cuda: object, pid: int) -> ProcessState | None:
    try:
        return cuda.get_state(pid)  # type: ignore[attr-defined, no-any-return]
    except Exception:  # not a CUDA process
        return None
