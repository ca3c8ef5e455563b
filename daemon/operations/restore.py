"""Restore: bring a snapshot back as a new process tree.

Phases: ``preflight`` (snapshot readable, caller allowed, host compatible) → ``verify`` (image sizes
and sha256) → ``restore`` (CRIU, by default into a fresh PID namespace) → ``validate`` (every restored
process exists and runs: CRIU's success alone is not trusted, see checkpoint-restore/criu#2525).
A failure kills whatever was restored and keeps the snapshot.
"""

from __future__ import annotations

import os
import signal

from gpusnap.daemon.api.errors import FailedPreconditionError, PermissionDeniedError
from gpusnap.daemon.api.types import Caller, RestoreOptions, RestoreResult, Snapshot
from gpusnap.daemon.drivers import host, proc
from gpusnap.daemon.operations.base import PhaseRunner
from gpusnap.daemon.operations.deps import Deps


def check_may_restore(snapshot: Snapshot, caller: Caller) -> None:
    """Non-root callers may restore only snapshots they took of their own processes.

    Raises:
        PermissionDeniedError: reason ``NOT_OWNER``.
    """
    if not caller.is_root and (snapshot.owner_uid != caller.uid or snapshot.source.uid != caller.uid):
        raise PermissionDeniedError(
            f"snapshot {snapshot.id} belongs to uid {snapshot.owner_uid}; only its owner or root may use it",
            reason="NOT_OWNER",
            metadata={"snapshot": snapshot.id},
        )


def check_host_compatible(snapshot: Snapshot) -> None:
    """Refuse snapshots taken on another CPU architecture.

    Raises:
        FailedPreconditionError: reason ``HOST_INCOMPATIBLE``.
    """
    if snapshot.host.machine != host.machine():
        raise FailedPreconditionError(
            f"snapshot {snapshot.id} was taken on {snapshot.host.machine}, this host is {host.machine()}; "
            "restore it on a host of the same architecture",
            reason="HOST_INCOMPATIBLE",
        )


def run_restore(run: PhaseRunner, deps: Deps, opts: RestoreOptions, caller: Caller) -> RestoreResult:
    """The body of a restore operation (see the module docstring)."""
    timeout = opts.timeout_s or deps.config.restore_timeout
    with run.phase("preflight"):
        snapshot = deps.store.get(opts.snapshot)
        run.record.target_snapshot = snapshot.id
        check_may_restore(snapshot, caller)
        check_host_compatible(snapshot)
    with run.phase("verify") as progress:
        deps.store.verify(snapshot)
        progress.bytes = snapshot.size_bytes
    with run.phase("restore") as progress:
        tree = deps.criu.restore(
            images_dir=deps.store.images_dir(snapshot.id),
            work_dir=deps.store.images_dir(snapshot.id).parent,
            log_name=f"restore-{run.record.id}.log",
            new_pidns=not opts.host_pid_namespace,
            tcp=_tcp_mode_of(snapshot),
            timeout_s=timeout,
        )
        progress.bytes = snapshot.size_bytes
        root = _host_root_pid(tree.init_pid, tree.ns_pid)
        run.on_failure("kill-restored", lambda: _kill_tree(tree.init_pid, root))
    with run.phase("validate"):
        pids = proc.tree_pids(root)
        expected = len(snapshot.source.tree_pids)
        if len(pids) != expected:
            raise FailedPreconditionError(
                f"restore of {snapshot.id} brought back {len(pids)} of {expected} processes; "
                f"see restore-{run.record.id}.log in the snapshot directory",
                reason="RESTORE_INCOMPLETE",
            )
    return RestoreResult(pid=root, pids=tuple(pids), snapshot_id=snapshot.id, namespace_pid=tree.ns_pid)


def _tcp_mode_of(snapshot: Snapshot):  # type: ignore[no-untyped-def]
    from gpusnap.daemon.api.types import TcpMode

    mode = snapshot.labels.get("gpusnap.dev/tcp", TcpMode.REFUSE.value)
    return TcpMode(mode)


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
    """Kill a restored tree: its namespace init takes everything inside with it."""
    target = init_pid or root
    try:
        os.kill(target, signal.SIGKILL)
    except ProcessLookupError:
        pass
