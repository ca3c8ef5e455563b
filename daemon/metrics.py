"""Prometheus metrics of gpusnapd (prometheus-client), served on ``metrics_listen`` when it is set.

Operations are counted when they finish (:meth:`Metrics.observe`, called by the operation registry);
store, tier and agent figures are read at scrape time. Metric names follow the Prometheus naming
guide: ``gpusnap_`` prefix, base units (seconds, bytes), ``_total`` for counters.
"""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler
from prometheus_client.registry import Collector

from gpusnap.daemon.api.types import FinishedOperation
from gpusnap.daemon.config import parse_listen

MAX_SCRAPE_CONNECTIONS = 8
"""Scrapes served at once; further connections are closed as they are accepted (any local user can reach
the endpoint: 1000 half-sent requests once held 1014 threads and 1074 descriptors)."""
SCRAPE_READ_TIMEOUT_S = 5.0
"""A scrape's whole request must arrive within this of its connection, or the connection is closed: a
deadline for the request, not a timeout per read (8 connections sending one byte every 4 s once held every
slot for as long as they went on: issue 26, item 9)."""
SCRAPE_TOTAL_S = 15.0
"""A scrape's connection is closed this long after it was accepted, whatever it still sends or reads."""

# Phases last from milliseconds (publish) to minutes (a GPU dump of a large model).
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


@dataclass(frozen=True)
class Usage:
    """What a scrape reads from the daemon: bytes per storage tier, snapshots, connected agents."""

    tier_bytes: dict[str, int]
    snapshots: int
    agents: int
    running_operations: dict[str, int]
    rungs: dict[str, int] = field(default_factory=dict)
    """Workloads per park rung (``gpusnap.daemon.park.ladder``)."""
    standbys: int = 0
    standby_bytes: int = 0
    moves: dict[tuple[str, str], int] = field(default_factory=dict)
    """Park moves so far, by (from rung, to rung)."""


class _UsageCollector(Collector):
    def __init__(self, read: Callable[[], Usage]):
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        usage = self._read()
        tiers = GaugeMetricFamily("gpusnap_store_used_bytes", "Bytes used in the store, by tier", labels=["tier"])
        for tier, used in sorted(usage.tier_bytes.items()):
            tiers.add_metric([tier], used)
        yield tiers
        yield GaugeMetricFamily("gpusnap_snapshots", "Snapshots listed in the store", value=usage.snapshots)
        yield GaugeMetricFamily("gpusnap_agents_connected", "Worker agents connected to the daemon", value=usage.agents)
        running = GaugeMetricFamily("gpusnap_operations_running", "Operations in progress, by kind", labels=["kind"])
        for kind, count in sorted(usage.running_operations.items()):
            running.add_metric([kind], count)
        yield running
        rungs = GaugeMetricFamily("gpusnap_park_workloads", "Workloads (snapshots) by park rung", labels=["rung"])
        for rung, count in usage.rungs.items():
            rungs.add_metric([rung], count)
        yield rungs
        yield GaugeMetricFamily("gpusnap_standbys", "Standbys (snapshots restored ahead)", value=usage.standbys)
        yield GaugeMetricFamily(
            "gpusnap_standby_host_memory_bytes", "Resident memory of the standbys", value=usage.standby_bytes
        )
        moves = CounterMetricFamily(
            "gpusnap_park_moves", "Moves of workloads between park rungs", labels=["src", "dst"]
        )
        for (src, dst), count in sorted(usage.moves.items()):
            moves.add_metric([src, dst], count)
        yield moves

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())  # values come only at scrape time


class Metrics:
    """The daemon's metrics in their own registry (so tests and embedders never share the global one).

    Args:
        usage: called at each scrape for store, tier and agent figures.
    """

    def __init__(self, usage: Callable[[], Usage]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.operations = Counter(
            "gpusnap_operations", "Finished operations, by kind and result", ["kind", "result"], registry=self.registry
        )
        self.failures = Counter(
            "gpusnap_operation_failures",
            "Failed operations, by kind and stable reason (docs/errors.md)",
            ["kind", "reason"],
            registry=self.registry,
        )
        self.operation_seconds = Histogram(
            "gpusnap_operation_duration_seconds",
            "Wall time of finished operations",
            ["kind", "result"],
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self.phase_seconds = Histogram(
            "gpusnap_phase_duration_seconds",
            "Duration of completed operation phases",
            ["kind", "phase"],
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self.bytes_moved = Counter(
            "gpusnap_bytes_moved", "Bytes moved by completed phases", ["kind", "phase"], registry=self.registry
        )
        self.build = Info("gpusnap_build", "gpusnap, CRIU and GPU driver versions", registry=self.registry)
        self.registry.register(_UsageCollector(usage))
        self._server: Any = None

    def set_versions(self, **versions: str) -> None:
        """Fill ``gpusnap_build_info`` (e.g. ``criu_version="4.2"``; empty values are sent as "none")."""
        self.build.info({k: v or "none" for k, v in versions.items()})

    def after_operation(self, record: FinishedOperation) -> None:
        """Count a finished operation, its phases and the bytes they moved (it subscribes to the operation
        registry)."""
        kind = record.kind.value
        result = "succeeded" if record.succeeded else "failed"
        self.operations.labels(kind, result).inc()
        if record.error is not None:
            self.failures.labels(kind, record.error.reason).inc()
        self.operation_seconds.labels(kind, result).observe((record.finished - record.started).total_seconds())
        for phase in record.phases:
            name = phase.phase.partition("#")[0]  # fan-out copies ("restore#3") share their phase's series
            self.phase_seconds.labels(kind, name).observe(phase.duration_seconds)
            if phase.bytes:
                self.bytes_moved.labels(kind, name).inc(phase.bytes)

    def serve(self, listen: str) -> tuple[str, int]:
        """Serve the text format on ``listen`` (``host:port``, ``[v6]:port`` or ``port`` for loopback);
        returns the bound address. Raises OSError if the address is taken."""
        host, port = parse_listen(listen)
        _BoundedServer.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = make_server(host, port, make_wsgi_app(self.registry), _BoundedServer, _TimedHandler)
        threading.Thread(target=self._server.serve_forever, name="gpusnap-metrics", daemon=True).start()
        bound_host, bound_port = self._server.server_address[:2]
        return str(bound_host), int(bound_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _DeadlineReader(io.RawIOBase):
    """The connection's reading side, every read bounded by what is left of one deadline."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the scrape's request did not arrive in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(buf)


class _TimedHandler(_SilentHandler):
    """The request must arrive within ``SCRAPE_READ_TIMEOUT_S`` of the accept, however it trickles in, and the
    answer goes out within ``SCRAPE_TOTAL_S`` of it (a scraper that does not read it is cut off)."""

    timeout = SCRAPE_READ_TIMEOUT_S  # StreamRequestHandler sets it on the connection before reading

    def setup(self) -> None:
        super().setup()
        start = time.monotonic()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, start + SCRAPE_READ_TIMEOUT_S))
        self._total = start + SCRAPE_TOTAL_S

    def parse_request(self) -> bool:
        ok = bool(super().parse_request())  # the request line and headers are in: the answer's time begins
        self.connection.settimeout(max(self._total - time.monotonic(), 0.001))
        return ok

    def handle(self) -> None:
        try:
            super().handle()
        except (TimeoutError, OSError):  # the deadline passed, or the scraper went away: the connection closes
            pass

    def finish(self) -> None:
        self.connection.settimeout(max(self._total - time.monotonic(), 0.001))
        try:
            super().finish()
        except OSError:
            pass


class _BoundedServer(ThreadingWSGIServer):
    """prometheus-client's thread-per-request server, with at most ``MAX_SCRAPE_CONNECTIONS`` threads."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._slots = threading.BoundedSemaphore(MAX_SCRAPE_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self._slots.acquire(blocking=False)  # False: socketserver closes the connection

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
