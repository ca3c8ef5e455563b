"""Standby and activation: restore a snapshot's CPU side ahead of demand, and bring it up on a GPU when asked.

Standby (``gpusnap standby SNAPSHOT [--count N]``): the restore's ``preflight`` (without the GPU part: no
GPU is chosen yet) → [``fetch-buffers``] → ``verify`` (image digests) → per copy ``restore`` (CRIU, into a
fresh PID namespace, every task left stopped: CRIU ``--leave-stopped``) → ``validate`` (as many processes
as were frozen, the root alive, every task stopped, every CUDA process CHECKPOINTED: it holds no GPU
memory). The copy is then registered (``gpusnap.daemon.park.standbys``) with its resident memory, its
snapshot's buffers pinned in the buffer store, and gpusnapd registers the RAM-tier blobs of its arenas
for the fill ahead of the activation (``gpu_prefill = "auto"``). A worker's agents stay quiesced: they
wait for their wake files, which only the activation creates. With ``--count`` > 1 the copies get private
network namespaces, as a fan-out's do. A failure kills every copy this operation made.

Activation (``gpusnap activate STANDBY [--gpu UUID]``, or a ``restore`` of a snapshot that has a ready
standby made with the same ``--private-net``): ``preflight`` (the standby claimed: one activation gets
it; its tree journaled as this operation's; the GPU map resolved and checked, as a restore's) → ``wake``
(every task continued) → the restore's ``gpu-restore`` → ``gpu-unlock`` → ``validate`` → ``reload-buffers``
(arenas gpusnapd filled meanwhile are handed over, the rest read back) → ``resume-worker`` (restore
context, canary). Any failure releases the GPUs, then kills the tree (cuda-checkpoint#53): no
half-running tree is left, and the standby is gone either way.

Concurrent activations of one standby: the first claims it; another one (or one that names a standby
activated or dropped since) restores the standby's snapshot instead, from another ready standby of it
when there is one, else cold (``Daemon.activate``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable, Sequence

from gpusnap.daemon.api.errors import FailedPreconditionError, GpusnapError
from gpusnap.daemon.api.types import RestoreOptions, RestoreResult, Snapshot
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.operations import restore
from gpusnap.daemon.operations.base import Phase, PhaseRunner, Undo
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.park.standbys import Standby, StandbyRegistry, kill, new_standby_id, now
from gpusnap.daemon.preflight import restore as restore_preflight
from gpusnap.daemon.store.facts import JournaledTree, RestoreFacts

STOP_WAIT_S = 5.0
"""How long a standby's validation waits for its tasks to show as stopped after CRIU's restore."""


@dataclasses.dataclass(frozen=True)
class StandbyOptions:
    """A validated standby request: ``count`` copies of ``snapshot``."""

    snapshot: str
    count: int = 1
    private_network: bool = False
    timeout_s: float | None = None


def registry(deps: Deps) -> StandbyRegistry:
    """The node's standby registry.

    Raises:
        FailedPreconditionError: this gpusnapd keeps none (reason ``STANDBY_UNAVAILABLE``; embedders only).
    """
    if deps.standbys is None:
        raise FailedPreconditionError("this gpusnapd keeps no standbys", reason="STANDBY_UNAVAILABLE")
    return deps.standbys


def run_standby(run: PhaseRunner, deps: Deps, opts: StandbyOptions, snapshot: Snapshot) -> tuple[Standby, ...]:
    """The body of a standby operation (module docstring); returns the standbys made. ``opts`` as
    ``Daemon.standby`` validated them: ``opts.snapshot`` the id of ``snapshot``, which the caller may restore
    (as ``Daemon.standby`` read it)."""
    standbys = registry(deps)
    private = opts.private_network or opts.count > 1
    ropts = RestoreOptions(
        snapshot=opts.snapshot, timeout_s=opts.timeout_s, private_network=private, replicas=opts.count
    )
    plan = restore.Restore(run, deps, ropts, snapshot)
    prepared = plan.prepare(resolve_gpus=False)
    if snapshot.gpu_processes:  # its activation needs the driver: refuse now rather than then
        deps.gpu.require(f"a standby of snapshot {snapshot.id} (it holds GPU state)")
    with run.phase(Phase.VERIFY) as progress:
        progress.bytes = plan.verify_images(snapshot)
    made: list[Standby] = []
    one = dataclasses.replace(ropts, replicas=1)
    for index in range(opts.count):
        with run.for_copy(f"#{index}" if opts.count > 1 else ""):
            sb, kill = _stand_by(plan, snapshot, one, prepared.digests)
        standbys.add(sb)
        made.append(sb)
        run.on_failure(f"drop-standby-{sb.id}", _dropper(deps, sb.id))
        kill.drop()  # (the drop kills it)
        run.record.note(RestoreFacts, lambda f: dataclasses.replace(f, tree=None))  # registered: the registry's now
    if deps.prefill is not None:  # the fill's blobs, registered ahead of the activation
        deps.prefill.after_publish(snapshot)
    plan.release(prepared)
    return tuple(made)


def _dropper(deps: Deps, standby_id: str) -> Callable[[], None]:
    def undo() -> None:
        drop(deps, standby_id)

    return undo


def _stand_by(
    plan: restore.Restore, snapshot: Snapshot, opts: RestoreOptions, digests: tuple[str, ...]
) -> tuple[Standby, Undo]:
    """One copy: CRIU restore, stopped, validated; its buffers pinned for as long as it stands by. Returns
    it with the undo step that kills its tree, until the registry holds it."""
    run, deps = plan.run, plan.deps
    side = plan.restore_cpu(snapshot, opts, leave_stopped=True)
    assert side.kill is not None
    with run.phase(Phase.VALIDATE):
        restore.check_restored_count(run, snapshot, side)
        pids = proc.tree_pids(side.root)
        deadline = time.monotonic() + STOP_WAIT_S
        while (running := [p for p in pids if not proc.stopped(p)]) and time.monotonic() < deadline:
            time.sleep(0.01)  # a task stops on the SIGSTOP CRIU left pending once it is scheduled
        if running:
            raise FailedPreconditionError(
                f"the standby of {snapshot.id} has running processes {running[:5]} after CRIU's restore, which "
                "should have left them stopped",
                reason="STANDBY_NOT_STOPPED",
            )
        holding = gpu_memory_held(deps, side.cuda_pids)
        if holding:
            raise FailedPreconditionError(
                f"the standby of {snapshot.id} has CUDA processes that hold GPU memory ({holding} bytes by PID): "
                "they were not restored CHECKPOINTED",
                reason="CUDA_NOT_CHECKPOINTED",
            )
        rss = proc.rss_bytes(pids)
    if digests:  # the standby's own pins, until it is dropped or activated
        deps.store.buffers.pin(snapshot.buffer_uid, digests)
    standby = Standby(
        id=new_standby_id(),
        snapshot_id=snapshot.id,
        owner_uid=snapshot.owner_uid,
        created=now(),
        init_pid=side.init_pid,
        init_start=proc.start_time(side.init_pid) if side.init_pid else 0.0,
        root=side.root,
        root_start=proc.start_time(side.root),
        ns_pid=side.ns_pid,
        pids=tuple(pids),
        restored=side.restored,
        cuda_pids=side.cuda_pids,
        private_network=opts.private_network,
        host_memory_bytes=rss,
        digests=digests,
        buffer_uid=snapshot.buffer_uid,
    )
    return standby, side.kill


def drop(deps: Deps, standby_id: str) -> Standby | None:
    """Kill a standby's tree, unpin its buffers and forget it; ``None`` when it is not registered (or an
    activation holds it)."""
    standbys = registry(deps)
    sb = standbys.get(standby_id)
    if sb is None or standbys.claim(standby_id) is None:
        return None
    kill(sb)
    _unpin(deps, sb)
    standbys.remove(standby_id)
    return sb


def drop_lost(deps: Deps, snapshot_id: str = "") -> list[Standby]:
    """Drop every ready standby (of ``snapshot_id``, when given) whose tree is gone: stopped (``gpusnap
    stop``), killed, or ended by its owner, whose processes they are. Such a standby is never offered again:
    a restore restores its snapshot from the images instead (issue 26, item 7: it stayed "ready", and the next
    restore failed ``STANDBY_LOST``). Returns those dropped."""
    standbys = registry(deps)
    lost = [sb for sb in standbys.list(snapshot_id=snapshot_id) if not sb.tree_alive()]
    return [sb for sb in lost if drop(deps, sb.id) is not None]


def gpu_memory_held(deps: Deps, pids: Sequence[int]) -> dict[int, int]:
    """GPU memory that NVML sees ``pids`` hold (PID → bytes); empty for CHECKPOINTED processes, which hold none.

    NVML, not the CUDA checkpoint API: ``cuCheckpointProcessGetState`` waits for its target process, which cannot
    answer while it is stopped (on an H200 a standby's validate waited on it until the test gave up)."""
    nvml = deps.gpu.nvml
    if not pids or nvml is None or not nvml.available():
        return {}
    usage = nvml.processes_by_pid()
    return {p: sum(b for _, b in usage[p]) for p in pids if p in usage}


def adopt(deps: Deps) -> None:
    """At gpusnapd's start (after recovery): keep the registry's standbys whose snapshot is still here, whose
    tasks are all still stopped and whose CUDA processes are all CHECKPOINTED; pin their buffers again and
    register their blobs for the fill. The others are killed and forgotten (``StandbyRegistry.adopt``)."""

    def still_standing(sb: Standby) -> str:
        try:
            deps.store.get(sb.snapshot_id)
        except GpusnapError:
            return f"its snapshot {sb.snapshot_id} is gone"
        if not all(proc.stopped(p) for p in proc.tree_pids_or_empty(sb.root)):
            return "its tasks are no longer all stopped"
        try:
            if gpu_memory_held(deps, sb.cuda_pids):
                return "a CUDA process of it holds GPU memory"
        except GpusnapError as exc:
            return f"its GPU use is unreadable ({exc})"
        return ""

    adopted, _ = registry(deps).adopt(still_standing)
    for sb in adopted:
        if sb.digests:
            deps.store.buffers.pin(sb.buffer_uid, sb.digests)
        if deps.prefill is not None:
            deps.prefill.after_publish(deps.store.get(sb.snapshot_id))


def _forget(standbys: StandbyRegistry, sb: Standby) -> None:
    standbys.remove(sb.id)


def _unpin(deps: Deps, sb: Standby) -> None:
    if sb.digests:
        deps.store.buffers.unpin(sb.buffer_uid, sb.digests)


def run_activate(run: PhaseRunner, deps: Deps, sb: Standby, opts: RestoreOptions, snapshot: Snapshot) -> RestoreResult:
    """The body of an activation of the claimed standby ``sb`` (module docstring); ``opts`` as ``Daemon.activate``
    validated them (``opts.snapshot``: the id of the standby's ``snapshot``, which the caller may restore, as
    the operation's starter read it)."""
    standbys = registry(deps)
    with run.phase(Phase.PREFLIGHT):
        tree = JournaledTree(
            init_pid=sb.init_pid,
            init_start=sb.init_start,
            ns_pid=sb.ns_pid,
            root=sb.root,
            root_start=sb.root_start,
            cuda_pids=sb.cuda_pids,
        )
        run.record.note(  # recovery now owns the tree: it kills it, or adopts it once validated
            RestoreFacts,
            lambda f: dataclasses.replace(
                f,
                standby=sb.id,
                snapshot_id=sb.snapshot_id,
                env=dict(opts.env),
                unset_env=tuple(opts.unset_env),
                values=dict(opts.values),
                tree=tree,
            ),
        )
        forget = run.on_failure("forget-standby", lambda: _forget(standbys, sb))  # (claimed: shown until it is up)
        run.on_failure("kill-restored", lambda: kill(sb))
        unpin = run.on_failure("unpin-buffers", lambda: _unpin(deps, sb))
        run.record.target_snapshot = snapshot.id
        if not sb.tree_alive():
            raise FailedPreconditionError(
                f"standby {sb.id} of {snapshot.id} lost its processes; restore the snapshot instead",
                reason="STANDBY_LOST",
            )
        restore_preflight.check_context(snapshot, opts)
        gpu_map = restore_preflight.resolve_gpu_map(deps.gpu, snapshot, opts)
    checked = (
        deps.store.buffers.start_verify(snapshot.buffer_uid, snapshot.buffers)
        if snapshot.buffers and opts.verify_buffers
        else None
    )

    def buffers_verified() -> None:
        if checked is not None:
            deps.store.raise_damaged(snapshot, checked.result())

    plan = restore.Restore(run, deps, opts, snapshot)
    plan.start_prefill(snapshot, gpu_map)  # while the GPU restores
    with run.phase(Phase.WAKE):
        for pid in proc.tree_pids(sb.root):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                continue
    side = restore.CpuSide(sb.init_pid, sb.ns_pid, sb.root, sb.restored, sb.cuda_pids)
    result = plan.bring_up(snapshot, opts, side, gpu_map, buffers_verified, counted=True)
    unpin.run_now()
    forget.run_now()
    return result
