"""build_daemon(config): the one place where drivers, store, operations and services are wired."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gpusnap.daemon import __version__
from gpusnap.daemon.access import callers, rundirs
from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.api.types import FinishedOperation
from gpusnap.daemon.config import DaemonConfig
from gpusnap.daemon.core import Daemon
from gpusnap.daemon.drivers import host, pagefill
from gpusnap.daemon.drivers.criu import CriuDriver
from gpusnap.daemon.executor import Executor
from gpusnap.daemon.gpu.support import GpuSupport
from gpusnap.daemon.operations import leftover_criu, recovery
from gpusnap.daemon.operations import standby as standby_ops
from gpusnap.daemon.operations.base import OperationKind
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.operations.failpoints import NONE as NO_FAULTS
from gpusnap.daemon.operations.failpoints import Failpoints
from gpusnap.daemon.operations.registry import OperationRegistry
from gpusnap.daemon.operations.standby import StandbyOptions
from gpusnap.daemon.operations.tree_bounds import TreeBounds
from gpusnap.daemon.park.ladder import Ladder, blob_rank
from gpusnap.daemon.park.policy import FILE as POLICIES
from gpusnap.daemon.park.policy import Policies
from gpusnap.daemon.park.standbys import FILE as STANDBYS
from gpusnap.daemon.park.standbys import StandbyRegistry
from gpusnap.daemon.remote import objects as remote_objects
from gpusnap.daemon.remote.evict import RemoteEvictor
from gpusnap.daemon.remote.store import RemoteStore
from gpusnap.daemon.remote.transfer import TransferLimits
from gpusnap.daemon.service import reflection, servicers
from gpusnap.daemon.service.aio import AioServer, streams_per_connection
from gpusnap.daemon.service.limits import CallerLimits
from gpusnap.daemon.service.peercred import PeerCredProxy
from gpusnap.daemon.service.servicers import SERVICE_NAMES
from gpusnap.daemon.store import SnapshotStore
from gpusnap.daemon.store.journal import JOURNAL, Journal
from gpusnap.daemon.weights.prefill import PrefillSupport
from gpusnap.daemon.workers.agents import AgentRegistry

log = structlog.get_logger(__name__)

MAX_QUEUED_PER_CALLER = 256
"""Unary calls of one caller that may wait for a turn; more fail with RESOURCE_EXHAUSTED."""
UNSENT_PER_CONNECTION = 8 << 20
"""Bytes of answers one connection may hold unread before its next call waits (a list page is <= 2 MiB)."""
UNSENT_PER_CALLER = 32 << 20
"""Bytes of answers one caller may hold unread over all its connections before its next call waits."""


@dataclasses.dataclass
class Running:
    """A started daemon; :meth:`stop` shuts it down."""

    server: AioServer
    proxy: PeerCredProxy
    daemon: Daemon
    health: health.aio.HealthServicer
    metrics: Any  # gpusnap.daemon.metrics.Metrics, or None when metrics_listen is empty
    executor: Executor
    """The daemon's lanes of threads (``gpusnap.daemon.executor``); shut down once no operation runs, before
    the agent channel and the store close (a budget pass moving a blob must not outlive the store's lock)."""

    def stop(self, grace: float = 5.0) -> None:
        self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(grace)
        self.executor.stop_lane("rpc")  # no queued call runs once the server is gone
        self.proxy.stop()
        if self.metrics is not None:
            self.metrics.stop()
        # Running operations finish (and roll back if they fail) before the store and the agent channel
        # close: a quiesced worker must still be able to reconnect and be resumed.
        _release(self.daemon, self.executor)
        rundirs.remove_if_empty(wake_dir(self.daemon.deps.config))

    def set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for name in ("", *SERVICE_NAMES):
            self.server.run(self.health.set(name, status))


@dataclasses.dataclass(frozen=True)
class Overrides:
    """What ``build_daemon`` takes as given instead of building or reading it itself: faults to inject, and fakes
    for what cannot run on the machine at hand (tests; ``main`` passes the failpoints of its environment)."""

    failpoints: Failpoints = NO_FAULTS
    """Faults at phase boundaries (``operations.failpoints``: ``GPUSNAP_FAILPOINT``)."""
    fill_driver: Any = None
    """The CUDA driver the device fill (``gpu_prefill``) calls: ``cuda.bindings.driver`` when ``None``, or a fake
    with its calls (tests/fakes/cuda_vmm.py, as tests/daemon/prefill_daemon.py runs gpusnapd)."""
    gpu: GpuSupport | None = None
    """The node's GPUs (the CUDA checkpoint driver and NVML): probed when ``None``, or fakes of both
    (tests/daemon/prefill_daemon.py: a worker holding the fake device memory of ``fill_driver`` is a CUDA
    process on its GPU)."""


def check_config(config: DaemonConfig) -> None:
    """Check ``config`` as a whole: its settings (``DaemonConfig.validate``) and the remote store's URL, which
    its backend parses (``remote.objects.check_url``; no SDK is imported).

    Raises:
        InvalidArgumentError: inconsistent settings, or a remote URL no backend takes (``BAD_CONFIG``).
    """
    config.validate()
    if config.remote:
        remote_objects.check_url(config.remote)


def build_daemon(config: DaemonConfig, overrides: Overrides = Overrides()) -> Running:  # noqa: B008 (frozen)
    """Check CRIU, open the store, start the gRPC server and the socket proxy; every collaborator is built here
    and handed to the next by its constructor. A start refused part-way releases what it had taken (the agent
    socket it bound, the wake directory it made, the store's lock).

    Raises:
        FailedPreconditionError: CRIU missing or older than 4.1, store locked by another daemon.
        InvalidArgumentError: inconsistent configuration.
    """
    with contextlib.ExitStack() as undo:
        running = _build(config, overrides, undo)
        undo.pop_all()
        return running


def _build(config: DaemonConfig, overrides: Overrides, undo: contextlib.ExitStack) -> Running:
    """:func:`build_daemon`'s work, one subsystem after another; each thing acquired registers its release on
    ``undo``."""
    check_config(config)
    host.raise_open_file_limit()
    executor = Executor()
    undo.callback(executor.shutdown)  # a start that fails before the store opens (idempotent: see below)
    criu, criu_version = _criu(config, undo)
    remote = _remote(config)
    prefill = PrefillSupport.probe(config.gpu_prefill, overrides.fill_driver, jobs=executor.prefill)
    undo.callback(prefill.close)
    policies = Policies(config.store / POLICIES, config.park(), config.max_policies_per_caller)
    policies.load()
    store, journal = _storage(config, remote, prefill, policies, executor, undo)
    gpu = overrides.gpu or GpuSupport.probe(
        call_timeout_s=config.gpu_call_timeout, host_memory_bytes=config.host_memory_bytes
    )
    if prefill.filler is not None:
        prefill.warm(store.buffers, store.list)  # contexts and registrations, in the background
    agents = _agents(config, undo)
    undo.callback(executor.shutdown)  # runs before the agents stop and the store closes (the undo runs in reverse)
    if remote is not None:
        store.buffers.schedule_budgets()
    standbys = StandbyRegistry(config.store / STANDBYS)
    deps = Deps(
        config=config,
        store=store,
        criu=criu,
        criu_version=criu_version,
        gpu=gpu,
        agents=agents,
        remote=remote,
        prefill=prefill,
        standbys=standbys,
        tree_bounds=TreeBounds(config.max_trees_per_caller, config.tree_memory_per_caller()),
    )
    metrics = _metrics(config, gpu, criu_version, lambda: daemon)
    ladder = Ladder(  # its own moves go through the same calls as a caller's (on the daemon built below)
        store,
        standbys,
        policies,
        config.store,
        remote is not None,
        make_standby=lambda snapshot: daemon.standby(StandbyOptions(snapshot.id), callers.owner_of(snapshot)),
        drop_standby=lambda standby_id: standby_ops.drop(deps, standby_id),
    )
    # each operation's end, published once by the registry, to the metrics, the park ladder and the prefill
    subscribers = [ladder.after_operation] if metrics is None else [metrics.after_operation, ladder.after_operation]
    if prefill.filler is not None:
        subscribers.append(prefill.after_operation)
    registry = _operations(deps, journal, subscribers, overrides.failpoints, undo)
    daemon = Daemon(deps, registry, ladder)
    ladder.load()
    server, proxy, health_servicer = _api(config, daemon, executor, undo)
    metrics_at = _serve_metrics(config, metrics)
    ladder.start()
    running = Running(
        server=server, proxy=proxy, daemon=daemon, health=health_servicer, metrics=metrics, executor=executor
    )
    running.set_health(health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "daemon.started",
        socket=str(config.socket),
        agent_socket=str(config.agent_socket),
        store=str(config.store),
        criu=config.criu_binary,
        criu_version=criu_version,
        listen=config.listen or None,
        metrics=metrics_at,
        gpu=gpu.available,
        gpu_reason=gpu.reason or None,
    )
    return running


def _criu(config: DaemonConfig, undo: contextlib.ExitStack) -> tuple[CriuDriver, str]:
    """The CRIU driver (its page fill as set, or off with the reason logged), checked, with a spare helper
    started; and CRIU's version.

    Raises:
        FailedPreconditionError: CRIU missing or older than 4.1.
    """
    page_fill = pagefill.setting(config.page_fill_threads)
    if page_fill.reason and config.page_fill_threads >= 0:
        log.warning("page_fill.off", reason=page_fill.reason)
    criu = CriuDriver(
        config.criu_binary, config.pycriu_path, failed_logs_dir=config.store / "logs", page_fill=page_fill
    )
    criu_version = criu.require_supported()
    criu.keep_spare_helper()
    undo.callback(criu.close)
    return criu, criu_version


def _storage(
    config: DaemonConfig,
    remote: RemoteStore | None,
    prefill: PrefillSupport,
    policies: Policies,
    executor: Executor,
    undo: contextlib.ExitStack,
) -> tuple[SnapshotStore, Journal]:
    """The snapshot store, opened (and locked), and the operation journal beside it (not opened yet)."""
    store = SnapshotStore(
        config.store,
        Path(config.buffer_dir) if config.buffer_dir else None,
        config.ram_tier_bytes,
        config.disk_tier_bytes,
        config.pull_grace,
        # the disk tier may drop what is safely in the remote store
        evictor=(lambda s: RemoteEvictor(s, remote)) if remote is not None else None,
        # blobs the store removes are unregistered (their pages unpinned)
        after_collect=prefill.filler.drop_unlinked if prefill.filler is not None else None,
        # lower park priorities leave a tier first
        rank=lambda s: functools.partial(blob_rank, policies, s),
        executor=executor,
    )
    journal = Journal(config.store / JOURNAL)
    store.open(
        hold_buffers=lambda: recovery.held_buffers(journal),
        busy_staging=lambda: leftover_criu.busy_staging(journal.entries()),
    )  # read once the store is locked
    undo.callback(store.close)
    return store, journal


def _agents(config: DaemonConfig, undo: contextlib.ExitStack) -> AgentRegistry:
    """The agent socket, listening, and the agents' wake directory."""
    for sock_dir in {config.socket.parent, config.agent_socket.parent}:
        sock_dir.mkdir(parents=True, exist_ok=True)
        rundirs.check_socket_dir(sock_dir)
    agents = AgentRegistry(config.agent_socket)
    agents.start()
    undo.callback(agents.stop)
    # The agents' default GPUSNAP_WAKE_DIR: they only read it, gpusnapd writes their wake files.
    rundirs.make_own_dir(wake_dir(config), 0o755, shared=True, narrowed_from=0o1777)
    undo.callback(rundirs.remove_if_empty, wake_dir(config))
    return agents


def _metrics(config: DaemonConfig, gpu: GpuSupport, criu_version: str, daemon: Callable[[], Daemon]) -> Any:
    """The Prometheus collector (a ``gpusnap.daemon.metrics.Metrics``; not serving yet), or None when
    ``metrics_listen`` is empty. ``daemon`` gives the daemon once it exists (a scrape reads its usage)."""
    if not config.metrics_listen:
        return None
    from gpusnap.daemon.metrics import Metrics  # prometheus-client is imported only when metrics are on

    metrics = Metrics(lambda: _usage(daemon()))  # read at scrape time
    driver, cuda = gpu.driver_versions()
    metrics.set_versions(
        gpusnap_version=__version__,
        criu_version=criu_version,
        nvidia_driver_version=driver,
        cuda_driver_version=cuda,
    )
    return metrics


def _operations(
    deps: Deps,
    journal: Journal,
    subscribers: Sequence[Callable[[FinishedOperation], None]],
    failpoints: Failpoints,
    undo: contextlib.ExitStack,
) -> OperationRegistry:
    """The operation registry over the opened journal, once recovery has settled what the last daemon left
    (before anyone can reach the trees it touches) and the standbys are adopted."""
    config = deps.config
    journal.open()
    registry = OperationRegistry(
        max_workers=config.max_operations,
        max_per_caller=config.max_operations_per_caller,
        max_running=config.max_running_operations,
        journal=journal,
        subscribers=subscribers,
        failpoints=failpoints,
    )
    undo.callback(registry.shutdown, wait=True)
    recovery.recover(deps, journal, registry)
    standby_ops.adopt(deps)  # after recovery: a standby an activation had claimed is recovery's
    return registry


def _api(
    config: DaemonConfig, daemon: Daemon, executor: Executor, undo: contextlib.ExitStack
) -> tuple[AioServer, PeerCredProxy, health.aio.HealthServicer]:
    """The gRPC server on the private socket (and TLS on ``listen``), and the peer-credential proxy on the
    public socket in front of it; both started."""
    private_dir = config.socket.parent / ".gpusnapd-private"
    rundirs.make_own_dir(private_dir, 0o700)
    # Named after the public socket: two daemons whose API sockets share a directory share this one too.
    private = private_dir / f"{config.socket.name}.grpc"
    proxy = PeerCredProxy(config.socket, private, config.socket_group, config.max_connections_per_caller)
    proxy.check_free()
    if (private.exists() or private.is_symlink()) and rundirs.socket_answers(private):
        raise FailedPreconditionError(
            f"another gpusnapd already serves {private} (the private socket of {config.socket}); stop it first "
            "or pass another --socket",
            reason="SOCKET_IN_USE",
        )
    if private.exists() or private.is_symlink():
        private.unlink()

    limits = CallerLimits(
        calls=config.max_calls_per_caller,
        queued=MAX_QUEUED_PER_CALLER,
        streams=config.max_streams_per_caller,
        unsent_per_connection=UNSENT_PER_CONNECTION,
        unsent_per_caller=UNSENT_PER_CALLER,
    )
    server = AioServer(max_streams=streams_per_connection(limits))
    health_servicer = health.aio.HealthServicer()

    async def setup() -> None:  # on the server's loop
        aio = server.server
        servicers.serve(aio, daemon, proxy, executor.rpc, limits)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, aio)
        reflection.enable((*SERVICE_NAMES, health.SERVICE_NAME), aio)
        aio.add_insecure_port(f"unix:{private}")
        if config.listen:
            aio.add_secure_port(config.listen, _tls_credentials(config))

    server.run(setup())
    server.start()
    undo.callback(server.stop, 0)
    proxy.start()
    undo.callback(proxy.stop)
    return server, proxy, health_servicer


def _serve_metrics(config: DaemonConfig, metrics: Any) -> str | None:
    """Serve ``metrics`` on ``metrics_listen``; returns ``host:port`` (None without metrics).

    Raises:
        FailedPreconditionError: the address is taken (``METRICS_ADDRESS_IN_USE``).
    """
    if metrics is None:
        return None
    try:
        metrics_host, metrics_port = metrics.serve(config.metrics_listen)
    except OSError as exc:
        raise FailedPreconditionError(
            f"cannot serve metrics on {config.metrics_listen} ({exc.strerror or exc}); pick a free address "
            "with --metrics-listen / metrics_listen",
            reason="METRICS_ADDRESS_IN_USE",
            metadata={"listen": config.metrics_listen},
        ) from exc
    return f"{metrics_host}:{metrics_port}"


def wake_dir(config: DaemonConfig) -> Path:
    """The agents' default GPUSNAP_WAKE_DIR: ``wake`` beside the agent socket (mode 0755; only gpusnapd writes
    there)."""
    return config.agent_socket.parent / "wake"


def _release(daemon: Daemon, executor: Executor) -> None:
    """Release what :func:`build_daemon` acquired before the servers started (the executor's lanes, agent
    socket, spare CRIU helper, store lock), in that order."""
    if daemon.ladder is not None:  # no standby made or dropped while the rest stops
        daemon.ladder.stop()
    daemon.registry.shutdown(wait=True)
    if daemon.deps.prefill is not None:
        daemon.deps.prefill.close()
    executor.shutdown()  # a budget pass or read-ahead ends while the store is still locked
    daemon.deps.agents.stop()
    daemon.deps.criu.close()
    daemon.deps.store.close()


def _usage(daemon: Daemon) -> Any:
    """What a scrape reads (a ``gpusnap.daemon.metrics.Usage``)."""
    from gpusnap.daemon.metrics import Usage

    store = daemon.deps.store
    buffers = store.buffers.used_bytes()
    running = dict.fromkeys((kind.value for kind in OperationKind), 0)
    for record in daemon.registry.list():
        if not record.done:
            running[record.kind.value] += 1
    park = daemon.ladder.usage() if daemon.ladder is not None else {}
    return Usage(
        tier_bytes={"images": store.used_bytes() - buffers, "buffers": buffers},
        snapshots=len(store.list()),
        agents=daemon.deps.agents.connected(),
        running_operations=running,
        **park,
    )


def _remote(config: DaemonConfig) -> RemoteStore | None:
    if not config.remote:
        return None
    limits = TransferLimits.from_config(config.remote_threads, config.remote_memory_bytes, config.remote_gc_grace)
    objects = remote_objects.connect(
        config.remote, config.remote_endpoint, config.remote_ca_bundle, connections=limits.threads * 2
    )
    return RemoteStore(objects, limits)


def _tls_credentials(config: DaemonConfig) -> grpc.ServerCredentials:
    key = Path(config.tls_key).read_bytes()
    cert = Path(config.tls_cert).read_bytes()
    if config.tls_client_ca:
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=Path(config.tls_client_ca).read_bytes(), require_client_auth=True
        )
    return grpc.ssl_server_credentials([(key, cert)])
