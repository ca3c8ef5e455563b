"""Daemon: the domain API the gRPC servicers call. One method per RPC; no gRPC here.

Validation, permission checks and the one-operation-per-tree rule are applied synchronously, so a
bad request fails its RPC at once; the work itself runs as a background operation.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime

import structlog

from gpusnap.daemon.access import callers
from gpusnap.daemon.api import paging, validate
from gpusnap.daemon.api.errors import (
    AbortedError,
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from gpusnap.daemon.api.types import (
    Caller,
    CheckpointOptions,
    GpuPrefill,
    HostFacts,
    Policy,
    RestoredTree,
    RestoreOptions,
    RestoreResult,
    Snapshot,
)
from gpusnap.daemon.drivers import proc, restored
from gpusnap.daemon.drivers.nvml import GpuDevice
from gpusnap.daemon.gpu import gpumap
from gpusnap.daemon.operations import remote as remote_ops
from gpusnap.daemon.operations.base import OperationKind, OperationRecord, OperationState, PhaseRunner
from gpusnap.daemon.operations.checkpoint import host_facts, run_checkpoint
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.operations.registry import OperationRegistry
from gpusnap.daemon.operations.restore import run_restore
from gpusnap.daemon.operations.standby import (
    StandbyOptions,
    drop,
    drop_lost,
    registry,
    run_activate,
    run_standby,
)
from gpusnap.daemon.operations.suspend import run_resume, run_suspend
from gpusnap.daemon.park.ladder import Budget, Event, Ladder, Workload
from gpusnap.daemon.park.policy import Rule
from gpusnap.daemon.park.standbys import READY, Standby
from gpusnap.daemon.preflight.restore import check_replicas
from gpusnap.daemon.remote import evict
from gpusnap.daemon.store.tiers import TierUsage

log = structlog.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What ``GetNodeInfo`` reports."""

    host: HostFacts
    store_path: str
    store_used_bytes: int
    snapshot_count: int
    criu_path: str
    gpus: tuple[GpuDevice, ...] = ()
    cuda_checkpoint_supported: bool = False
    cuda_unavailable_reason: str = ""
    remote: str = ""
    tiers: tuple[TierUsage, ...] = ()
    """The buffer store's tiers, fastest first, then (with a remote store) ``remote``: what only it holds."""
    gpu_prefill: GpuPrefill = GpuPrefill(enabled=False, reason="off")
    """``gpu_prefill``'s state (``gpusnap.daemon.weights.prefill``)."""
    standbys: int = 0
    standby_host_memory_bytes: int = 0
    """Resident memory of those standbys (the caller's; root: all), bytes."""
    unfinished_pulls: int = 0
    unfinished_pull_bytes: int = 0
    page_fill: str = ""
    """How restores fill a tree's private memory (``drivers.pagefill.Setting.summary``)."""
    """Pulls whose work the store still holds, and its bytes (root only: a pull's work is not filed by owner)."""


class Daemon:
    """The daemon's behaviour behind its API.

    Args:
        deps: drivers, store and config, built by ``gpusnap.daemon.server.build_daemon``.
        registry: where operations run.
    """

    def __init__(self, deps: Deps, registry: OperationRegistry, ladder: Ladder | None = None):
        self.deps = deps
        self.registry = registry
        self.ladder = ladder

    def checkpoint(self, opts: CheckpointOptions, caller: Caller, request_id: str = "") -> OperationRecord:
        """Validate and start a checkpoint (or, for a ``request_id`` the caller used before, return that
        operation: a retry).

        Raises:
            InvalidArgumentError, NotFoundError, PermissionDeniedError, AlreadyExistsError,
            AbortedError (tree busy).
        """
        earlier = self._earlier(caller, OperationKind.CHECKPOINT, request_id)
        if earlier is not None:
            return earlier
        if opts.name:
            validate.snapshot_name(opts.name)
            self.deps.store.check_name_free(opts.name, caller.uid)
        validate.labels(opts.labels)
        return self._start_on_tree(
            OperationKind.CHECKPOINT,
            opts.pid,
            caller,
            lambda run: run_checkpoint(run, self.deps, opts, caller.uid),
            request_id,
            dry_run=opts.dry_run,
        )

    def restore(self, opts: RestoreOptions, caller: Caller, request_id: str = "") -> OperationRecord:
        """Validate and start a restore (a known ``request_id``: the earlier operation).

        Raises:
            InvalidArgumentError, NotFoundError, PermissionDeniedError, DataLossError (manifest).
        """
        callers.require_identified(caller)
        earlier = self._earlier(caller, OperationKind.RESTORE, request_id)
        if earlier is not None:
            return earlier
        gpumap.check_form(opts.gpu_map)
        check_replicas(opts)
        validate.restore_context(opts.env, opts.unset_env, opts.values)
        snapshot, pull = self._restorable(opts.snapshot, caller)
        opts = dataclasses.replace(opts, snapshot=snapshot.id)  # validated: the operation checks it no more
        record = OperationRecord(
            OperationKind.RESTORE, target_snapshot=snapshot.id, owner_uid=caller.uid, request_id=request_id
        )
        release = self.ladder.reserve_gpu(snapshot) if self.ladder is not None else _nothing
        standby = self._standby_for(snapshot.id, opts)
        if standby is not None:  # restored ahead: activate it instead (gpusnap.daemon.operations.standby)
            return self._start_activation(record, standby, snapshot, opts, caller, release)
        try:
            admitted = self._admit(caller.uid, snapshot, opts.replicas, f"restoring {snapshot.id}")
        except BaseException:
            release()
            raise
        skipped = self._standbys_skipped(snapshot.id, opts)

        def body(run: PhaseRunner) -> RestoreResult:
            if pull:  # only in the remote store: pulled first, in the same operation (pull phases, then restore's)
                remote_ops.run_pull(run, self.deps, snapshot.id, caller)
            return dataclasses.replace(run_restore(run, self.deps, opts, snapshot), standbys_skipped=skipped)

        return self._start_held(record, (), body, _both(release, admitted), snapshot, weight=opts.replicas)

    def _restorable(self, ref: str, caller: Caller) -> tuple[Snapshot, bool]:
        """The snapshot ``ref`` names, which the caller may restore, read once: from the store, or (with a
        remote store) from the remote one when only it has it; and whether it must be pulled first.

        Raises:
            InvalidArgumentError, NotFoundError, PermissionDeniedError, DataLossError (manifest), UnavailableError
            (remote unreachable).
        """
        try:
            snapshot = self.deps.store.get(ref, caller.uid)
        except NotFoundError:
            if self.deps.remote is None:
                raise
            remote = remote_ops.require_remote(self.deps)
            snapshot = remote.find(ref, caller.uid).snapshot
            callers.check_may_restore(snapshot, caller, lambda: remote.not_found(ref))
            return snapshot, True
        callers.check_may_restore(snapshot, caller, lambda: self.deps.store.not_found(ref))
        return snapshot, False

    def _admit(self, uid: int, snapshot: Snapshot, copies: int, what: str) -> Callable[[], None]:
        """``uid``'s admission of ``copies`` more trees of ``snapshot`` (``operations.tree_bounds``)."""
        bounds = self.deps.tree_bounds
        if bounds is None:
            return _nothing
        return bounds.admit(uid, copies, snapshot.source.rss_bytes or snapshot.size_bytes, what)

    def _start_held(
        self,
        record: OperationRecord,
        pids: Iterable[int],
        body: Callable[[PhaseRunner], object],
        release: Callable[[], None],
        snapshot: Snapshot | None = None,
        weight: int = 1,
    ) -> OperationRecord:
        """Start ``body`` (``weight``: its share of the caller's operations, as ``OperationRegistry.start``);
        ``release`` (a park budget reservation) runs when it ends, or now if it never starts. A tree it brings
        up (a restore's or an activation's, of ``snapshot``) is on its park rung before the operation ends."""

        def held(run: PhaseRunner) -> object:
            try:
                result = body(run)
                if self.ladder is not None and isinstance(result, RestoreResult):
                    self.ladder.track(result, snapshot)  # on its rung before the operation is seen to end
                return result
            finally:
                release()

        try:
            return self.registry.start(record, pids, held, weight)
        except BaseException:
            release()
            raise

    def _standby_for(self, snapshot_id: str, opts: RestoreOptions) -> Standby | None:
        """A ready standby of ``snapshot_id`` that a restore with ``opts`` may take (claimed), if any."""
        if self.deps.standbys is None or opts.no_standby or opts.replicas != 1 or opts.host_pid_namespace:
            return None
        drop_lost(self.deps, snapshot_id)  # a standby whose tree is gone is no standby
        return self.deps.standbys.claim_for(snapshot_id, opts.private_network)

    def _standbys_skipped(self, snapshot_id: str, opts: RestoreOptions) -> str:
        """Why a restore with ``opts`` takes none of the ready standbys of ``snapshot_id`` (``""``: it has none, or
        the caller asked for none with ``no_standby``), and how to take one."""
        if self.deps.standbys is None or opts.no_standby:
            return ""
        ready = [s for s in self.deps.standbys.list(snapshot_id=snapshot_id) if s.state == READY]
        if not ready:
            return ""
        many = f"its {len(ready)} ready standbys" if len(ready) > 1 else "its ready standby"
        if opts.replicas != 1:
            return (
                f"{many} are not used by a restore of --replicas {opts.replicas} (each copy restores from the images)"
            )
        if opts.host_pid_namespace:
            return f"{many} run in PID namespaces of their own, which --host-pidns does not want"
        if all(s.private_network for s in ready) and not opts.private_network:
            return (
                f"{many} have private networks (made with --count > 1 or --private-net); restore --private-net "
                "to activate one"
            )
        if not opts.private_network:
            return ""
        return f"{many} share the host's network; restore without --private-net to activate one"

    def standby(self, opts: StandbyOptions, caller: Caller, request_id: str = "") -> OperationRecord:
        """Validate and start a standby operation: ``opts.count`` copies of a snapshot restored ahead
        (``gpusnap.daemon.operations.standby``); they belong to the snapshot's owner.

        Raises:
            InvalidArgumentError (``INVALID_REPLICAS``), NotFoundError, PermissionDeniedError.
        """
        callers.require_identified(caller)
        earlier = self._earlier(caller, OperationKind.STANDBY, request_id)
        if earlier is not None:
            return earlier
        registry(self.deps)
        check_replicas(RestoreOptions(snapshot=opts.snapshot, replicas=opts.count))
        snapshot = self.snapshot(opts.snapshot, caller)
        record = OperationRecord(
            OperationKind.STANDBY, target_snapshot=snapshot.id, owner_uid=caller.uid, request_id=request_id
        )
        here = dataclasses.replace(opts, snapshot=snapshot.id)
        admitted = self._admit(
            caller.uid,
            snapshot,
            opts.count,
            f"making {opts.count} standby{'s' if opts.count > 1 else ''} of {snapshot.id}",
        )
        try:
            release = self.ladder.reserve_standby(snapshot, opts.count) if self.ladder is not None else _nothing
        except BaseException:
            admitted()
            raise
        return self._start_held(
            record,
            (),
            lambda run: run_standby(run, self.deps, here, snapshot),
            _both(release, admitted),
            weight=opts.count,
        )

    def activate(
        self, standby_id: str, opts: RestoreOptions, caller: Caller, gpu: str = "", request_id: str = ""
    ) -> OperationRecord:
        """Validate and start the activation of standby ``standby_id`` (``opts.snapshot`` is ignored), onto
        ``gpu`` (a UUID or index; a single-GPU snapshot) or ``opts.gpu_map``. A standby another activation
        holds, or one activated or dropped lately, restores its snapshot instead (from another ready
        standby of it when there is one; ``gpusnap.daemon.operations.standby``).

        Raises:
            InvalidArgumentError, NotFoundError (unknown standby, or another user's), PermissionDeniedError.
        """
        callers.require_identified(caller)
        earlier = self._earlier(caller, OperationKind.ACTIVATE, request_id)
        if earlier is not None:
            return earlier
        validate.standby_id(standby_id)
        gpumap.check_form({gpu: gpu} if gpu else opts.gpu_map)  # (both: refused below, GPU_MAP_UNEXPECTED)
        validate.restore_context(opts.env, opts.unset_env, opts.values)
        standbys = registry(self.deps)
        found = standbys.get(standby_id) or standbys.gone(standby_id)
        if found is None or not callers.sees(caller, found.owner_uid):
            raise _no_standby(standby_id)
        snapshot = self.snapshot(found.snapshot_id, caller)
        opts = dataclasses.replace(
            opts,
            snapshot=snapshot.id,
            gpu_map=_gpu_map(snapshot, gpu, opts.gpu_map),
            private_network=found.private_network,  # (a restore instead takes a standby made alike)
        )
        drop_lost(self.deps, snapshot.id)  # a standby whose tree is gone is no standby
        claimed = standbys.claim(standby_id)
        if claimed is None:  # another activation has it, or it is gone: restore its snapshot
            return self.restore(opts, caller, request_id)
        record = OperationRecord(
            OperationKind.ACTIVATE, target_snapshot=snapshot.id, owner_uid=caller.uid, request_id=request_id
        )
        try:
            release = self.ladder.reserve_gpu(snapshot) if self.ladder is not None else _nothing
        except BaseException:
            standbys.unclaim(standby_id)
            raise
        return self._start_activation(record, claimed, snapshot, opts, caller, release)

    def _start_activation(
        self,
        record: OperationRecord,
        standby: Standby,
        snapshot: Snapshot,
        opts: RestoreOptions,
        caller: Caller,
        release: Callable[[], None],
    ) -> OperationRecord:
        """Run the activation of the claimed ``standby`` of ``snapshot``; a refused start gives the standby back."""
        try:
            return self._start_held(
                record,
                standby.pids,
                lambda run: dataclasses.replace(
                    run_activate(run, self.deps, standby, opts, snapshot), standby_id=standby.id
                ),
                release,
                snapshot,
            )
        except BaseException:
            registry(self.deps).unclaim(standby.id)
            raise

    def standbys(self, caller: Caller, snapshot: str = "") -> list[Standby]:
        """The caller's standbys (root: all), of ``snapshot`` when given, oldest first."""
        snapshot_id = self.snapshot(snapshot, caller).id if snapshot else ""
        drop_lost(self.deps, snapshot_id)  # (ended by their owner, or stopped, since the ladder's last pass)
        table = proc.ProcessTable.now()  # their memory as it is now, one listing of the processes for all
        return [s.now(table) for s in registry(self.deps).list(callers.visible_uid(caller), snapshot_id)]

    def drop_standby(self, standby_id: str, caller: Caller) -> str:
        """Kill a standby's tree and forget it.

        Raises:
            NotFoundError: no such standby of the caller's (``STANDBY_NOT_FOUND``).
            AbortedError: an activation holds it (``STANDBY_BUSY``).
        """
        callers.require_identified(caller)
        validate.standby_id(standby_id)
        found = registry(self.deps).get(standby_id)
        if found is None or not callers.sees(caller, found.owner_uid):
            raise _no_standby(standby_id)
        if drop(self.deps, standby_id) is None:
            raise AbortedError(
                f"standby {standby_id} is being activated; it is gone once that activation ends",
                reason="STANDBY_BUSY",
            )
        return standby_id

    def push(self, ref: str, caller: Caller, request_id: str = "") -> OperationRecord:
        """Validate and start pushing a local snapshot to the remote store (a known ``request_id``: the
        earlier operation).

        Raises:
            FailedPreconditionError (no remote), InvalidArgumentError, NotFoundError, PermissionDeniedError.
        """
        callers.require_identified(caller)
        earlier = self._earlier(caller, OperationKind.PUSH, request_id)
        if earlier is not None:
            return earlier
        remote_ops.require_remote(self.deps)
        snapshot = self.snapshot(ref, caller)
        record = OperationRecord(
            OperationKind.PUSH, target_snapshot=snapshot.id, owner_uid=caller.uid, request_id=request_id
        )
        return self.registry.start(record, (), lambda run: remote_ops.run_push(run, self.deps, snapshot.id, caller))

    def pull(self, ref: str, caller: Caller, request_id: str = "") -> OperationRecord:
        """Validate and start pulling a snapshot of the remote store into the local one (a known
        ``request_id``: the earlier operation).

        Raises:
            FailedPreconditionError (no remote), InvalidArgumentError, NotFoundError, PermissionDeniedError,
            UnavailableError (remote unreachable).
        """
        callers.require_identified(caller)
        earlier = self._earlier(caller, OperationKind.PULL, request_id)
        if earlier is not None:
            return earlier
        remote = remote_ops.require_remote(self.deps)
        doc = remote.find(ref, caller.uid)
        callers.check_may_restore(doc.snapshot, caller, lambda: remote.not_found(ref))
        record = OperationRecord(
            OperationKind.PULL, target_snapshot=doc.snapshot.id, owner_uid=caller.uid, request_id=request_id
        )
        return self.registry.start(record, (), lambda run: remote_ops.run_pull(run, self.deps, doc.snapshot.id, caller))

    def remote_snapshots(
        self, caller: Caller, label_selector: Mapping[str, str], page_size: int = 0, page_token: str = ""
    ) -> paging.Page[Snapshot]:
        """A page of the snapshots published in the remote store that the caller may use, oldest first: the
        caller's part of the name index is listed, and only the page's entries are read (all of them with a
        label selector)."""
        validate.label_selector(label_selector)
        index = remote_ops.require_remote(self.deps).index
        entries = index.entries(callers.visible_uid(caller))
        size = paging.page_size(page_size)
        if not label_selector:
            page = paging.paginate(entries, lambda e: e.sort_key, size, page_token)
            return paging.Page(index.read(page.items), page.next_token)
        found = [s for s in index.read(entries) if all(s.labels.get(k) == v for k, v in label_selector.items())]
        return paging.paginate(found, snapshot_key, size, page_token)

    def delete_remote_snapshot(self, ref: str, caller: Caller) -> str:
        """Delete a snapshot's remote manifest, then collect unreferenced chunks past the grace period. A
        manifest that cannot be read (``REMOTE_MANIFEST_CORRUPT``, whose message advises this delete) is
        removed by id, by root or by the owner its index entry names (``RemoteStore.delete_unusable``)."""
        callers.require_identified(caller)
        remote = remote_ops.require_remote(self.deps)
        with _nothing_to_delete():
            try:
                snapshot = remote.find(ref, caller.uid).snapshot
            except DataLossError as err:
                if err.reason != "REMOTE_MANIFEST_CORRUPT" or "snapshot" not in err.metadata:
                    raise
                snapshot_id = err.metadata["snapshot"]
                remote.delete_unusable(snapshot_id, caller.uid)
                return snapshot_id
            callers.check_may_restore(snapshot, caller, lambda: remote.not_found(ref))
        remote.delete(snapshot)
        try:
            remote.collect_garbage(self.deps.config.remote_gc_grace)
        except DataLossError as err:  # another unusable manifest stops the collection, not this delete
            log.warning("remote.collection_stopped", error=err.message)
        return snapshot.id

    def suspend(
        self, pid: int, caller: Caller, lock_timeout_s: float | None = None, request_id: str = ""
    ) -> OperationRecord:
        """Validate and start a suspend (GPU state checkpointed in place; a known ``request_id``: the
        earlier operation).

        Raises:
            InvalidArgumentError, NotFoundError, PermissionDeniedError, AbortedError (tree busy).
        """
        earlier = self._earlier(caller, OperationKind.SUSPEND, request_id)
        if earlier is not None:
            return earlier
        return self._start_on_tree(
            OperationKind.SUSPEND, pid, caller, lambda run: run_suspend(run, self.deps, pid, lock_timeout_s), request_id
        )

    def resume(self, pid: int, gpu_map: Mapping[str, str], caller: Caller, request_id: str = "") -> OperationRecord:
        """Validate and start a resume of a suspended tree, optionally onto other GPUs (a known
        ``request_id``: the earlier operation).

        Raises:
            InvalidArgumentError, NotFoundError, PermissionDeniedError, AbortedError (tree busy).
        """
        earlier = self._earlier(caller, OperationKind.RESUME, request_id)
        if earlier is not None:
            return earlier
        gpumap.check_form(gpu_map)
        return self._start_on_tree(
            OperationKind.RESUME, pid, caller, lambda run: run_resume(run, self.deps, pid, gpu_map), request_id
        )

    def _start_on_tree(
        self,
        kind: OperationKind,
        pid: int,
        caller: Caller,
        body: Callable[[PhaseRunner], object],
        request_id: str = "",
        *,
        dry_run: bool = False,
    ) -> OperationRecord:
        """Validate ``pid`` and the caller's right to it, then start ``body`` holding the whole tree."""
        callers.require_identified(caller)
        validate.pid(pid)
        tree = callers.check_may_checkpoint(pid, caller)
        record = OperationRecord(kind, target_pid=pid, owner_uid=caller.uid, request_id=request_id, dry_run=dry_run)
        return self.registry.start(record, tree, body)

    def _earlier(self, caller: Caller, kind: OperationKind, request_id: str) -> OperationRecord | None:
        """The ``kind`` of operation this caller started with idempotency key ``request_id`` (validated), if any."""
        if not request_id:
            return None
        validate.request_id(request_id)
        return self.registry.find_request(caller.uid, kind.value, request_id)

    def cancel(self, op_id: str, caller: Caller) -> OperationRecord:
        """Ask a running operation to stop and roll back: at once where its phase can stop safely, else once the
        phase ends, unless it is past its point of no return; its ``cancel_note`` says which
        (:meth:`OperationRecord.request_cancel`).

        Raises:
            NotFoundError: as :meth:`operation`.
            PermissionDeniedError: an anonymous caller.
        """
        callers.require_identified(caller)
        record = self.operation(op_id, caller)
        record.request_cancel()
        return record

    def operation(self, op_id: str, caller: Caller) -> OperationRecord:
        """An operation the caller may see (its own, or any for root)."""
        record = self.registry.get(op_id)
        if not callers.sees(caller, record.owner_uid):
            raise NotFoundError(f"no operation {op_id!r} in this daemon", reason="OPERATION_NOT_FOUND")
        return record

    def operations(self, caller: Caller, page_size: int = 0, page_token: str = "") -> paging.Page[OperationRecord]:
        """A page of the operations the caller may see, oldest first (raises as :func:`paging.paginate`)."""
        records = [r for r in self.registry.list() if callers.sees(caller, r.owner_uid)]
        return paging.paginate(records, operation_key, paging.page_size(page_size), page_token)

    def snapshots(
        self, caller: Caller, label_selector: Mapping[str, str], page_size: int = 0, page_token: str = ""
    ) -> paging.Page[Snapshot]:
        """A page of the caller's snapshots (root: all) matching ``label_selector``, oldest first; the index
        is filtered by owner before anything else (raises as :func:`paging.paginate`, and ``INVALID_LABEL`` for a
        selector no label set could match: ``validate.label_selector``)."""
        validate.label_selector(label_selector)
        snaps = self.deps.store.list(label_selector, owner_uid=callers.visible_uid(caller))
        return paging.paginate(snaps, snapshot_key, paging.page_size(page_size), page_token)

    def snapshot(self, ref: str, caller: Caller) -> Snapshot:
        snapshot = self.deps.store.get(ref, caller.uid)
        callers.check_may_restore(snapshot, caller, lambda: self.deps.store.not_found(ref))
        return snapshot

    def delete_snapshot(self, ref: str, caller: Caller) -> str:
        """Delete a snapshot and its park rules; root may delete damaged ones whose owner cannot be read."""
        callers.require_identified(caller)
        with _nothing_to_delete():
            if not caller.is_root:
                self.snapshot(ref, caller)
            snapshot_id = self.deps.store.path_of(ref, caller.uid).name
        busy = [r.id for r in self.registry.list() if not r.done and r.target_snapshot == snapshot_id]
        standing = [s.id for s in self.deps.standbys.list(snapshot_id=snapshot_id)] if self.deps.standbys else []
        if standing:
            raise FailedPreconditionError(
                f"snapshot {snapshot_id} has standbys ({', '.join(standing)}); drop them first (`gpusnap drop "
                f"{standing[0]}`)",
                reason="SNAPSHOT_HAS_STANDBYS",
            )
        if busy:
            raise AbortedError(
                f"snapshot {snapshot_id} is in use by operation {busy[0]}; wait for it (`gpusnap wait {busy[0]}`)",
                reason="SNAPSHOT_BUSY",
            )
        deleted = self.deps.store.delete(snapshot_id)
        if self.ladder is not None:  # its rules go with it
            self.ladder.policies.forget_snapshot(deleted)
        return deleted

    def _ladder(self) -> Ladder:
        if self.ladder is None:
            raise FailedPreconditionError("this gpusnapd keeps no park ladder", reason="STANDBY_UNAVAILABLE")
        return self.ladder

    def ladder_view(self, caller: Caller) -> tuple[list[Workload], list[Budget], list[Event]]:
        """The caller's workloads (root: all) with their rungs, the node's budgets, and the latest moves of
        the caller's workloads.

        Raises:
            PermissionDeniedError: an anonymous caller (``ANONYMOUS``): the budgets are the node's use.
        """
        callers.require_identified(caller, "read the park ladder", "a listed client certificate")
        ladder = self._ladder()
        mine = [w for w in ladder.workloads() if callers.sees(caller, w.snapshot.owner_uid)]
        ids = {w.snapshot.id for w in mine}
        events = [e for e in ladder.events if caller.is_root or e.snapshot_id in ids]
        return mine, ladder.budgets(), events

    def _rule(self, snapshot: str, labels: Mapping[str, str], policy: Policy, caller: Caller) -> Rule:
        callers.require_identified(caller)
        if snapshot and labels:
            raise InvalidArgumentError("a policy selects one snapshot or labels, not both", reason="INVALID_POLICY")
        validate.labels(labels)
        snapshot_id = self.snapshot(snapshot, caller).id if snapshot else ""
        return Rule(policy.check(), caller.uid, snapshot_id, dict(labels))

    def set_policy(self, snapshot: str, labels: Mapping[str, str], policy: Policy, caller: Caller) -> Rule:
        """Set the park policy of one snapshot (``snapshot``: a reference the caller may restore) or of the
        caller's snapshots carrying ``labels`` (root's: everyone's); replaces the caller's rule for the same
        selector.

        Raises:
            InvalidArgumentError (``INVALID_POLICY``), NotFoundError, PermissionDeniedError.
        """
        rule = self._rule(snapshot, labels, policy, caller)
        self._ladder().check_policy(rule)
        rule = self._ladder().policies.set(rule)
        self._ladder().poke()
        return rule

    def policies(self, caller: Caller) -> list[Rule]:
        """The caller's park policies (root: all)."""
        return self._ladder().policies.rules(callers.visible_uid(caller))

    def delete_policy(self, snapshot: str, labels: Mapping[str, str], caller: Caller) -> None:
        """Remove the caller's rule for this selector.

        Raises:
            NotFoundError: the caller has none (``POLICY_NOT_FOUND``).
        """
        if not self._ladder().policies.delete(self._rule(snapshot, labels, Policy(), caller)):
            raise NotFoundError(
                "no park policy of yours has that selector; `gpusnap park` lists them", reason="POLICY_NOT_FOUND"
            )
        self._ladder().poke()

    def restored_trees(self, caller: Caller) -> list[RestoredTree]:
        """The restored trees running now whose root runs as the caller (root: all), oldest first: those of this
        gpusnapd's store only (``drivers.restored``; another gpusnapd on the host lists and stops its own).

        Raises:
            PermissionDeniedError: an anonymous caller (reason ``ANONYMOUS``).
        """
        callers.require_identified(caller)
        trees = restored.running(self.deps.store.instance)
        activated = self._activations(trees)
        return [
            dataclasses.replace(t, operation_id=activated.get((t.pid, t.started), t.operation_id))
            for t in trees
            if callers.sees(caller, t.uid)
        ]

    def _activations(self, running: list[RestoredTree]) -> dict[tuple[int, datetime], str]:
        """(root PID, start) of each tree an activation brought up -> that operation: its init names the standby
        operation that restored it, but what a person saw printed, and stops it by, is the activation's."""
        found: dict[tuple[int, datetime], str] = {}
        trees = {t.pid: t.started for t in running}
        for record in self.registry.list():
            result = record.result
            if record.state is not OperationState.SUCCEEDED or not isinstance(result, RestoreResult):
                continue
            if not result.standby_id or record.finished is None:
                continue
            for copy in result.replicas or (result,):
                started = trees.get(copy.pid)
                if started is not None and started <= record.finished:  # not a later tree given the same PID
                    found[(copy.pid, started)] = record.id
        return found

    def _just_restored(self, caller: Caller, pid: int, operation_id: str) -> bool:
        """Whether a restore or activation of the caller's that ended within :data:`JUST_RESTORED_S` brought up
        tree ``pid`` (or is ``operation_id``): its namespace init may not yet run as the tree's reaper, which
        is how :func:`restored.running` finds it (it execs the reaper once CRIU is done)."""
        now = datetime.now(UTC)
        for record in self.registry.list():
            result = record.result
            if record.state is not OperationState.SUCCEEDED or not isinstance(result, RestoreResult):
                continue
            if record.finished is None or (now - record.finished).total_seconds() > JUST_RESTORED_S:
                continue
            if not callers.sees(caller, record.owner_uid):
                continue
            if record.id == operation_id or (pid and pid in {c.pid for c in result.replicas or (result,)}):
                return True
        return False

    def stop_restored_trees(self, caller: Caller, pid: int = 0, operation_id: str = "") -> list[RestoredTree]:
        """Stop the caller's restored tree whose root (or namespace init) is host PID ``pid``, or every tree of
        restore ``operation_id``; returns them, as listed, once they are gone (``drivers.restored.stop``). A tree
        a restore has just brought up is waited for (at most :data:`JUST_RESTORED_S`) until its init runs as its
        reaper.

        Raises:
            InvalidArgumentError: neither or both named (reason ``INVALID_ARGUMENT``).
            NotFoundError: no such tree runs, or it is not the caller's (reason ``TREE_NOT_FOUND``).
            AbortedError: its restore is still running (reason ``TREE_BUSY``): cancel that instead.
            PermissionDeniedError: an anonymous caller.
        """
        if bool(pid) == bool(operation_id):
            raise InvalidArgumentError(
                "name one restored tree: the PID `gpusnap restore` printed, or its restore's operation id",
                reason="INVALID_ARGUMENT",
            )
        if operation_id:
            validate.operation_id(operation_id)

        def chosen_now() -> list[RestoredTree]:
            trees = restored.running(self.deps.store.instance)
            activated = self._activations(trees)
            return [
                t
                for t in trees
                if callers.sees(caller, t.uid)
                and (
                    (pid and pid in (t.pid, t.init_pid))
                    or (operation_id and operation_id in (t.operation_id, activated.get((t.pid, t.started))))
                )
            ]

        chosen = chosen_now()
        if not chosen and self._just_restored(caller, pid, operation_id):
            deadline = time.monotonic() + JUST_RESTORED_S
            while not chosen and time.monotonic() < deadline:
                time.sleep(0.05)
                chosen = chosen_now()
        if not chosen:
            raise NotFoundError(
                f"no restored tree {pid or operation_id} of yours is running; `gpusnap ls --running` lists them",
                reason="TREE_NOT_FOUND",
                metadata={"tree": str(pid or operation_id)},
            )
        busy = [r.id for r in self.registry.list() if not r.done and r.id in {t.operation_id for t in chosen}]
        if busy:
            raise AbortedError(
                f"restore {busy[0]} is still bringing that tree up; cancel it (`gpusnap cancel {busy[0]}`), which "
                "removes what it restored",
                reason="TREE_BUSY",
                metadata={"operation_id": busy[0]},
            )
        restored.stop(chosen)
        if self.deps.standbys is not None:
            drop_lost(self.deps)  # a standby's tree stopped: the standby goes with it
        return chosen

    def node_info(self, caller: Caller) -> NodeInfo:
        """The node's facts; the store's use (bytes, snapshots, blobs per tier) is the caller's own, or
        everyone's for root."""
        callers.require_identified(caller, "read the node's facts", "a listed client certificate")
        uid = callers.visible_uid(caller)
        snapshots = self.deps.store.list(owner_uid=uid)
        standbys = self.deps.standbys.list(uid) if self.deps.standbys is not None else []
        table = proc.ProcessTable.now()
        pulls, pull_bytes = self.deps.store.unfinished_pulls() if uid is None else (0, 0)
        return NodeInfo(
            host=host_facts(self.deps),
            store_path=str(self.deps.store.root),
            store_used_bytes=self.deps.store.used_bytes(uid),
            snapshot_count=len(snapshots),
            criu_path=self.deps.criu.binary,
            gpus=tuple(self.deps.gpu.gpus()),
            cuda_checkpoint_supported=self.deps.gpu.available,
            cuda_unavailable_reason=self.deps.gpu.reason,
            gpu_prefill=self.deps.prefill.status() if self.deps.prefill else GpuPrefill(enabled=False, reason="off"),
            remote=str(self.deps.remote or ""),
            tiers=self._tiers(uid),
            standbys=len(standbys),
            standby_host_memory_bytes=sum(s.live_memory_bytes(table) for s in standbys),
            unfinished_pulls=pulls,
            unfinished_pull_bytes=pull_bytes,
            page_fill=self.deps.criu.page_fill.summary(),
        )

    def _tiers(self, uid: int | None) -> tuple[TierUsage, ...]:
        """Each tier's use by ``uid``'s blobs (None: everyone's)."""
        tiers = tuple(TierUsage.of(t, uid) for t in self.deps.store.buffers.tiers)
        if self.deps.remote is None:
            return tiers
        used, blobs = evict.remote_only(self.deps.store, self.deps.remote, uid)
        return (*tiers, TierUsage("remote", str(self.deps.remote), used, 0, 0, blobs))


def snapshot_key(snapshot: Snapshot) -> paging.Key:
    return paging.key(snapshot.created, snapshot.id)


def operation_key(record: OperationRecord) -> paging.Key:
    return paging.key(record.started, record.id)


JUST_RESTORED_S = 5.0
"""How long after a restore its tree may not yet be listed (its init starts the reaper), and how long a ``stop``
of it waits for that."""


def _nothing() -> None:
    """No reservation to release (no park ladder)."""


def _both(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    """Release ``first``, then ``then`` (whatever the first raised)."""

    def release() -> None:
        try:
            first()
        finally:
            then()

    return release


def _no_standby(standby_id: str) -> NotFoundError:
    return NotFoundError(
        f"no standby {standby_id!r} on this node; list them with `gpusnap standbys`", reason="STANDBY_NOT_FOUND"
    )


def _gpu_map(snapshot: Snapshot, gpu: str, gpu_map: Mapping[str, str]) -> dict[str, str]:
    """``gpu_map``, or for ``gpu`` (one GPU, UUID or index) the map that sends the snapshot's one GPU there.

    Raises:
        InvalidArgumentError: ``gpu`` with ``gpu_map``, or for a snapshot on several GPUs or none
            (``GPU_MAP_UNEXPECTED``).
    """
    if not gpu:
        return dict(gpu_map)
    used = sorted({u for g in snapshot.gpu_processes for u in g.gpu_uuids})
    if gpu_map or len(used) != 1:
        raise InvalidArgumentError(
            f"--gpu names one GPU, but snapshot {snapshot.id} used {len(used)} GPUs"
            + (" and a GPU map was given" if gpu_map else "")
            + "; give --gpu-map OLD=NEW for each of them instead",
            reason="GPU_MAP_UNEXPECTED",
        )
    return {used[0]: gpu}


@contextmanager
def _nothing_to_delete() -> Iterator[None]:
    """A delete of a snapshot that is not there says so as ``NOTHING_TO_DELETE`` (action ``fix``: check the
    name), not as the ``SNAPSHOT_NOT_FOUND`` of a restore, whose action is to cold-start the worker instead."""
    try:
        yield
    except NotFoundError as err:
        if err.reason != "SNAPSHOT_NOT_FOUND":
            raise
        raise NotFoundError(err.message, reason="NOTHING_TO_DELETE", metadata=err.metadata) from None
