"""Worker cooperation around capture and restore: warm-up, quiesce and resume through the worker's agent,
or the control-directory contract.

Capture: ``warm-up`` → ``quiesce`` (agent) → ``offload`` (the buffers the agent names go to the buffer
store), or ``wait-ready`` (control directory), each undone on failure so the source resumes serving, its
buffers read back first. Restore (after CRIU and CUDA are done): ``reload-buffers`` then ``resume-worker``
wakes the restored copy, hands it its buffers and the restore context, and checks that its canary gives the
capture-time tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from pathlib import Path

from gpusnap.adapters._proto import agent_pb2
from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.api.types import CheckpointOptions, RestoreOptions, Snapshot, WorkerInfo
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.operations.base import PhaseRunner
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.store.buffers import StagedBuffers
from gpusnap.daemon.workers import controldir, offload
from gpusnap.daemon.workers.agents import AgentRegistry, AgentSession


@dataclasses.dataclass
class Capture:
    """What :func:`prepare_capture` did: the worker's description, and its buffers staged in the buffer
    store (to be committed at publish, and closed with :meth:`close` when the capture ends)."""

    worker: WorkerInfo | None = None
    staged: StagedBuffers | None = None

    def close(self) -> None:
        if self.staged is not None:
            self.staged.close()
            self.staged = None


def prepare_capture(
    run: PhaseRunner, deps: Deps, opts: CheckpointOptions, tree_pids: Collection[int], owner_uid: int
) -> Capture:
    """Bring the worker to a capturable state; registers the undo that makes it serve again."""
    cfg = deps.config
    if opts.control_dir:
        cdir = controldir.check_dir(opts.control_dir, owner_uid)
        with run.phase("wait-ready"):
            controldir.clear(cdir, owner_uid, controldir.RESTORE_COMPLETE, controldir.SNAPSHOT_COMPLETE)
            controldir.wait_ready(cdir, min(cfg.ready_timeout, opts.timeout_s or cfg.ready_timeout), lambda: proc.alive(opts.pid))
        run.on_failure("resume-worker", lambda: controldir.signal_file(cdir, owner_uid, controldir.RESTORE_COMPLETE))
        return Capture(WorkerInfo(control_dir=str(cdir)))
    session = deps.agents.find(tree_pids)
    if session is None:
        return Capture()
    if not opts.quiesce:
        raise FailedPreconditionError(
            f"PID {session.info.pid} has a gpusnap worker agent attached, whose connection to gpusnapd cannot be "
            "captured; checkpoint it with quiesce (drop --no-quiesce)",
            reason="AGENT_ATTACHED",
        )
    info = session.info
    AgentRegistry.unwake(info.wake_dir, info.instance_id, info.uid)
    with run.phase("warm-up"):
        warm = session.call(agent_pb2.DaemonMessage(warm_up=agent_pb2.WarmUp()), cfg.warmup_timeout, "warm up")
    # Registered before the call: a quiesce that times out still finishes in the worker, which then waits
    # for its wake file, so the undo can always bring it back. A quiesce the agent answered with a failure
    # was already undone by the agent itself (it resumed its engine), so there is nothing to resume.
    refused: list[bool] = []
    capture = Capture()

    def undo() -> None:
        had_buffers = capture.staged is not None
        try:
            proc.ensure_no_frozen(list(tree_pids))  # a CRIU killed mid-dump may have left it stopped
            session.close()  # an agent still connected (mid-offload) then waits for its wake file too
            if not refused:
                resume_source(deps, info.pid, info.instance_id, info.wake_dir, info.uid, capture.staged)
        finally:
            capture.close()
            if had_buffers:  # blobs committed before a later failure belong to no snapshot
                deps.store.collect_buffers()

    run.on_failure("resume-worker", undo)
    with run.phase("quiesce"):
        try:
            quiesced = session.call(agent_pb2.DaemonMessage(quiesce=agent_pb2.Quiesce(offload=opts.offload)),
                                    cfg.quiesce_timeout, "quiesce")
        except FailedPreconditionError as exc:
            if exc.reason == "AGENT_COMMAND_FAILED":
                refused.append(True)
            raise
    if quiesced.buffers:
        with run.phase("offload") as progress:
            capture.staged = offload.stage(session, deps.store.buffers, quiesced.buffers)
            offload.offload(session, capture.staged, cfg.quiesce_timeout)
            progress.bytes = capture.staged.total_bytes
    capture.worker = WorkerInfo(engine=info.engine, instance_id=info.instance_id, wake_dir=info.wake_dir,
                                canary_tokens=warm.details.get("tokens", ""), uid=info.uid, pid=info.pid)
    return capture


def finish_capture(deps: Deps, opts: CheckpointOptions, capture: Capture, owner_uid: int) -> None:
    """After a successful dump: a source that keeps running (``--leave-running``) serves again, with its
    buffers read back; the staged buffers are released either way."""
    worker = capture.worker
    try:
        if not (worker and opts.leave_running):
            return
        if worker.control_dir:
            controldir.signal_file(Path(worker.control_dir), owner_uid, controldir.SNAPSHOT_COMPLETE)
        elif worker.instance_id:
            resume_source(deps, worker.pid, worker.instance_id, worker.wake_dir, worker.uid, capture.staged)
    finally:
        capture.close()


def before_restore(snapshot: Snapshot) -> None:
    """Remove a stale restore-complete, so a restored control-directory worker waits for the real one."""
    worker = snapshot.worker
    if worker and worker.control_dir:
        controldir.clear(Path(worker.control_dir), snapshot.owner_uid, controldir.RESTORE_COMPLETE)


def resume_restored(
    run: PhaseRunner,
    deps: Deps,
    snapshot: Snapshot,
    opts: RestoreOptions,
    pids: Collection[int],
    buffers_verified: Callable[[], None] = lambda: None,
) -> str:
    """Wake the restored worker, hand it its buffers (once ``buffers_verified()`` returns; it raises for
    damaged ones), give it the restore context and check its canary; returns its tokens."""
    worker = snapshot.worker
    if worker is None:
        return ""
    if snapshot.buffers:
        with run.phase("reload-buffers") as progress:
            AgentRegistry.wake(worker.wake_dir, worker.instance_id, worker.uid)
            session = deps.agents.wait_for(pids, worker.instance_id, deps.config.resume_timeout)
            buffers_verified()
            fds = deps.store.buffers.open_for_read(snapshot.buffer_uid, snapshot.buffers)
            offload.reload(session, [b.name for b in snapshot.buffers], fds, deps.config.resume_timeout)
            progress.bytes = snapshot.buffer_bytes
    with run.phase("resume-worker"):
        if worker.control_dir:
            cdir = Path(worker.control_dir)
            if opts.env or opts.unset_env:
                controldir.write_context(cdir, snapshot.owner_uid, opts.env, opts.unset_env)
            controldir.signal_file(cdir, snapshot.owner_uid, controldir.RESTORE_COMPLETE)
            return ""
        AgentRegistry.wake(worker.wake_dir, worker.instance_id, worker.uid)
        session = deps.agents.wait_for(pids, worker.instance_id, deps.config.resume_timeout)
        context = agent_pb2.RestoreContext(env=dict(opts.env), unset_env=list(opts.unset_env), values=dict(opts.values))
        result = _resume(session, deps, agent_pb2.Resume(restored=True, context=context))
    tokens = result.details.get("tokens", "")
    if worker.canary_tokens and tokens != worker.canary_tokens:
        raise FailedPreconditionError(
            f"the restored {worker.engine} worker's canary gave tokens [{tokens}], at capture [{worker.canary_tokens}]; "
            "the restored engine is not the captured one (engine state lost?)",
            reason="CANARY_MISMATCH",
        )
    return tokens


def _resume(session: AgentSession, deps: Deps, resume: agent_pb2.Resume) -> agent_pb2.CommandResult:
    return session.call(agent_pb2.DaemonMessage(resume=resume), deps.config.resume_timeout, "resume")


def resume_source(
    deps: Deps, pid: int, instance_id: str, wake_dir: str, uid: int, staged: StagedBuffers | None = None
) -> None:
    """Wake the source's agent after a quiesce, hand it back the buffers it wrote to ``staged``, and resume
    it (a failed capture, or ``--leave-running``)."""
    if not proc.alive(pid):
        return
    AgentRegistry.wake(wake_dir, instance_id, uid)
    try:
        session = deps.agents.wait_for([pid], instance_id, deps.config.resume_timeout)
        if staged is not None:
            offload.reload(session, staged.names, staged.read_fds(), deps.config.resume_timeout)
        _resume(session, deps, agent_pb2.Resume(restored=False))
    finally:
        AgentRegistry.unwake(wake_dir, instance_id, uid)
