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

from gpusnap.daemon.access import callers, file_rights
from gpusnap.daemon.api.types import CheckpointOptions, HostFacts, ProcessImage, Snapshot, TcpMode
from gpusnap.daemon.drivers import devshm, host, proc
from gpusnap.daemon.operations import workers
from gpusnap.daemon.operations.base import PhaseRunner
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.preflight import capture as capture_checks
from gpusnap.daemon.preflight import gpu as gpu_preflight
from gpusnap.daemon.store.checksum import image_files
from gpusnap.daemon.store.manifest import TCP_LABEL
from gpusnap.daemon.store.store import DEV_SHM, IN_PLACE
from gpusnap.daemon.weights import capture as weights


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
    timeout = opts.timeout_s or deps.config.checkpoint_timeout
    with run.phase("preflight"):
        facts = proc.facts(opts.pid)
        agent_quiesces = opts.control_dir == "" and deps.agents.find(facts.tree_pids) is not None
        capture_checks.check_tree(opts, facts, defer_tcp=agent_quiesces)
        facts_host = host_facts(deps)
        ns_pid = proc.namespace_pid(opts.pid)
        enter_ns_of = opts.pid if ns_pid != opts.pid else 0
        gpu_tree = deps.gpu.find_tree(list(facts.tree_pids))
        if gpu_tree:
            gpu_preflight.check_tree(deps.gpu, gpu_tree, facts.tree_pids, deps.agents.capture_env(facts.tree_pids))
    if opts.dry_run:
        return None

    run.record.note(
        tree_pids=list(facts.tree_pids),
        starts=[proc.start_time(p) for p in facts.tree_pids],
        leave_running=opts.leave_running,
    )
    run.on_failure("resume-source", lambda: _resume_source(list(facts.tree_pids)))
    capture = workers.prepare_capture(run, deps, opts, facts.tree_pids, owner_uid)
    worker = capture.worker
    if agent_quiesces:
        capture_checks.check_tcp(opts, facts.tree_pids, after_quiesce=True)
    if worker and gpu_tree:
        gpu_tree = deps.gpu.find_tree(list(facts.tree_pids))  # the quiesced worker released memory
    ctl = None
    if gpu_tree:
        ctl = deps.gpu.controller(gpu_tree.gpu_bytes)
        lock_timeout_s = opts.gpu_lock_timeout_s or deps.config.gpu_lock_timeout
        run.record.note(cuda_pids=list(gpu_tree.cuda_pids))
        with run.phase("gpu-lock"):
            ctl.lock_all(gpu_tree.cuda_pids, int(lock_timeout_s * 1000))
        run.on_failure("gpu-rollback", lambda: ctl.rollback_to_running(gpu_tree.cuda_pids).raise_for_problems())
        with run.phase("gpu-checkpoint") as progress:
            ctl.checkpoint_all(gpu_tree.cuda_pids)
            ctl.assert_ready_for_dump(gpu_tree.cuda_pids, facts.tree_pids)
            progress.bytes = gpu_tree.gpu_bytes
    with deps.store.stage(opts.name, owner_uid) as staging:
        published: list[Snapshot] = []
        remaps: list[devshm.LinkRemap] = []  # CRIU's, kept on the host after a dump that kills: the copy has them
        run.record.note(staging=staging.snapshot_id)

        def publish(image_bytes: dict[int, int]) -> None:  # CRIU's post-dump: images complete, tree still frozen
            run.close_phase()
            frozen = proc.tree_pids_or_empty(opts.pid) or list(facts.tree_pids)  # the tree as CRIU froze it
            if owner_uid != 0:  # a set-user-ID program exec'd since preflight: refused, CRIU resumes the tree
                callers.check_plain_rights(frozen, owner_uid)
            held, creds = file_rights.record(frozen)
            shm_files = devshm.files(frozen)
            if shm_files:
                with run.phase("dev-shm") as progress:  # CRIU keeps only names and sizes of these
                    progress.bytes = devshm.save(shm_files, staging.images / DEV_SHM)
                remaps.extend(devshm.link_remaps(shm_files))
            with run.phase("checksum") as progress:
                files = image_files(staging.images)
                progress.bytes = sum(f.size_bytes for f in files)
                buffers = weights.commit(capture.parts, lambda staged: run.record.note(staged=staged))
            if opts.leave_running:  # the source keeps its files: no restore continues them in place
                (staging.path / IN_PLACE).touch(mode=0o600)
            with run.phase("publish"):
                snapshot = Snapshot(
                    id=staging.snapshot_id,
                    name=opts.name,
                    created=datetime.now(UTC),
                    labels=_labels(opts),
                    source=dataclasses.replace(facts, tree_pids=tuple(frozen)),  # the tree as CRIU froze it
                    host=facts_host,
                    files=files,
                    phases=tuple(run.record.phases),
                    owner_uid=owner_uid,
                    gpu_processes=gpu_tree.processes if gpu_tree else (),
                    process_images=tuple(ProcessImage(pid, n) for pid, n in sorted(image_bytes.items())),
                    worker=worker,
                    agents=capture.agents,
                    buffers=buffers,
                    held_files=held,
                    owner_creds=creds,
                    terminals=terminals,
                )
                deps.store.publish(staging, snapshot)
            published.append(snapshot)
            run.record.note(snapshot_id=snapshot.id)
            run.on_failure("unpublish", lambda: _unpublish(deps, snapshot.id))
            run.open_phase("finish")

        run.open_phase("dump")
        terminals = capture_checks.outside_terminals(facts.tree_pids)  # a shell's job: CRIU dumps them external
        nested_kill = bool(enter_ns_of) and not opts.leave_running
        deps.criu.dump(
            leave_stopped=nested_kill,
            pid=ns_pid,
            images_dir=staging.images,
            work_dir=staging.path,
            leave_running=opts.leave_running,
            tcp=opts.tcp,
            freeze_timeout_s=deps.config.freeze_timeout,
            timeout_s=timeout,
            enter_ns_of=enter_ns_of,
            on_post_dump=publish,
        )
        devshm.remove_link_remaps(remaps)
        if nested_kill:  # the tree as it is now: children forked after preflight were dumped too
            proc.kill_tree(sorted(set(facts.tree_pids) | set(proc.tree_pids_or_empty(opts.pid))))
        run.close_phase()
    if ctl and gpu_tree and opts.leave_running:
        with run.phase("gpu-resume"):
            ctl.rollback_to_running(gpu_tree.cuda_pids).raise_for_problems()
    run.drop_undo("gpu-rollback")
    run.drop_undo("resume-worker")
    workers.finish_capture(deps, opts, capture, owner_uid)
    run.drop_undo("unpublish")
    return published[0]


def _unpublish(deps: Deps, snapshot_id: str) -> None:
    deps.store.delete(snapshot_id)


def _labels(opts: CheckpointOptions) -> dict[str, str]:
    """The caller's labels, plus the TCP mode when it is not the default (restore must use the same)."""
    extra = {} if opts.tcp is TcpMode.REFUSE else {TCP_LABEL: opts.tcp.value}
    return {**opts.labels, **extra}


def _resume_source(pids: list[int]) -> None:
    """Make sure no process of the source tree is left stopped (e.g. by a CRIU that was killed), and that
    no link remap of a CRIU killed mid-dump is left beside the files the tree holds."""
    proc.ensure_no_frozen(pids)
    devshm.remove_link_remaps(devshm.link_remaps(devshm.files(pids)))
