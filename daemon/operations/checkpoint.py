"""Checkpoint: capture a live process tree into a new snapshot.

Phases: ``preflight`` → [``warm-up`` → ``quiesce`` → ``offload`` with worker agents (one in each engine
process: ``gpusnap.daemon.operations.workers``, weights: ``gpusnap.daemon.weights``), or ``wait-ready`` with a control directory] → [``gpu-lock`` → ``gpu-checkpoint``] → ``dump`` (CRIU freezes the tree and
writes images) → ``checksum`` → ``publish`` → ``finish`` (CRIU kills the source, or resumes it with
``leave_running``) → [``gpu-resume`` with ``leave_running``].

``offload`` moves the buffers the worker's agent names (its weights) into the buffer store and frees
them, so neither the CUDA checkpoint nor CRIU carries them; their digests are computed while the GPU
checkpoint and the dump run, and ``publish`` commits them (content-addressed: stored once).

The GPU phases follow the CUDA driver's order (lock all → checkpoint all → CRIU dump; NVIDIA
cuda-checkpoint README, and Dynamo Snapshot's agent): once checkpointed, a CUDA process holds no
``/dev/nvidia*`` file and its device memory sits in host memory, so CRIU captures it as a CPU process.
Any failure after the first lock restores and unlocks every CUDA process, so the source keeps running.

``checksum`` and ``publish`` run inside CRIU's ``post-dump`` notification, while the tree is still
frozen: the source is killed only once its snapshot is durable, and if publishing fails CRIU resumes
the source instead. A failure anywhere leaves the source running and nothing listed.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import structlog

from gpusnap.daemon.access import callers, file_rights
from gpusnap.daemon.api.types import (
    CheckpointOptions,
    HostFacts,
    ProcessFacts,
    ProcessImage,
    Snapshot,
    TcpMode,
    Terminal,
)
from gpusnap.daemon.drivers import devshm, host, proc
from gpusnap.daemon.drivers.criu import dir_bytes
from gpusnap.daemon.gpu.controller import GpuTreeController
from gpusnap.daemon.gpu.support import GpuTree
from gpusnap.daemon.operations import workers
from gpusnap.daemon.operations.base import Phase, PhaseProgress, PhaseRunner, Undo
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.preflight import agents as agent_checks
from gpusnap.daemon.preflight import capture as capture_checks
from gpusnap.daemon.preflight import gpu as gpu_preflight
from gpusnap.daemon.store.facts import CaptureFacts
from gpusnap.daemon.store.manifest import TCP_LABEL
from gpusnap.daemon.store.store import DEV_SHM, IN_PLACE, StagingDir
from gpusnap.daemon.weights import capture as weights

log = structlog.get_logger(__name__)


def host_facts(deps: Deps) -> HostFacts:
    """Facts about this host for a manifest."""
    model, flags = host.cpu_model_and_flags()
    driver, cuda = deps.gpu.driver_versions()
    return HostFacts(
        nvidia_driver_version=driver,
        cuda_driver_version=cuda,
        hostname=host.hostname(),
        kernel=host.kernel(),
        machine=host.machine(),
        criu_version=deps.criu_version,
        gpusnap_version=host.gpusnap_version(),
        cpu_model=model,
        cpu_flags=flags,
    )


def run_checkpoint(run: PhaseRunner, deps: Deps, opts: CheckpointOptions, owner_uid: int) -> Snapshot | None:
    """The body of a checkpoint operation (see the module docstring); ``None`` for a dry run, which ends
    after its preflight."""
    return Checkpoint(run, deps, opts, owner_uid).run_all()


@dataclasses.dataclass
class Source:
    """What the ``preflight`` found: the tree, this host, the namespace CRIU enters (0: none), the tree's CUDA
    side (``None``: CPU only) and whether an agent quiesces the worker (the TCP check then waits for it)."""

    facts: ProcessFacts
    host: HostFacts
    ns_pid: int
    enter_ns_of: int
    gpu: GpuTree | None
    agent_quiesces: bool


class Checkpoint:
    """The phases of one checkpoint of ``opts.pid`` (module docstring), in order: :meth:`run_all`."""

    def __init__(self, run: PhaseRunner, deps: Deps, opts: CheckpointOptions, owner_uid: int):
        self.run = run
        self.deps = deps
        self.opts = opts
        self.owner_uid = owner_uid
        self.timeout = opts.timeout_s or deps.config.checkpoint_timeout

    def run_all(self) -> Snapshot | None:
        """preflight → [the workers brought to a capturable state] → [the GPUs checkpointed] → dump and publish →
        finish (the GPUs and workers of a source left running resumed)."""
        run, opts = self.run, self.opts
        source = self.preflight()
        if opts.dry_run:
            return None
        pids = source.facts.tree_pids
        starts = tuple(proc.start_time(p) for p in pids)
        run.record.note(
            CaptureFacts,
            lambda f: dataclasses.replace(f, tree_pids=tuple(pids), starts=starts, leave_running=opts.leave_running),
        )
        run.on_failure("resume-source", lambda: _resume_source(list(pids)))
        capture = workers.prepare_capture(run, self.deps, opts, pids, self.owner_uid)
        if source.agent_quiesces:
            capture_checks.check_tcp(opts, pids, after_quiesce=True)
        if capture.worker and source.gpu:
            source.gpu = self.deps.gpu.find_tree(list(pids))  # the quiesced worker released memory
        gpus = self.checkpoint_gpus(source)
        snapshot, unpublish = self.dump(source, capture)
        if gpus is not None and opts.leave_running:
            with run.phase(Phase.GPU_RESUME):
                gpus[0].rollback_to_running(gpus[1]).raise_for_problems()
        run.commit("the snapshot is published")  # (a source left running: a cancel until here unpublishes it)
        if gpus is not None:
            gpus[2].drop()
        if capture.resume is not None:
            capture.resume.drop()
        workers.finish_capture(self.deps, opts, capture, self.owner_uid)
        unpublish.drop()
        return snapshot

    def preflight(self) -> Source:
        """``preflight``: the tree's agents (none running that is not attached to this daemon), its capture checks,
        this host's facts and the GPU preflight of its CUDA side."""
        deps, opts = self.deps, self.opts
        with self.run.phase(Phase.PREFLIGHT):
            facts = proc.facts(opts.pid)
            if opts.control_dir == "" and opts.quiesce:  # --no-quiesce: the caller asked for the tree as it is
                agent_checks.check_attached(
                    facts.tree_pids,
                    lambda: [s.info.pid for s in deps.agents.find_all(facts.tree_pids)],
                    deps.config.agent_socket,
                )
            agent_quiesces = opts.control_dir == "" and deps.agents.find(facts.tree_pids) is not None
            capture_checks.check_tree(opts, facts, defer_tcp=agent_quiesces)
            facts_host = host_facts(deps)
            ns_pid = proc.namespace_pid(opts.pid)
            enter_ns_of = opts.pid if ns_pid != opts.pid else 0
            gpu_tree = deps.gpu.find_tree(list(facts.tree_pids))
            if gpu_tree:
                gpu_preflight.check_tree(deps.gpu, gpu_tree, facts.tree_pids, deps.agents.capture_env(facts.tree_pids))
        return Source(facts, facts_host, ns_pid, enter_ns_of, gpu_tree, agent_quiesces)

    def checkpoint_gpus(self, source: Source) -> tuple[GpuTreeController, tuple[int, ...], Undo] | None:
        """``gpu-lock`` → ``gpu-checkpoint`` of the tree's CUDA processes, with the ``gpu-rollback`` undo step
        that brings them back to RUNNING; returns the controller, the CUDA PIDs and that step (``None``: no GPU)."""
        run, tree = self.run, source.gpu
        if not tree:
            return None
        ctl = self.deps.gpu.controller(tree.gpu_bytes)
        lock_timeout_s = self.opts.gpu_lock_timeout_s or self.deps.config.gpu_lock_timeout
        run.record.note(CaptureFacts, lambda f: dataclasses.replace(f, cuda_pids=tuple(tree.cuda_pids)))
        with run.phase(Phase.GPU_LOCK):
            ctl.lock_all(tree.cuda_pids, int(lock_timeout_s * 1000))
        undo = run.on_failure("gpu-rollback", lambda: ctl.rollback_to_running(tree.cuda_pids).raise_for_problems())
        with run.phase(Phase.GPU_CHECKPOINT) as progress:
            ctl.checkpoint_all(tree.cuda_pids)
            ctl.assert_ready_for_dump(tree.cuda_pids, source.facts.tree_pids)
            progress.bytes = tree.gpu_bytes
        return ctl, tree.cuda_pids, undo

    def dump(self, source: Source, capture: workers.Capture) -> tuple[Snapshot, Undo]:
        """``dump`` (CRIU, with :class:`_Publisher` at its ``post-dump``) → ``finish``; returns the snapshot and
        its ``unpublish`` undo step."""
        run, opts, deps = self.run, self.opts, self.deps
        with deps.store.stage(opts.name, self.owner_uid) as staging:
            run.record.note(CaptureFacts, lambda f: dataclasses.replace(f, staging=staging.snapshot_id))
            progress = run.open_phase(Phase.DUMP)
            terminals = capture_checks.outside_terminals(source.facts.tree_pids)  # a shell's job: dumped external
            publish = _Publisher(self, source, capture, staging, terminals, progress)
            nested_kill = bool(source.enter_ns_of) and not opts.leave_running
            deps.criu.dump(
                leave_stopped=nested_kill,
                pid=source.ns_pid,
                images_dir=staging.images,
                work_dir=staging.path,
                leave_running=opts.leave_running,
                tcp=opts.tcp,
                freeze_timeout_s=deps.config.freeze_timeout,
                timeout_s=self.timeout,
                enter_ns_of=source.enter_ns_of,
                on_post_dump=publish,
                on_start=lambda helper: _note_helper(run, helper),
                on_progress=progress.ticks(),  # the images as CRIU writes them (their total is not known before)
            )
            devshm.remove_link_remaps(publish.remaps)
            if nested_kill:  # the tree as it is now: children forked after preflight were dumped too
                proc.kill_tree(sorted(set(source.facts.tree_pids) | set(proc.tree_pids_or_empty(opts.pid))))
            if not opts.leave_running:  # the snapshot holds the ended tree's /dev/shm files: not the host
                devshm.remove_ended(publish.shm_names, publish.frozen)
            run.close_phase()
        assert publish.published is not None
        return publish.published


class _Publisher:
    """CRIU's ``post-dump`` notification (images complete, the tree still frozen): ``dev-shm`` → ``checksum``
    → ``publish``, then ``finish`` opened."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        source: Source,
        capture: workers.Capture,
        staging: StagingDir,
        terminals: tuple[Terminal, ...],
        dumped: PhaseProgress,
    ):
        self.checkpoint = checkpoint
        self.dumped = dumped
        """The ``dump`` phase's progress: its bytes are the images' once CRIU has written them."""
        self.source = source
        self.capture = capture
        self.staging = staging
        self.terminals = terminals
        self.remaps: list[devshm.LinkRemap] = []
        """CRIU's, kept on the host after a dump that kills: the copy has them."""
        self.shm_names: list[devshm.LinkRemap] = []
        """The tree's own /dev/shm files, saved in the snapshot: a dump that ends the tree removes them."""
        self.frozen: list[int] = []
        """The tree as CRIU froze it."""
        self.published: tuple[Snapshot, Undo] | None = None

    def __call__(self, image_bytes: dict[int, int]) -> None:
        run, opts, owner_uid = self.checkpoint.run, self.checkpoint.opts, self.checkpoint.owner_uid
        staging = self.staging
        self.dumped.bytes = dir_bytes(staging.images)
        run.close_phase()
        if run.record.cancel_requested.is_set():  # CRIU resumes the source: nothing is published
            raise run.cancelled(
                "during dump, which CRIU could not stop safely before it had written the images: the source was "
                "resumed then, before anything was published, and the images dropped"
            )
        frozen = proc.tree_pids_or_empty(opts.pid) or list(self.source.facts.tree_pids)  # as CRIU froze it
        self.frozen = list(frozen)
        if owner_uid != 0:  # a set-user-ID program exec'd since preflight: refused, CRIU resumes the tree
            callers.check_plain_rights(frozen, owner_uid)
        held, creds, tree_creds = file_rights.record(frozen)
        shm_files = devshm.files(frozen)
        if shm_files:
            with run.phase(Phase.DEV_SHM) as progress:  # CRIU keeps only names and sizes of these
                progress.bytes = devshm.save(shm_files, staging.images / DEV_SHM)
            self.remaps.extend(devshm.link_remaps(shm_files))
            self.shm_names = [n for n in devshm.named(shm_files) if n not in self.remaps]
        with run.phase(Phase.CHECKSUM) as progress:
            files = self.checkpoint.deps.store.describe_images(staging.images, progress.every_percent())
            progress.bytes = sum(f.size_bytes for f in files)
            buffers = weights.commit(self.capture.parts, lambda staged: workers.note_staged(run, staged))
        if opts.leave_running:  # the source keeps its files: no restore continues them in place
            (staging.path / IN_PLACE).touch(mode=0o600)
        with run.phase(Phase.PUBLISH):
            snapshot = Snapshot(
                id=staging.snapshot_id,
                name=opts.name,
                created=datetime.now(UTC),
                labels=_labels(opts),
                source=dataclasses.replace(self.source.facts, tree_pids=tuple(frozen)),  # the tree as CRIU froze it
                host=self.source.host,
                files=files,
                phases=tuple(run.record.phases),
                owner_uid=owner_uid,
                gpu_processes=self.source.gpu.processes if self.source.gpu else (),
                process_images=tuple(ProcessImage(pid, n) for pid, n in sorted(image_bytes.items())),
                worker=self.capture.worker,
                agents=self.capture.agents,
                buffers=buffers,
                held_files=held,
                owner_creds=creds,
                tree_creds=tree_creds,
                terminals=self.terminals,
            )
            self.checkpoint.deps.store.publish(staging, snapshot)
        run.record.note(CaptureFacts, lambda f: dataclasses.replace(f, snapshot_id=snapshot.id))
        deps = self.checkpoint.deps
        self.published = (snapshot, run.on_failure("unpublish", lambda: _unpublish(deps, snapshot.id)))
        run.open_phase(Phase.FINISH)
        if not opts.leave_running:  # CRIU ends the source once this returns: the snapshot is all there is then
            run.commit("the snapshot is published and CRIU is ending its source")


def _unpublish(deps: Deps, snapshot_id: str) -> None:
    deps.store.delete(snapshot_id)


def _labels(opts: CheckpointOptions) -> dict[str, str]:
    """The caller's labels, plus the TCP mode when it is not the default (restore must use the same)."""
    extra = {} if opts.tcp is TcpMode.REFUSE else {TCP_LABEL: opts.tcp.value}
    return {**opts.labels, **extra}


def _note_helper(run: PhaseRunner, helper: int) -> None:
    """Journal the dump's CRIU helper before it has its request (``operations.leftover_criu``)."""
    start = proc.start_time(helper)
    run.record.note(CaptureFacts, lambda f: dataclasses.replace(f, criu_helper=helper, criu_helper_start=start))


def _resume_source(pids: list[int]) -> None:
    """Make sure no process of the source tree is left stopped (e.g. by a CRIU that was killed), and that
    no link remap of a CRIU killed mid-dump is left beside the files the tree holds. A CRIU killed from
    outside while its parasite ran in a task leaves the parasite's blob mapped there (gpusnapd never kills a
    dump's CRIU: ``drivers.criu``); that is logged, naming the processes, since nothing but their restart
    removes it."""
    proc.ensure_no_frozen(pids)
    devshm.remove_link_remaps(devshm.link_remaps(devshm.files(pids)))
    left = [p for p in pids if proc.maps_name(p, PARASITE_BLOB)]
    if left:
        log.warning("checkpoint.parasite_left", pids=left, mapping=PARASITE_BLOB, why="CRIU was killed mid-dump")


PARASITE_BLOB = "/memfd:CRIUMFD"
"""The mapping of CRIU's parasite blob in a task it infects (compel's ``MEMFD_FNAME``)."""
