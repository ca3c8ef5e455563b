"""Worker cooperation around capture and restore: the agents of a process tree, or the control-directory
contract.

An engine runs one agent in every process that holds engine state (vLLM: the front end, each EngineCore,
each Worker; ``gpusnap.adapters.engines.vllm.processes``). Front ends (role ``frontend``, or a single-process worker)
take and give back work; the others hold memory.

Capture: ``warm-up`` (front ends) → ``quiesce`` (front ends first, then every other agent in parallel: KV
release) → ``offload`` (every agent's named buffers to the buffer store, in parallel; one progress event
per process with its bytes and seconds; the staged files, and at commit their digests, are journaled first,
so recovery after a daemon crash hands them back to the quiesced worker before resuming it); or ``wait-ready`` (control directory). Every agent that an agent
names as its engine's process must be attached (``AGENT_MISSING``). Any failure resumes every process the
capture touched (the others first, with their buffers read back, then the front ends), so the source keeps
serving. Restore (after CRIU and CUDA are done): ``reload-buffers`` (every agent in parallel) then
``resume-worker`` (the others in parallel, then the front ends, whose canaries must give the capture-time
tokens). The weights' steps (offload, commit, hand back, reload, prefill) are ``gpusnap.daemon.weights``'s.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from gpusnap.daemon.api.errors import DeadlineExceededError, FailedPreconditionError
from gpusnap.daemon.api.types import CheckpointOptions, RestoreOptions, Snapshot, WorkerInfo
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.operations.base import Phase, PhaseRunner, Undo
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.store.buffers import HeldFiles, StagedBuffers
from gpusnap.daemon.store.facts import CaptureFacts, JournaledAgent, JournaledBuffers
from gpusnap.daemon.weights import capture as weights
from gpusnap.daemon.weights import restore as weights_restore
from gpusnap.daemon.weights.prefill import Prefill
from gpusnap.daemon.workers import controldir
from gpusnap.daemon.workers.agents import AgentInfo, AgentRegistry, AgentSession
from gpusnap.daemon.workers.client import AgentClient
from gpusnap.daemon.workers.parallel import in_parallel


@dataclasses.dataclass
class AgentCapture(weights.AgentWeights):
    """One agent in a capture: its weights, its canary, and whether it needs resuming if the capture fails."""

    canary: str = ""
    quiesced: bool = False

    @property
    def is_front(self) -> bool:
        return self.info.role in ("", "frontend")

    def worker_info(self) -> WorkerInfo:
        i = self.info
        return WorkerInfo(
            engine=i.engine,
            instance_id=i.instance_id,
            wake_dir=i.wake_dir,
            canary_tokens=self.canary,
            uid=i.uid,
            pid=i.pid,
            role=i.role,
            process=i.process,
            weights=i.weights,
            arenas=self.client.arenas if self.announced else (),
            released_bytes=self.client.released_bytes,
        )


@dataclasses.dataclass
class Capture:
    """What :func:`prepare_capture` did: the workers' descriptions, and their buffers staged in the buffer
    store (``gpusnap.daemon.weights.capture``: committed at publish, released when the capture ends)."""

    worker: WorkerInfo | None = None
    agents: tuple[WorkerInfo, ...] = ()
    parts: list[AgentCapture] = dataclasses.field(default_factory=list)
    resume: Undo | None = None
    """The ``resume-worker`` undo step that makes the workers serve again if the capture fails; the checkpoint
    drops it once the snapshot is taken."""

    def close(self) -> bool:
        """Release the staged buffers; returns whether there were any."""
        return weights.release(self.parts)


def _attached_agents(deps: Deps, tree_pids: Collection[int]) -> list[AgentSession]:
    """The tree's agents, once every engine process an agent names has one of its own.

    Raises:
        FailedPreconditionError: one is still missing after ``agent_wait`` seconds (``AGENT_MISSING``, naming it).
    """
    deadline = time.monotonic() + deps.config.agent_wait
    while True:
        sessions = deps.agents.find_all(tree_pids)
        missing = _missing_agents(sessions, tree_pids)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if missing:
        pid, starter = missing[0]
        raise FailedPreconditionError(
            f"PID {pid} ({proc.title(pid) or 'unknown'}), an engine process that the {starter.label} started, has no "
            f"gpusnap agent after {deps.config.agent_wait:g} s (agent_wait), so its memory cannot be prepared for the "
            "capture; install gpusnap into the engine's Python environment (vLLM then loads gpusnap's plugin in every "
            "process it starts), keep GPUSNAP_AGENT_SOCKET set for the whole engine, and restart it",
            reason="AGENT_MISSING",
            metadata={"pid": str(pid)},
        )
    return sessions


def _missing_agents(sessions: Sequence[AgentSession], tree_pids: Collection[int]) -> list[tuple[int, AgentInfo]]:
    """(host PID, the agent that named it) for each named engine process of the tree without an agent."""
    named = [(ns_pid, s.info) for s in sessions for ns_pid in s.info.expect_pids]
    if not named:
        return []
    host_of: dict[int, int] = {}
    for pid in tree_pids:
        try:
            host_of[proc.namespace_pid(pid)] = pid
        except OSError:
            continue  # gone meanwhile
    attached = {s.info.pid for s in sessions}
    return [(host_of[ns], info) for ns, info in named if ns in host_of and host_of[ns] not in attached]


def prepare_capture(
    run: PhaseRunner, deps: Deps, opts: CheckpointOptions, tree_pids: Collection[int], owner_uid: int
) -> Capture:
    """Bring the workers to a capturable state; registers the undo that makes them serve again."""
    cfg = deps.config
    if opts.control_dir:
        cdir = controldir.check_dir(opts.control_dir, owner_uid)
        run.record.note(CaptureFacts, lambda f: dataclasses.replace(f, control_dir=str(cdir)))
        with run.phase(Phase.WAIT_READY):
            controldir.clear(cdir, owner_uid, controldir.RESTORE_COMPLETE, controldir.SNAPSHOT_COMPLETE)
            with run.waiting(), run.stoppable() as cancelled:
                try:
                    controldir.wait_ready(
                        cdir,
                        min(cfg.ready_timeout, opts.timeout_s or cfg.ready_timeout),
                        lambda: proc.alive(opts.pid) and not cancelled(),
                    )
                except DeadlineExceededError:
                    run.check_cancelled(during=True)  # cancelled, rather than not ready
                    raise
        resume = run.on_failure(
            "resume-worker", lambda: controldir.signal_file(cdir, owner_uid, controldir.RESTORE_COMPLETE)
        )
        return Capture(WorkerInfo(control_dir=str(cdir)), resume=resume)
    sessions = deps.agents.find_all(tree_pids)
    if not sessions:
        return Capture()
    if not opts.quiesce:
        raise FailedPreconditionError(
            f"the {sessions[0].info.label} has a gpusnap worker agent attached, whose connection to gpusnapd cannot be "
            "captured; checkpoint it with quiesce (drop --no-quiesce)",
            reason="AGENT_ATTACHED",
        )
    sessions = _attached_agents(deps, tree_pids)
    capture = Capture(parts=[AgentCapture(AgentClient(s)) for s in sessions])
    fronts = [p for p in capture.parts if p.is_front]
    others = [p for p in capture.parts if not p.is_front]
    _check_agents(fronts, capture.parts)
    for part in capture.parts:
        AgentRegistry.unwake(part.info.wake_dir, part.info.instance_id, part.info.uid)
    with run.phase(Phase.WARM_UP), run.waiting():
        for part in fronts:
            part.canary = part.client.warm_up(cfg.warmup_timeout)
    capture.resume = run.on_failure("resume-worker", lambda: _undo(deps, capture, tree_pids))
    agents = tuple(JournaledAgent(p.info.pid, p.info.uid, p.info.instance_id, p.info.wake_dir) for p in capture.parts)
    run.record.note(CaptureFacts, lambda f: dataclasses.replace(f, agents=agents))  # recovery resumes them
    with run.phase(Phase.QUIESCE), run.waiting():
        for part in fronts:  # the front ends stop work first: then nothing runs in the other processes
            _quiesce(part, opts.offload, cfg.quiesce_timeout)
        in_parallel([lambda p=p: _quiesce(p, opts.offload, cfg.quiesce_timeout) for p in others])  # type: ignore[misc]
    if any(p.announced for p in capture.parts):
        with run.phase(Phase.OFFLOAD) as progress:
            progress.bytes = weights.offload(
                capture.parts,
                deps.store.buffers,
                cfg.quiesce_timeout,
                progress,
                journal=lambda staged: note_staged(run, staged),  # recovery hands them back (module docstring)
                before_free=lambda: run.failpoints.hit(run.record.kind.value, "offload-free"),
            )
    infos = [p.worker_info() for p in fronts + others]
    capture.worker, capture.agents = infos[0], tuple(infos[1:])
    return capture


def _check_agents(fronts: Sequence[AgentCapture], parts: Sequence[AgentCapture]) -> None:
    if not fronts:
        raise FailedPreconditionError(
            f"the tree's gpusnap agents ({', '.join(p.info.label for p in parts)}) include none in the engine's front "
            "end, which must stop requests before the others release memory; start the front end with an agent too "
            "(gpusnap's vLLM plugin does)",
            reason="AGENT_MISSING",
        )
    uids = {p.info.uid for p in parts}
    if len(uids) > 1:
        raise FailedPreconditionError(
            f"the tree's gpusnap agents run as several users ({', '.join(map(str, sorted(uids)))}); run the whole "
            "engine as one user",
            reason="AGENT_USERS",
        )


def _quiesce(part: AgentCapture, offload_buffers: bool, timeout_s: float) -> None:
    # Marked before the call: a quiesce that times out still finishes in the worker, which then waits for its
    # wake file, so the undo can always bring it back. A quiesce the agent answered with a failure was undone
    # by the agent itself (it resumed its engine), so there is nothing to resume.
    part.quiesced = True
    try:
        part.announced = part.client.quiesce(offload_buffers, timeout_s)
    except FailedPreconditionError as exc:
        if exc.reason == "AGENT_COMMAND_FAILED":
            part.quiesced = False
        raise


def _undo(deps: Deps, capture: Capture, tree_pids: Collection[int]) -> None:
    try:
        proc.ensure_no_frozen(list(tree_pids))  # a CRIU killed mid-dump may have left it stopped
        for part in capture.parts:
            part.client.close()  # an agent still connected (mid-offload) then waits for its wake file too
        _resume_all([p for p in capture.parts if p.quiesced], lambda p: resume_source(deps, p.info, p.staged))
    finally:
        if capture.close():  # blobs committed before a later failure belong to no snapshot
            deps.store.collect_buffers()


def _resume_all(parts: Sequence[AgentCapture], resume: Callable[[AgentCapture], None]) -> None:
    """Resume the non-front processes in parallel, then the front ends; every one is tried, the first
    failure raised."""
    errors: list[BaseException] = []
    for group in ([p for p in parts if not p.is_front], [p for p in parts if p.is_front]):
        try:
            in_parallel([lambda p=p: resume(p) for p in group])  # type: ignore[misc]
        except Exception as exc:  # keep resuming the rest
            errors.append(exc)
    if errors:
        raise errors[0]


def finish_capture(deps: Deps, opts: CheckpointOptions, capture: Capture, owner_uid: int) -> None:
    """After a successful dump: a source that keeps running (``--leave-running``) serves again, with its
    buffers read back; the staged buffers are released either way."""
    try:
        if not (capture.worker and opts.leave_running):
            return
        if capture.worker.control_dir:
            controldir.signal_file(Path(capture.worker.control_dir), owner_uid, controldir.SNAPSHOT_COMPLETE)
        else:
            _resume_all(capture.parts, lambda p: resume_source(deps, p.info, p.staged))
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
    prefill: Prefill | None = None,
) -> str:
    """Wake the restored workers, hand them their buffers (once ``buffers_verified()`` returns; it raises for
    damaged ones), give them the restore context and check the front ends' canaries; returns the first's
    tokens. ``prefill``: arenas gpusnapd filled meanwhile (``gpusnap.daemon.weights.prefill``), handed over
    instead of read back where they are ready (the caller releases it after)."""
    worker = snapshot.worker
    if worker is None:
        return ""
    if worker.control_dir:
        with run.phase(Phase.RESUME_WORKER):
            cdir = Path(worker.control_dir)
            if opts.env or opts.unset_env:
                controldir.write_context(cdir, snapshot.owner_uid, opts.env, opts.unset_env)
            controldir.signal_file(cdir, snapshot.owner_uid, controldir.RESTORE_COMPLETE)
        return ""
    workers = snapshot.all_workers
    clients: dict[str, AgentClient] = {}

    def connect(w: WorkerInfo) -> None:
        AgentRegistry.wake(w.wake_dir, w.instance_id, w.uid)
        clients[w.instance_id] = AgentClient(deps.agents.wait_for(pids, w.instance_id, deps.config.resume_timeout))

    if snapshot.buffers:
        with run.phase(Phase.RELOAD_BUFFERS) as progress:
            with run.waiting():
                in_parallel([lambda w=w: connect(w) for w in workers])  # type: ignore[misc]
            buffers_verified()  # before the filled memory or the blobs reach the workers
            weights_restore.reload(snapshot, clients, deps.store.buffers, deps.config.resume_timeout, progress, prefill)
            progress.bytes = snapshot.buffer_bytes
    tokens: dict[str, str] = {}

    def resume(w: WorkerInfo) -> None:
        if w.instance_id not in clients:
            connect(w)
        tokens[w.instance_id] = clients[w.instance_id].resume(
            deps.config.resume_timeout, restored=True, env=opts.env, unset_env=opts.unset_env, values=opts.values
        )

    with run.phase(Phase.RESUME_WORKER), run.waiting():
        in_parallel([lambda w=w: resume(w) for w in workers if not w.is_front])  # type: ignore[misc]
        for w in workers:
            if w.is_front:
                resume(w)
                _check_canary(w, tokens[w.instance_id])
    return tokens[worker.instance_id]


def _check_canary(worker: WorkerInfo, tokens: str) -> None:
    if worker.canary_tokens and tokens != worker.canary_tokens:
        raise FailedPreconditionError(
            f"the restored {worker.engine} worker's canary gave tokens [{tokens}], at capture [{worker.canary_tokens}]; "
            "the restored engine is not the captured one (engine state lost?)",
            reason="CANARY_MISMATCH",
        )


def note_staged(run: PhaseRunner, staged: tuple[JournaledBuffers, ...]) -> None:
    """Journal the capture's staged buffers (``weights.capture.staged_facts``) before anything depends on them."""
    run.record.note(CaptureFacts, lambda f: dataclasses.replace(f, staged=staged))


def resume_source(
    deps: Deps, agent: AgentInfo | JournaledAgent, staged: StagedBuffers | HeldFiles | None = None
) -> None:
    """Wake the source's agent after a quiesce, hand it back the buffers it wrote to ``staged``, and resume
    it (a failed capture, ``--leave-running``, or recovery after a daemon crash: ``HeldFiles``)."""
    if not proc.alive(agent.pid):
        return
    AgentRegistry.wake(agent.wake_dir, agent.instance_id, agent.uid)
    try:
        try:
            session = deps.agents.wait_for([agent.pid], agent.instance_id, deps.config.resume_timeout)
        except FailedPreconditionError as exc:
            if exc.reason == "AGENT_LOST":  # it died meanwhile: nothing left to resume
                return
            raise
        client = AgentClient(session)
        if staged is not None:
            weights.hand_back(client, staged, deps.config.resume_timeout)
        client.resume(deps.config.resume_timeout, restored=False)
    finally:
        AgentRegistry.unwake(agent.wake_dir, agent.instance_id, agent.uid)
