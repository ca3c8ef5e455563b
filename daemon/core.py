"""Daemon: the domain API the gRPC servicers call. One method per RPC; no gRPC here.

Validation, permission checks and the one-operation-per-tree rule are applied synchronously, so a
bad request fails its RPC at once; the work itself runs as a background operation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from gpusnap.daemon.api import paging, validate
from gpusnap.daemon.api.errors import AbortedError, NotFoundError, PermissionDeniedError
from gpusnap.daemon.api.types import Caller, CheckpointOptions, GpuPrefill, HostFacts, RestoreOptions, Snapshot
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.drivers.nvml import GpuDevice
from gpusnap.daemon.operations import remote as remote_ops
from gpusnap.daemon.operations.base import OperationKind, OperationRecord, PhaseRunner
from gpusnap.daemon.operations.checkpoint import host_facts, run_checkpoint
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.operations.registry import OperationRegistry
from gpusnap.daemon.operations.restore import check_may_restore, check_replicas, run_restore
from gpusnap.daemon.operations.suspend import run_resume, run_suspend
from gpusnap.daemon.remote import evict
from gpusnap.daemon.store.tiers import TierUsage


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


class Daemon:
    """The daemon's behaviour behind its API.

    Args:
        deps: drivers, store and config, built by ``gpusnap.daemon.server.build_daemon``.
        registry: where operations run.
    """

    def __init__(self, deps: Deps, registry: OperationRegistry):
        self.deps = deps
        self.registry = registry

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
        )

    def restore(self, opts: RestoreOptions, caller: Caller, request_id: str = "") -> OperationRecord:
        """Validate and start a restore (a known ``request_id``: the earlier operation).

        Raises:
            InvalidArgumentError, NotFoundError, PermissionDeniedError, DataLossError (manifest).
        """
        _require_identified(caller)
        earlier = self._earlier(caller, OperationKind.RESTORE, request_id)
        if earlier is not None:
            return earlier
        check_replicas(opts)
        validate.restore_context(opts.env, opts.unset_env, opts.values)
        try:
            snapshot = self.deps.store.get(opts.snapshot, caller.uid)
        except NotFoundError:
            if self.deps.remote is None:
                raise
            # Only in the remote store: pull it first, in the same operation (pull phases, then restore's).
            remote = remote_ops.require_remote(self.deps)
            snapshot = remote.find(opts.snapshot, caller.uid).snapshot
            check_may_restore(snapshot, caller, lambda: remote.not_found(opts.snapshot))
            here = dataclasses.replace(opts, snapshot=snapshot.id)
            record = OperationRecord(
                OperationKind.RESTORE, target_snapshot=snapshot.id, owner_uid=caller.uid, request_id=request_id
            )
            return self.registry.start(
                record,
                (),
                lambda run: (
                    remote_ops.run_pull(run, self.deps, snapshot.id, caller),
                    run_restore(run, self.deps, here, caller),
                )[1],
                opts.replicas,
            )
        check_may_restore(snapshot, caller, lambda: self.deps.store.not_found(opts.snapshot))
        record = OperationRecord(
            OperationKind.RESTORE, target_snapshot=snapshot.id, owner_uid=caller.uid, request_id=request_id
        )
        return self.registry.start(record, (), lambda run: run_restore(run, self.deps, opts, caller), opts.replicas)

    def push(self, ref: str, caller: Caller) -> OperationRecord:
        """Validate and start pushing a local snapshot to the remote store.

        Raises:
            FailedPreconditionError (no remote), InvalidArgumentError, NotFoundError, PermissionDeniedError.
        """
        _require_identified(caller)
        remote_ops.require_remote(self.deps)
        snapshot = self.snapshot(ref, caller)
        record = OperationRecord(OperationKind.PUSH, target_snapshot=snapshot.id, owner_uid=caller.uid)
        return self.registry.start(record, (), lambda run: remote_ops.run_push(run, self.deps, snapshot.id, caller))

    def pull(self, ref: str, caller: Caller) -> OperationRecord:
        """Validate and start pulling a snapshot of the remote store into the local one.

        Raises:
            FailedPreconditionError (no remote), InvalidArgumentError, NotFoundError, PermissionDeniedError,
            UnavailableError (remote unreachable).
        """
        _require_identified(caller)
        remote = remote_ops.require_remote(self.deps)
        doc = remote.find(ref, caller.uid)
        check_may_restore(doc.snapshot, caller, lambda: remote.not_found(ref))
        record = OperationRecord(OperationKind.PULL, target_snapshot=doc.snapshot.id, owner_uid=caller.uid)
        return self.registry.start(record, (), lambda run: remote_ops.run_pull(run, self.deps, doc.snapshot.id, caller))

    def remote_snapshots(
        self, caller: Caller, label_selector: Mapping[str, str], page_size: int = 0, page_token: str = ""
    ) -> paging.Page[Snapshot]:
        """A page of the snapshots published in the remote store that the caller may use, oldest first: the
        caller's part of the name index is listed, and only the page's entries are read (all of them with a
        label selector)."""
        index = remote_ops.require_remote(self.deps).index
        entries = index.entries(None if caller.is_root else caller.uid)
        size = paging.page_size(page_size)
        if not label_selector:
            page = paging.paginate(entries, lambda e: e.sort_key, size, page_token)
            return paging.Page(index.read(page.items), page.next_token)
        found = [s for s in index.read(entries) if all(s.labels.get(k) == v for k, v in label_selector.items())]
        return paging.paginate(found, snapshot_key, size, page_token)

    def delete_remote_snapshot(self, ref: str, caller: Caller) -> str:
        """Delete a snapshot's remote manifest, then collect unreferenced chunks past the grace period."""
        _require_identified(caller)
        remote = remote_ops.require_remote(self.deps)
        with _nothing_to_delete():
            snapshot = remote.find(ref, caller.uid).snapshot
            check_may_restore(snapshot, caller, lambda: remote.not_found(ref))
        remote.delete(snapshot)
        remote.collect_garbage(self.deps.config.remote_gc_grace)
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
        return self._start_on_tree(
            OperationKind.RESUME, pid, caller, lambda run: run_resume(run, self.deps, pid, gpu_map), request_id
        )

    def _start_on_tree(
        self, kind: OperationKind, pid: int, caller: Caller, body: Callable[[PhaseRunner], object], request_id: str = ""
    ) -> OperationRecord:
        """Validate ``pid`` and the caller's right to it, then start ``body`` holding the whole tree."""
        _require_identified(caller)
        validate.pid(pid)
        tree = proc.check_may_checkpoint(pid, caller)
        record = OperationRecord(kind, target_pid=pid, owner_uid=caller.uid, request_id=request_id)
        return self.registry.start(record, tree, body)

    def _earlier(self, caller: Caller, kind: OperationKind, request_id: str) -> OperationRecord | None:
        """The ``kind`` of operation this caller started with idempotency key ``request_id`` (validated), if any."""
        if not request_id:
            return None
        validate.request_id(request_id)
        return self.registry.find_request(caller.uid, kind.value, request_id)

    def cancel(self, op_id: str, caller: Caller) -> OperationRecord:
        """Ask a running operation to stop and roll back; it does at its next phase boundary or wait.

        Raises:
            NotFoundError: as :meth:`operation`.
            PermissionDeniedError: an anonymous caller.
        """
        _require_identified(caller)
        record = self.operation(op_id, caller)
        if not record.done:
            record.cancel_requested.set()
        return record

    def operation(self, op_id: str, caller: Caller) -> OperationRecord:
        """An operation the caller may see (its own, or any for root)."""
        record = self.registry.get(op_id)
        if not caller.is_root and record.owner_uid != caller.uid:
            raise NotFoundError(f"no operation {op_id!r} in this daemon", reason="OPERATION_NOT_FOUND")
        return record

    def operations(self, caller: Caller, page_size: int = 0, page_token: str = "") -> paging.Page[OperationRecord]:
        """A page of the operations the caller may see, oldest first (raises as :func:`paging.paginate`)."""
        records = [r for r in self.registry.list() if caller.is_root or r.owner_uid == caller.uid]
        return paging.paginate(records, operation_key, paging.page_size(page_size), page_token)

    def snapshots(
        self, caller: Caller, label_selector: Mapping[str, str], page_size: int = 0, page_token: str = ""
    ) -> paging.Page[Snapshot]:
        """A page of the caller's snapshots (root: all) matching ``label_selector``, oldest first; the index
        is filtered by owner before anything else (raises as :func:`paging.paginate`)."""
        snaps = self.deps.store.list(label_selector, owner_uid=None if caller.is_root else caller.uid)
        return paging.paginate(snaps, snapshot_key, paging.page_size(page_size), page_token)

    def snapshot(self, ref: str, caller: Caller) -> Snapshot:
        snapshot = self.deps.store.get(ref, caller.uid)
        check_may_restore(snapshot, caller, lambda: self.deps.store.not_found(ref))
        return snapshot

    def delete_snapshot(self, ref: str, caller: Caller) -> str:
        """Delete a snapshot; root may delete damaged ones whose owner cannot be read."""
        _require_identified(caller)
        with _nothing_to_delete():
            if not caller.is_root:
                self.snapshot(ref, caller)
            snapshot_id = self.deps.store.path_of(ref, caller.uid).name
        busy = [r.id for r in self.registry.list() if not r.done and r.target_snapshot == snapshot_id]
        if busy:
            raise AbortedError(
                f"snapshot {snapshot_id} is in use by operation {busy[0]}; wait for it (`gpusnap wait {busy[0]}`)",
                reason="SNAPSHOT_BUSY",
            )
        return self.deps.store.delete(snapshot_id)

    def node_info(self, caller: Caller) -> NodeInfo:
        """The node's facts; the store's use (bytes, snapshots, blobs per tier) is the caller's own, or
        everyone's for root."""
        if caller.anonymous:
            raise PermissionDeniedError(
                "callers without a verified client certificate may not read the node's facts; configure "
                "tls_client_ca and connect with a listed client certificate, or use the Unix socket",
                reason="ANONYMOUS",
            )
        uid = None if caller.is_root else caller.uid
        snapshots = self.deps.store.list(owner_uid=uid)
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


def _require_identified(caller: Caller) -> None:
    """Refuse changes from anonymous callers (TCP without a client certificate).

    Raises:
        PermissionDeniedError: reason ``ANONYMOUS``.
    """
    if caller.anonymous:
        raise PermissionDeniedError(
            "callers without a verified client certificate may not change anything; configure tls_client_ca "
            "and connect with a client certificate, or use the Unix socket",
            reason="ANONYMOUS",
        )


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
