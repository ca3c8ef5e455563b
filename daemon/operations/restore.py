"""Restore: bring a snapshot back as a new process tree.

Phases: ``preflight`` (snapshot readable, caller allowed, host compatible, buffers present with their
sizes, GPU map resolved and GPU preconditions met) → [``fetch-buffers``: blobs the disk tier evicted come
back from the remote store, each chunk checked (``gpusnap.daemon.remote.evict``)] → ``verify`` (image sizes and digests; with
``verify_buffers`` the buffers' digests too, in the background, overlapped with the next phases; without
it, buffers outside the RAM tier are read ahead into the page cache meanwhile) →
``restore`` (CRIU, by default into a fresh PID namespace; a non-root snapshot's files are checked against
its owner's rights before CRIU runs and again before any restored task runs, see ``file_rights``) → [``gpu-restore``
(``cuCheckpointProcessRestore``, with ``gpuPairs`` when remapping) → ``gpu-unlock``] → ``validate`` (CRIU
restored as many processes as were frozen, counted before any ran, the root runs, every CUDA process is RUNNING: CRIU's success alone is not trusted, see
checkpoint-restore/criu#2525 and #2993) → [``reload-buffers`` (the worker gets its buffers back, their
sizes checked, and with ``verify_buffers`` their digests) → ``resume-worker``: the worker's agent resumes
it with the restore context and its canary must give the capture-time tokens; or ``restore-complete`` in
its control directory]. With ``replicas`` > 1 (fan-out) the phases from ``restore`` on run once per copy,
named ``restore#0``, ``restore#1``…, each copy in its own PID and network namespaces with its own restore
context (``{i}`` filled in). A failure releases the GPUs of whatever was restored, kills it (in that order:
cuda-checkpoint#53) and keeps the snapshot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from gpusnap.daemon.access import file_rights, tree_rights
from gpusnap.daemon.api.errors import (
    CancelledError,
    DataLossError,
    FailedPreconditionError,
    GpusnapError,
    NotFoundError,
)
from gpusnap.daemon.api.types import Creds, FileCopy, RestoreOptions, RestoreResult, Snapshot, TcpMode
from gpusnap.daemon.drivers import criu_userpaths, devshm, pagefill, proc, restored
from gpusnap.daemon.drivers.criu import RestoredTree
from gpusnap.daemon.drivers.criu_protocol import Terminals
from gpusnap.daemon.drivers.pagefill import Stats as PageFillStats
from gpusnap.daemon.gpu import gpumap
from gpusnap.daemon.gpu.controller import GpuTreeController
from gpusnap.daemon.operations import file_copies, provenance, workers
from gpusnap.daemon.operations.base import Phase, PhaseRunner, Undo
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.preflight import restore as restore_preflight
from gpusnap.daemon.remote import evict
from gpusnap.daemon.store import checksum
from gpusnap.daemon.store.facts import JournaledTree, RestoreFacts
from gpusnap.daemon.store.imagecheck import ImageCheck
from gpusnap.daemon.store.manifest import TCP_LABEL
from gpusnap.daemon.store.store import DEV_SHM, restore_log_name
from gpusnap.daemon.weights import prefill as weights_prefill

REPLICA_INDEX = "{i}"


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What :meth:`Restore.prepare` checked: the snapshot, its buffer digests (pinned for the operation, their
    ``unpin-buffers`` undo step in ``unpin``), where its GPUs go (``None``: no GPU state, or not resolved), and
    whether its buffers came back from the remote store."""

    snapshot: Snapshot
    digests: tuple[str, ...]
    gpu_map: dict[str, str] | None
    refetched: bool
    unpin: Undo | None = None


@dataclasses.dataclass(frozen=True)
class CpuSide:
    """A tree CRIU restored: its namespace init (0: none) and root (host PIDs), the processes CRIU restored
    (counted at its ``pre-resume``, before any ran), and the host PIDs of its CUDA processes."""

    init_pid: int
    ns_pid: int
    root: int
    restored: tuple[int, ...]
    cuda_pids: tuple[int, ...]
    file_copies: tuple[FileCopy, ...] = ()
    """Files the tree continues writing in copies of its own (``operations.file_copies``)."""
    kill: Undo | None = None
    """The ``kill-restored`` undo step (a standby, once registered, drops it: its drop kills the tree)."""


def run_restore(run: PhaseRunner, deps: Deps, opts: RestoreOptions, snapshot: Snapshot) -> RestoreResult:
    """The body of a restore operation (see the module docstring); ``opts`` as ``Daemon.restore`` validated
    them: ``opts.snapshot`` the id of ``snapshot``, which the caller may restore (its manifest as
    ``Daemon.restore`` read it: a restore reads it once), the replica count within bounds."""
    return Restore(run, deps, opts, snapshot).run_all()


class Restore:
    """The phases of a restore of ``snapshot`` (module docstring), for one operation: ``run_all`` runs them in
    order; a standby and an activation (``operations.standby``) run some of them. ``snapshot`` is the published
    snapshot ``opts.snapshot`` names, as the operation's starter read it (a manifest never changes once
    published)."""

    def __init__(self, run: PhaseRunner, deps: Deps, opts: RestoreOptions, snapshot: Snapshot):
        self.run = run
        self.deps = deps
        self.opts = opts
        self.timeout = opts.timeout_s or deps.config.restore_timeout
        self.snapshot = snapshot
        self._prefill: tuple[weights_prefill.Prefill, Undo] | None = None
        self._images: ImageCheck | None = None
        """The image check :meth:`verify_images` began; every copy's ``pre-resume`` waits for it."""

    def run_all(self) -> RestoreResult:
        """prepare → verify → each copy (CRIU, GPU, validation, the workers) → release."""
        prepared = self.prepare()
        snapshot = prepared.snapshot
        buffers_verified = self.verify(snapshot)
        if self.opts.replicas == 1:
            result = self.copy(snapshot, self.opts, prepared.gpu_map, buffers_verified)
        else:  # fan-out: the copies one after the other, each with its own phases (restore#0, …) and context
            copies = []
            for index in range(self.opts.replicas):
                copy_opts = replica_options(self.opts, index)
                with self.run.for_copy(f"#{index}"):
                    copy_map = (
                        prepared.gpu_map
                        if index == 0
                        else restore_preflight.resolve_gpu_map(self.deps.gpu, snapshot, copy_opts)
                    )
                    copies.append(self.copy(snapshot, copy_opts, copy_map, buffers_verified))
            result = dataclasses.replace(copies[0], replicas=tuple(copies))
        self.release(prepared)
        return result

    def prepare(self, *, resolve_gpus: bool = True) -> Prepared:
        """``preflight`` (and ``fetch-buffers`` when the disk tier evicted some): everything a restore or a
        standby checks before CRIU runs (module docstring; ``gpusnap.daemon.preflight.restore``).
        ``resolve_gpus``: map the snapshot's GPUs and run the GPU preflight now (a standby does that at
        activation).

        Raises:
            As the module docstring's preflight: NotFoundError, InvalidArgumentError, FailedPreconditionError,
            PermissionDeniedError (the owner's files), DataLossError, ResourceExhaustedError.
        """
        run, deps, opts = self.run, self.deps, self.opts
        with run.phase(Phase.PREFLIGHT):
            snapshot = self.snapshot
            deps.store.path_of(snapshot.id)  # still here (deleted before the operation held it: NOT_FOUND)
            run.record.target_snapshot = snapshot.id
            restore_preflight.check_host_compatible(snapshot)
            provenance.check_pulled(deps, snapshot.id)
            restore_preflight.check_request(snapshot, opts)
            digests = tuple(b.sha256 for b in snapshot.buffers)
            unpin = None
            if digests:  # kept from garbage collection until the worker has read them
                deps.store.buffers.pin(snapshot.buffer_uid, digests)
                unpin = run.on_failure("unpin-buffers", lambda: deps.store.buffers.unpin(snapshot.buffer_uid, digests))
            refetch = evict.plan(deps.store, deps.remote, snapshot)
            if refetch is None:
                deps.store.buffers.check_present(snapshot.id, snapshot.buffer_uid, snapshot.buffers)
            restore_preflight.check_files(snapshot, opts, deps.store.shm_dir(snapshot.id))
            gpu_map = restore_preflight.resolve_gpu_map(deps.gpu, snapshot, opts) if resolve_gpus else None
        if refetch is not None:  # evicted from the disk tier: back from the remote store first
            with run.phase(Phase.FETCH_BUFFERS) as progress:
                assert deps.remote is not None
                fetched = evict.fetch(deps.store, deps.remote, refetch, progress.every_percent())
                progress.bytes = fetched.transferred_bytes
            deps.store.buffers.check_present(snapshot.id, snapshot.buffer_uid, snapshot.buffers)
        return Prepared(snapshot, digests, gpu_map, refetch is not None, unpin)

    def release(self, prepared: Prepared) -> None:
        """The end of a successful operation that :meth:`prepare` began: unpin its buffers, and let the tiers
        spill what a fetch brought back."""
        if prepared.unpin is not None:
            prepared.unpin.run_now()
        if prepared.refetched:
            self.deps.store.buffers.schedule_budgets()

    def verify(self, snapshot: Snapshot) -> Callable[[], None]:
        """``verify``: the images (:meth:`verify_images`); the buffers digested (``verify_buffers``) or read ahead
        meanwhile. Returns what raises for damaged buffers once their digests are in (a no-op without
        ``verify_buffers``)."""
        store = self.deps.store
        with self.run.phase(Phase.VERIFY) as progress:
            progress.bytes = self.verify_images(snapshot, progress.every_percent())
            buffers_checked = None
            if snapshot.buffers and self.opts.verify_buffers:  # digested while CRIU and CUDA restore run
                buffers_checked = store.buffers.start_verify(snapshot.buffer_uid, snapshot.buffers)
            elif snapshot.buffers:  # read ahead into the page cache while CRIU restores (a verify reads them anyway)
                store.buffers.prefetch(snapshot.buffer_uid, snapshot.buffers)

        def buffers_verified() -> None:
            if buffers_checked is not None:
                store.raise_damaged(snapshot, buffers_checked.result())

        return buffers_verified

    def verify_images(self, snapshot: Snapshot, progress: checksum.Progress | None = None) -> int:
        """The image check, inside the caller's ``verify`` phase: every size, and the digest of every image CRIU
        parses, now; the digests of the data no code reads before the restored tasks run (CRIU's page images,
        and the /dev/shm files a private /dev/shm gets) while CRIU restores, awaited at its ``pre-resume``
        (``store.imagecheck``; ``progress``: bytes digested now). Returns the bytes hashed now.

        Raises:
            DataLossError: reason ``IMAGE_CHECKSUM``.
        """
        private_shm = self.deps.store.shm_dir(snapshot.id).is_dir() and not self.opts.host_pid_namespace
        check = self.deps.store.verify(snapshot, progress, later=lambda path: _restored_as_data(path, private_shm))
        self._images = check
        return check.hashed_bytes

    def copy(
        self,
        snapshot: Snapshot,
        opts: RestoreOptions,
        gpu_map: dict[str, str] | None,
        buffers_verified: Callable[[], None],
    ) -> RestoreResult:
        """Restore one copy of a checked snapshot: CRIU, GPU, validation, worker resume (module docstring)."""
        self.start_prefill(snapshot, gpu_map)  # while CRIU runs
        side = self.restore_cpu(snapshot, opts)
        return self.bring_up(snapshot, opts, side, gpu_map, buffers_verified)

    def start_prefill(self, snapshot: Snapshot, gpu_map: dict[str, str] | None) -> None:
        """Start filling the worker's arenas in gpusnapd's CUDA context (``gpu_prefill``), if it applies;
        :meth:`bring_up` hands them over. Its ``release-prefill`` undo step closes it on a failure, or once the
        workers have what they need."""
        prefill = weights_prefill.start(self.deps.prefill, self.deps.store.buffers, snapshot, gpu_map)
        self._prefill = None if prefill is None else (prefill, self.run.on_failure("release-prefill", prefill.close))

    def restore_cpu(self, snapshot: Snapshot, opts: RestoreOptions, *, leave_stopped: bool = False) -> CpuSide:
        """The ``restore`` phase: CRIU brings the tree back (its CUDA processes CHECKPOINTED: no GPU memory),
        journaled for recovery, with a ``kill-restored`` undo step. ``leave_stopped``: every task is left
        stopped (a standby).

        Raises:
            FailedPreconditionError: CRIU restored too little (``RESTORE_INCOMPLETE``); as ``CriuDriver.restore``.
        """
        run = self.run

        def context(f: RestoreFacts) -> RestoreFacts:
            return dataclasses.replace(
                f,
                snapshot_id=snapshot.id,
                env=dict(opts.env),
                unset_env=tuple(opts.unset_env),
                values=dict(opts.values),
                # a fan-out's earlier copy: recovery must find every copy's tree
                earlier_trees=(*f.earlier_trees, f.tree) if f.tree is not None else f.earlier_trees,
                tree=None,
            )

        run.record.note(RestoreFacts, context)
        with run.phase(Phase.RESTORE) as progress:
            workers.before_restore(snapshot)
            assert self._images is not None, "verify_images runs before any copy's restore"
            hooks = _CriuHooks(run, snapshot, self.deps.store.restore_scratch(_label(run)), self._images)
            try:
                tree = self._criu_restore(snapshot, opts, hooks, leave_stopped, progress.ticks(snapshot.size_bytes))
            except GpusnapError as exc:
                if not isinstance(exc, DataLossError):  # a damaged page image can make CRIU fail: say so
                    self._images.wait()
                raise
            progress.bytes = snapshot.size_bytes
            # Without a namespace init, ns_pid is the host PID; register before anything else can fail.
            kill = run.on_failure("kill-restored", lambda: _kill_tree(tree.init_pid, tree.ns_pid))
            if tree.page_fill is not None:  # what filled the private pages, for `gpusnap wait --events` and benches
                progress.report(progress.bytes, snapshot.size_bytes, _page_fill_message(tree.page_fill))
            init_start = proc.start_time(tree.init_pid or tree.ns_pid)
            root = _host_root_pid(tree.init_pid, tree.ns_pid)
            root_start = proc.start_time(root)
            _note_tree(
                run,
                lambda t: dataclasses.replace(
                    t,
                    init_pid=tree.init_pid,
                    ns_pid=tree.ns_pid,
                    init_start=init_start,
                    root=root,
                    root_start=root_start,
                ),
            )
        cuda_pids = _restored_cuda_pids(run, snapshot, root)
        return CpuSide(tree.init_pid, tree.ns_pid, root, tuple(hooks.restored), cuda_pids, tree.file_copies, kill=kill)

    def _criu_restore(
        self,
        snapshot: Snapshot,
        opts: RestoreOptions,
        hooks: _CriuHooks,
        leave_stopped: bool,
        on_progress: Callable[[int], None],
    ) -> RestoredTree:
        """CRIU's restore of ``snapshot`` into fresh namespaces (or the host's), its ``/dev/shm`` files back
        (private, or the host's with the dump's link remaps put back for CRIU and removed after); ``on_progress``
        gets the bytes read so far while CRIU runs."""
        run, store = self.run, self.deps.store
        shm_dir = store.shm_dir(snapshot.id)
        private_shm = shm_dir.is_dir() and not opts.host_pid_namespace
        remaps = _put_back_link_remaps(run, shm_dir) if shm_dir.is_dir() and not private_shm else []
        with contextlib.ExitStack() as stack:  # into a fresh PID namespace, a cancel stops CRIU at once
            cancelled = None if opts.host_pid_namespace else stack.enter_context(run.stoppable())
            try:
                tree = self.deps.criu.restore(
                    images_dir=store.images_dir(snapshot.id),
                    work_dir=store.images_dir(snapshot.id).parent,
                    log_name=restore_log_name(_label(run)),
                    new_pidns=not opts.host_pid_namespace,
                    tcp=_tcp_mode_of(snapshot),
                    timeout_s=self.timeout,
                    new_netns=opts.private_network,
                    shm_dir=shm_dir if private_shm else None,
                    before_resume=hooks.before_resume,
                    private_log=snapshot.owner_uid != 0,
                    before_criu=hooks.before_criu,
                    terminals=_terminal_stand_in(snapshot, opts),
                    title=(
                        f"snapshot={snapshot.id}",
                        f"name={snapshot.name or '-'}",
                        f"operation={run.record.id}",
                        f"gpusnapd={store.instance}",  # which gpusnapd's tree: ls --running and stop see their own
                    ),
                    owner=tree_rights.of(snapshot).user,
                    scratch_dir=hooks.scratch,
                    leave_stopped=leave_stopped,
                    file_copies=file_copies.request(
                        snapshot,
                        _label(run),
                        lambda: store.take_in_place(snapshot.id),
                        _private_shm_paths(shm_dir, private_shm),
                    ),
                    on_progress=on_progress,
                    cancelled=cancelled,
                    criu_dir=store.restore_criu_dir(_label(run)) if _worth_a_page_fill(snapshot) else None,
                )
            except CancelledError as exc:
                raise run.cancelled(
                    f"during {run.record.phase}, which stopped: CRIU was killed, and its PID namespace with what "
                    "it had restored"
                ) from exc
        devshm.remove_link_remaps(remaps)  # opened by CRIU: the restored tree holds the file, not the name
        return tree

    def bring_up(
        self,
        snapshot: Snapshot,
        opts: RestoreOptions,
        side: CpuSide,
        gpu_map: dict[str, str] | None,
        buffers_verified: Callable[[], None],
        *,
        counted: bool = False,
    ) -> RestoreResult:
        """After CRIU: ``gpu-restore`` onto ``gpu_map`` → ``gpu-unlock`` → ``validate`` → the worker's
        ``reload-buffers`` and ``resume-worker`` (with the arenas :meth:`start_prefill` filled). Registers
        ``release-gpus`` (before the kill) for a failure. ``counted``: the restored processes were counted
        already (a standby, when it was made): ``validate`` then checks that the root is alive."""
        ctl = self._gpu_restore(snapshot, side, gpu_map)
        with self.run.phase(Phase.VALIDATE):
            if ctl is not None:
                ctl.verify_running(side.cuda_pids)
            if not counted:
                check_restored_count(self.run, snapshot, side)
            elif not proc.alive(side.root):
                raise FailedPreconditionError(
                    f"the standby of {snapshot.id} lost its root process (PID {side.root}); restore the snapshot again",
                    reason="RESTORE_INCOMPLETE",
                )
            pids = proc.tree_pids(side.root)
        _note_tree(self.run, lambda t: dataclasses.replace(t, validated=True, pids=tuple(pids)))
        prefill, self._prefill = self._prefill, None
        try:
            workers.resume_restored(
                self.run, self.deps, snapshot, opts, pids, buffers_verified, prefill[0] if prefill else None
            )
        finally:
            if prefill is not None:  # handed over, or read back instead: gpusnapd's arenas go either way
                prefill[1].run_now()
        return RestoreResult(
            pid=side.root,
            pids=tuple(pids),
            snapshot_id=snapshot.id,
            namespace_pid=side.ns_pid,
            file_copies=side.file_copies,
        )

    def _gpu_restore(
        self, snapshot: Snapshot, side: CpuSide, gpu_map: dict[str, str] | None
    ) -> GpuTreeController | None:
        """``gpu-restore`` → ``gpu-unlock`` of the tree's CUDA processes onto ``gpu_map``, with the
        ``release-gpus`` undo step; ``None`` when there is nothing to restore on a GPU."""
        cuda_pids = list(side.cuda_pids)
        if gpu_map is None or not cuda_pids:
            return None
        ctl = self.deps.gpu.controller(sum(g.gpu_memory_bytes for g in snapshot.gpu_processes))
        lock_ms = int(self.deps.config.gpu_lock_timeout * 1000)
        release = ctl.release_gpus_for_kill
        self.run.on_failure("release-gpus", lambda: release(cuda_pids, lock_timeout_ms=lock_ms).raise_for_problems())
        with self.run.phase(Phase.GPU_RESTORE) as progress:
            for g, pid in zip(snapshot.gpu_processes, cuda_pids, strict=True):
                ctl.restore_all(
                    [pid], gpumap.gpu_pairs_for_restore(gpumap.pairs_for_process(gpu_map, g.visible_gpu_uuids))
                )
            progress.bytes = sum(g.gpu_memory_bytes for g in snapshot.gpu_processes)
        with self.run.phase(Phase.GPU_UNLOCK):
            ctl.unlock_all(cuda_pids)
        return ctl


def replica_options(opts: RestoreOptions, index: int) -> RestoreOptions:
    """Copy ``index``'s options: its own network namespace, ``{i}`` in env and values replaced by ``index``."""

    def fill(values: Mapping[str, str]) -> dict[str, str]:
        return {k: v.replace(REPLICA_INDEX, str(index)) for k, v in values.items()}

    return dataclasses.replace(opts, env=fill(opts.env), values=fill(opts.values), private_network=True, replicas=1)


class _CriuHooks:
    """What a restore does at CRIU's notifications: journal the helper and namespace init before CRIU restores
    anything, and at ``pre-resume`` (every task restored, none running) wait for the image digests computed
    meanwhile (``store.imagecheck``), count the restored processes and check the owner's file rights on them
    (``access.file_rights.check_restored``), killing the tree on a mismatch or a refusal."""

    def __init__(self, run: PhaseRunner, snapshot: Snapshot, scratch: Path, images: ImageCheck):
        self.run = run
        self.snapshot = snapshot
        self.images = images
        """The digests computed while CRIU runs: ``pre-resume`` waits for them."""
        self.scratch = scratch
        """Root's scratch directory of this restore (CRIU's ghost files of a non-root snapshot among them)."""
        self.restored: list[int] = []
        """What CRIU restored, counted before any task could fork or exit."""

    def before_criu(self, helper: int, init: int) -> None:  # journaled before CRIU restores anything
        helper_start, init_start = proc.start_time(helper), proc.start_time(init) if init else 0.0
        expect = () if init else tuple(self.snapshot.source.tree_pids)  # same PIDs in gpusnapd's namespace
        _note_tree(
            self.run,
            lambda t: dataclasses.replace(
                t,
                helper_pid=helper,
                helper_start=helper_start,
                init_pid=init,
                init_start=init_start,
                expect_pids=expect,
            ),
        )
        self.run.failpoints.hit(self.run.record.kind.value, "criu-started" + self.run.phase_suffix)

    def before_resume(self, t: RestoredTree) -> None:  # CRIU's pre-resume: every task restored, none running
        # The root is still CRIU's child here, not yet the namespace init's: look under the init.
        found = (
            [p for p in proc.tree_pids(t.init_pid) if proc.namespace_pid(p) == t.ns_pid] if t.init_pid else [t.ns_pid]
        )
        try:
            self.images.wait()  # no task runs an instruction until every digest matched
            self.run.failpoints.hit(self.run.record.kind.value, "pre-resume" + self.run.phase_suffix)
            if not found:
                raise FailedPreconditionError(
                    f"CRIU's restored PID {t.ns_pid} is not in its namespace", reason="RESTORE_INCOMPLETE"
                )
            try:
                self.restored.extend(proc.tree_pids(found[0]))
                file_rights.check_restored(self.snapshot, found[0], str(self.scratch / criu_userpaths.GHOSTS))
            except NotFoundError as exc:  # not a PID the caller gave: a restored task killed before it ran
                raise FailedPreconditionError(
                    f"a process of the restored tree (root PID {found[0]}) ended before the tree ran, killed from "
                    "outside; the tree was stopped: restore again",
                    reason="RESTORE_INCOMPLETE",
                ) from exc
        except BaseException:
            _kill_before_it_runs(t.init_pid, found[0] if found else t.ns_pid)
            raise


def _worth_a_page_fill(snapshot: Snapshot) -> bool:
    """Whether the snapshot's private pages are many enough for a page fill (``drivers.pagefill.MIN_BYTES``)."""
    pages = sum(f.size_bytes for f in snapshot.files if checksum.RAW_PAGES.fullmatch(f.path))
    return pages >= pagefill.MIN_BYTES


def _page_fill_message(f: PageFillStats) -> str:
    """``pages filled: 4.29 GB by 2 threads in 1.100 s (3.90 GB/s), 3 processes, and 1.07 GB of its /dev/shm
    files`` (the rate is the pages' and files' bytes over the fill's seconds)."""
    rate = f" ({(f.bytes + f.file_bytes) / f.seconds / 1e9:.2f} GB/s)" if f.seconds > 0 else ""
    files = f", and {f.file_bytes / 1e9:.2f} GB of its /dev/shm files" if f.file_bytes else ""
    return (
        f"pages filled: {f.bytes / 1e9:.2f} GB by {f.threads} threads in {f.seconds:.3f} s{rate}, "
        f"{f.processes} processes{files}"
    )


def _restored_as_data(path: str, private_shm: bool) -> bool:
    """Whether image file ``path`` (relative to the images directory) is data that no code reads before the
    restored tasks run: a CRIU page image (copied into the restored memory, never parsed: ``checksum.RAW_PAGES``)
    or, with a private /dev/shm, a saved /dev/shm file (copied into that tmpfs, which only the tree sees).
    Into the host's /dev/shm such a file is put back where other processes can open it: checked first."""
    if checksum.RAW_PAGES.fullmatch(path):
        return True
    return private_shm and path.startswith(DEV_SHM + "/")


def _private_shm_paths(shm_dir: Path, private_shm: bool) -> frozenset[str]:
    """The /dev/shm paths a private /dev/shm gets as fresh copies of the saved files (none: the host's)."""
    if not private_shm:
        return frozenset()
    return frozenset(str(devshm.DEV_SHM / name) for name in os.listdir(shm_dir))


def _restored_cuda_pids(run: PhaseRunner, snapshot: Snapshot, root: int) -> tuple[int, ...]:
    """The host PIDs of the snapshot's CUDA processes in the tree restored under ``root``, journaled.

    Raises:
        FailedPreconditionError: one is missing (``RESTORE_INCOMPLETE``).
    """
    if not snapshot.gpu_processes:
        return ()
    host_pid_of = {proc.namespace_pid(p): p for p in proc.tree_pids(root)}
    cuda_pids = [host_pid_of[g.pid] for g in snapshot.gpu_processes if g.pid in host_pid_of]
    if len(cuda_pids) != len(snapshot.gpu_processes):
        raise FailedPreconditionError(
            f"restore of {snapshot.id} lacks CUDA processes {[g.pid for g in snapshot.gpu_processes]}",
            reason="RESTORE_INCOMPLETE",
        )
    _note_tree(run, lambda t: dataclasses.replace(t, cuda_pids=tuple(cuda_pids)))
    return tuple(cuda_pids)


def check_restored_count(run: PhaseRunner, snapshot: Snapshot, side: CpuSide) -> None:
    """CRIU restored every process that was frozen (counted at its ``pre-resume`` against the tree as it was
    frozen: a live count now would also see what the resumed tree forked or reaped since, zdtm
    transition/fork) and the root is alive.

    Raises:
        FailedPreconditionError: reason ``RESTORE_INCOMPLETE``, naming CRIU's log.
    """
    expected = len(snapshot.source.tree_pids)
    if len(side.restored) < expected or not proc.alive(side.root):  # more: CRIU's helpers, not yet gone
        raise FailedPreconditionError(
            f"restore of {snapshot.id} brought back {len(side.restored)} of {expected} processes"
            f"{'' if proc.alive(side.root) else ' and its root is gone'}; "
            f"see {restore_log_name(_label(run))} in the snapshot directory",
            reason="RESTORE_INCOMPLETE",
        )


def _note_tree(run: PhaseRunner, update: Callable[[JournaledTree], JournaledTree]) -> None:
    """Journal what recovery needs of the tree being restored (durable before returning)."""
    run.record.note(RestoreFacts, lambda f: dataclasses.replace(f, tree=update(f.tree or JournaledTree())))


def _label(run: PhaseRunner) -> str:
    """This restore's label: its operation id, with ``-<i>`` for copy ``i`` of a fan-out."""
    return run.record.id + run.phase_suffix.replace("#", "-")


def _tcp_mode_of(snapshot: Snapshot) -> TcpMode:
    return TcpMode(snapshot.labels.get(TCP_LABEL, TcpMode.REFUSE.value))


def _host_root_pid(init_pid: int, ns_pid: int) -> int:
    """The host PID of the restored root: the namespace init's child, or ``ns_pid`` itself."""
    if not init_pid:
        return ns_pid
    for child in proc.children(init_pid):
        if proc.namespace_pid(child) == ns_pid:
            return child
    raise FailedPreconditionError(
        f"CRIU reported PID {ns_pid} restored, but it is not running in its namespace", reason="RESTORE_INCOMPLETE"
    )


def _kill_tree(init_pid: int, root: int) -> None:
    """Kill a restored tree: its namespace init takes everything inside with it (and removes the tree's file
    copies, ``drivers.restored.end_now``); without one (a restore into gpusnapd's PID namespace) every process
    of the tree is killed."""
    if init_pid:
        restored.end_now(init_pid)
        return
    try:
        pids = proc.tree_pids(root)
    except NotFoundError:
        return
    proc.kill_tree(pids)


def _kill_before_it_runs(init_pid: int, root: int) -> None:
    """At CRIU's ``pre-resume`` (every task restored and stopped), refused: CRIU resumes the tasks whatever the
    answer, so each is killed here, before the answer. Each process is sent SIGKILL itself (the namespace
    init's and CRIU among them): once ``kill`` returns every thread of it has a fatal signal pending and
    runs no instruction of its own again. Killing only the namespace init left that to the init's exit,
    after the answer: a restored task then ran (wrote a line of its log) before it died. Children go before
    their parents: an init or a CRIU killed first breaks CRIU's notification socket (a killed process closes
    its descriptors before its namespace's tasks are killed) or its ptrace hold, and CRIU (or the kernel, for a
    tracer that died) resumes the tasks it still held: one ran in 1 of 12 runs of test_restore_verify."""
    proc.kill_tree(list(reversed(proc.tree_pids_or_empty(init_pid or root))))
    _kill_tree(init_pid, root)


def _put_back_link_remaps(run: PhaseRunner, shm_dir: Path) -> list[devshm.LinkRemap]:
    """A restore into the host's /dev/shm: CRIU opens the dump's link remaps, and the names the tree held, by
    name (drivers.devshm). Returns the link remaps, to remove once CRIU has opened them."""
    try:
        made = devshm.put_back_link_remaps(shm_dir)
    except FileExistsError as e:
        raise FailedPreconditionError(
            f"/dev/shm/{Path(str(e.filename)).name} exists, and a restore into the host's PID namespace needs that "
            "name for a file the snapshot carries; remove it if nothing uses it, or restore without --host-pidns "
            "(a private /dev/shm)",
            reason="DEV_SHM_NAME_TAKEN",
        ) from None
    run.on_failure("remove-link-remaps", lambda: devshm.remove_link_remaps(made.remaps + made.names))
    return made.remaps


def _terminal_stand_in(snapshot: Snapshot, opts: RestoreOptions) -> Terminals | None:
    """What stands in for the terminals a shell's job was started from (``Snapshot.terminals``): the restore's
    ``terminal`` file (opened as the snapshot's owner) or ``/dev/null``; ``None`` when the tree held none."""
    keys = sorted({t.key for t in snapshot.terminals if t.fds and t.key})
    if not keys:
        return None
    if opts.host_pid_namespace:
        raise FailedPreconditionError(
            f"snapshot {snapshot.id} was started from a terminal ({snapshot.terminals[0].path}), which a restore "
            "replaces by a terminal of its own, held by the init of the tree's PID namespace; restore it without "
            "--host-pidns",
            reason="TERMINAL",
        )
    creds = tree_rights.of(snapshot).user or Creds(uid=0, gid=0)  # the tree's user opens it, whoever restores
    return Terminals(keys=tuple(keys), path=opts.terminal, owner=creds)
