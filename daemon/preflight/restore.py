"""A restore's preflight: the request against the snapshot and this host, before anything is restored.

Each check runs once per restore. ``Daemon.restore`` (and ``standby``, ``activate``) checks the request as it
arrives: the caller's right to the snapshot (``access.callers.check_may_restore``) and the replica count
(:func:`check_replicas`). The operation's ``preflight`` (``operations.restore.Restore.prepare``) then checks, in
this order: the CPU architecture; the compatibility gate of a pulled snapshot
(``operations.provenance.check_pulled``); the request's options (``--private-net`` with ``--host-pidns``, a
restore context for a snapshot that has nobody to hand it to, the ports the tree listened on); the files a
non-root snapshot reopens by path, against its owner's rights (``access.file_rights``); and where its GPUs go,
with the GPU preflight (``preflight.gpu``).
"""

from __future__ import annotations

from pathlib import Path

from gpusnap.daemon.access import file_rights
from gpusnap.daemon.api.errors import FailedPreconditionError, InvalidArgumentError
from gpusnap.daemon.api.types import RestoreOptions, Snapshot
from gpusnap.daemon.drivers import host, proc, procfs
from gpusnap.daemon.gpu import gpumap
from gpusnap.daemon.gpu.support import GpuSupport
from gpusnap.daemon.preflight import gpu as gpu_preflight

MAX_REPLICAS = 64


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
            metadata={
                "snapshot": snapshot.id,
                "snapshot_machine": snapshot.host.machine,
                "host_machine": host.machine(),
            },
        )


def check_replicas(opts: RestoreOptions) -> None:
    """Fan-out needs fresh namespaces and a sane count.

    Raises:
        InvalidArgumentError: reason ``INVALID_REPLICAS``.
    """
    if not 1 <= opts.replicas <= MAX_REPLICAS:
        raise InvalidArgumentError(
            f"replicas must be 1 to {MAX_REPLICAS}, not {opts.replicas}",
            reason="INVALID_REPLICAS",
            metadata={"replicas": str(opts.replicas)},
        )
    if opts.replicas > 1 and opts.host_pid_namespace:
        raise InvalidArgumentError(
            "--replicas restores copies side by side, each in fresh PID and network namespaces; drop --host-pidns",
            reason="INVALID_REPLICAS",
        )


def check_context(snapshot: Snapshot, opts: RestoreOptions) -> None:
    """A restore context (``--env``, ``--unset-env``, ``--set``) needs a worker to hand it to.

    Raises:
        InvalidArgumentError: reason ``CONTEXT_UNEXPECTED``.
    """
    if (opts.env or opts.unset_env or opts.values) and snapshot.worker is None:
        raise InvalidArgumentError(
            f"snapshot {snapshot.id} has no worker agent or control directory to hand a restore context to; "
            "drop --env/--unset-env/--set",
            reason="CONTEXT_UNEXPECTED",
        )


def check_request(snapshot: Snapshot, opts: RestoreOptions) -> None:
    """The request's options fit together and fit the snapshot (its replica count was checked when it was
    made: :func:`check_replicas`), and the ports its tree listened on are free where it will listen again (the
    host's network).

    Raises:
        InvalidArgumentError: ``--private-net`` with ``--host-pidns`` (``INVALID_ARGUMENT``), as
            :func:`check_context`.
        FailedPreconditionError: a port is taken (``ADDRESS_IN_USE``).
    """
    if opts.private_network and opts.host_pid_namespace:
        raise InvalidArgumentError(
            "--private-net needs the fresh namespaces of a default restore; drop --host-pidns",
            reason="INVALID_ARGUMENT",
        )
    check_context(snapshot, opts)
    if not opts.private_network and opts.replicas == 1:
        busy = proc.ports_in_use(list(snapshot.source.listening))
        if busy:
            raise FailedPreconditionError(
                f"the tree listened on {', '.join(busy)}, where something listens now (its source, or another "
                "restored copy); restore it with --private-net, or stop what holds the port",
                reason="ADDRESS_IN_USE",
            )


def check_files(snapshot: Snapshot, opts: RestoreOptions, shm_dir: Path) -> None:
    """Every file a non-root snapshot's tree reopens by path is still its owner's to open
    (``access.file_rights.check_before_restore``); ``shm_dir``: the snapshot's saved ``/dev/shm`` files, which a
    restore into fresh namespaces brings back from the images instead.

    Raises:
        PermissionDeniedError: reason ``FILE_NOT_PERMITTED``.
    """
    private_shm = shm_dir.is_dir() and not opts.host_pid_namespace
    file_rights.check_before_restore(snapshot, private_shm)


def resolve_gpu_map(gpu: GpuSupport, snapshot: Snapshot, opts: RestoreOptions) -> dict[str, str] | None:
    """Where each checkpointed GPU goes (``None`` for a CPU-only snapshot), after the GPU preflight.

    Raises:
        InvalidArgumentError: a GPU map for a snapshot without GPU state, or a malformed/incomplete map.
        FailedPreconditionError, ResourceExhaustedError: see :func:`gpumap.resolve_for_processes` and
            :func:`preflight.gpu.check_restore <gpusnap.daemon.preflight.gpu.check_restore>`.
    """
    if not snapshot.gpu_processes:
        if opts.gpu_map:
            raise InvalidArgumentError(
                f"snapshot {snapshot.id} holds no GPU state; drop --gpu-map", reason="GPU_MAP_UNEXPECTED"
            )
        return None
    gpu.require(f"restoring snapshot {snapshot.id} (it holds GPU state)")
    gpus = gpu.gpus()
    resolved, need = gpumap.resolve_for_processes(opts.gpu_map, snapshot.gpu_processes, gpus)
    driver, _ = gpu.driver_versions()
    gpu_preflight.check_restore(
        gpu_preflight.RestoreFacts(
            machine=host.machine(),
            driver_version=driver,
            gpus=gpus,
            gpu_map=resolved,
            required_free_bytes=need,
            mem_available_bytes=gpu.host_memory(),
            image_bytes=snapshot.size_bytes,
            mps_daemon_running=procfs.mps_daemon_running(),
        )
    )
    return resolved
