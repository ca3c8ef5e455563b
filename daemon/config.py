"""gpusnapd configuration: defaults < TOML file < ``GPUSNAP_*`` environment < command-line flags."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpusnap.daemon.api.errors import InvalidArgumentError
from gpusnap.daemon.api.types import Policy
from gpusnap.daemon.defaults import DEFAULT_SOCKET, DEFAULT_STORE

__all__ = ["DEFAULT_SOCKET", "DEFAULT_STORE", "DaemonConfig", "ParkConfig", "parse_listen"]
DEFAULT_METRICS_HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class ParkConfig:
    """The node's ``[park]`` section: default policy, budgets (bytes; 0: none) and the ladder's pace."""

    keep_warm: int = 0
    priority: int = 0
    standby_idle_s: float = 3600.0
    standby_ram_bytes: int = 0
    """Host memory all standbys together may hold (their resident memory measured live, their inits included;
    reservations of standbys being made included). 0: none (``DaemonConfig.park`` fills in its default)."""
    gpu_bytes: int = 0
    """GPU memory the trees gpusnapd restored or activated may hold together (as captured: CUDA state plus
    buffers; reservations of restores in flight included). 0: none."""
    interval_s: float = 30.0
    """Seconds between two passes of the ladder (it also runs after every operation)."""

    @property
    def defaults(self) -> Policy:
        return Policy(self.keep_warm, self.priority, self.standby_idle_s)


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    """Every setting of gpusnapd. Times are seconds."""

    socket: Path = DEFAULT_SOCKET
    """Unix socket of the gRPC API (mode 0660, group ``socket_group``)."""
    store: Path = DEFAULT_STORE
    """Snapshot store directory."""
    buffer_dir: str = ""
    """Buffer store (workers' named buffers, e.g. weights, shared by snapshots); empty = ``<store>/buffers``.
    A tmpfs here is a RAM tier: restores read weights from memory, but they do not survive a reboot."""
    ram_tier_bytes: int = 0
    """Budget of the RAM tier (``buffer_dir``), bytes; 0 = none. Over it, least recently used buffers that
    no operation uses move to the disk tier (``<store>/buffers``)."""
    disk_tier_bytes: int = 0
    """Budget of the disk tier (``<store>/buffers``), bytes; 0 = none. A capture whose buffers exceed every
    tier's budget is refused."""
    socket_group: str = "gpusnap"
    """Group that may use the socket; ignored when it does not exist."""
    listen: str = ""
    """Optional TCP ``host:port``; requires ``tls_cert`` and ``tls_key``."""
    metrics_listen: str = ""
    """Prometheus metrics on ``IP:PORT`` (a bare port means 127.0.0.1); empty = off. The page shows
    operation counts, phase timings and store use to whoever reaches it: keep it on loopback or a trusted
    network."""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    """When set, TCP clients must present a certificate signed by this CA (mutual TLS)."""
    tls_client_identities: str = ""
    """Rights of mutual-TLS clients: ``CN:UID`` pairs, comma-separated (``orchestrator:0`` acts as root,
    ``ci:1000`` as uid 1000). A certificate whose common name is not listed has no rights (anonymous)."""
    criu_binary: str = "criu"
    """``criu`` executable; ``gpusnap-install-criu`` installs one as ``/opt/gpusnap/criu/bin/criu`` (``make criu``:
    ``.criu/bin/criu`` in a checkout)."""
    pycriu_path: str = ""
    """Directory holding the ``pycriu`` package when it is not importable already."""
    checkpoint_timeout: float = 900.0
    restore_timeout: float = 900.0
    page_fill_threads: int = 0
    """Threads that fill a restored tree's private memory (``daemon/drivers/pagefill.py``: CRIU's lazy-pages protocol,
    served at once by gpusnap, before any restored task runs); 0 = one per CPU gpusnapd may run on, at most 8;
    -1 = off (each restored task reads its own pages, as plain CRIU does). Off, too, where the kernel has no
    ``userfaultfd`` with the events CRIU needs: gpusnapd says so at start and in ``gpusnap node``."""
    freeze_timeout: int = 10
    """Bound on CRIU freezing the tree (CRIU ``--timeout``)."""
    gpu_lock_timeout: float = 10.0
    """Bound on ``cuCheckpointProcessLock`` per process."""
    gpu_call_timeout: float = 600.0
    """Bound on any other CUDA checkpoint driver call."""
    host_memory_bytes: int = 0
    """Host RAM the GPU preflight may count on, bytes; 0 = MemAvailable. Set it on VMs whose memory
    grows on use (MemAvailable then understates what a checkpoint can stage)."""
    agent_socket: Path = Path("/run/gpusnap/agent.sock")
    """Where worker agents connect (mode 0666); workers find it through GPUSNAP_AGENT_SOCKET. Unset, it is
    ``agent.sock`` beside ``socket``."""
    agent_wait: float = 15.0
    """How long a capture waits for each engine process that an agent names (vLLM's front end names its
    EngineCore and Workers) to attach an agent of its own; they attach from background threads, so one
    just started may not have yet. Past it the capture is refused (``AGENT_MISSING``)."""
    warmup_timeout: float = 600.0
    quiesce_timeout: float = 300.0
    resume_timeout: float = 600.0
    """Bound on a restored worker reconnecting, resuming and answering its canary."""
    ready_timeout: float = 600.0
    """Bound on a control-directory worker writing ready-for-snapshot."""
    max_operations: int = 8
    """Operations doing work at once (waiting phases, such as wait-ready or an agent's warm-up, hold no slot)."""
    max_operations_per_caller: int = 16
    """Operations one uid may have running (waiting ones included); root's too."""
    max_running_operations: int = 256
    """Operations the daemon keeps running at once, waiting ones included (one thread each)."""
    max_calls_per_caller: int = 4
    """Unary RPCs of one uid running at once on the server's 32 threads; more wait, without a thread."""
    max_streams_per_caller: int = 64
    """WaitOperation/WatchOperation streams one uid may hold open (they hold no thread)."""
    max_connections_per_caller: int = 128
    """Connections to the API socket one non-root uid may hold open (three descriptors each); 0: no bound."""
    max_trees_per_caller: int = 32
    """Restored trees and standbys (each with a namespace init of root's) one non-root uid may hold at once,
    counted live when a restore or standby starts (``operations.tree_bounds``); 0: no bound."""
    max_tree_memory_per_caller: int = 0
    """Host memory those trees of one non-root uid may hold together, measured live (resident, their inits
    included), bytes; 0: a quarter of the host's physical memory."""
    max_policies_per_caller: int = 64
    """Park rules one non-root uid may hold (the node's 1024 are shared by all; root's are not counted there)."""
    remote: str = ""
    """Remote store for push and pull, ``s3://BUCKET/PREFIX``; empty = none. Credentials come from the AWS
    SDK's chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance roles)."""
    remote_endpoint: str = ""
    """S3 service URL (e.g. a Ceph RADOS Gateway, ``https://rgw.example:7480``); empty = AWS."""
    remote_ca_bundle: str = ""
    """PEM file of CAs trusted for ``remote_endpoint``; empty = the SDK's default (``AWS_CA_BUNDLE``)."""
    remote_threads: int = 8
    """Chunks (16 MiB each) moved at once by one push or pull."""
    remote_memory_bytes: int = 256 << 20
    """Bound on the chunk bytes one push or pull holds in memory; limits ``remote_threads`` (at least one chunk)."""
    remote_gc_grace: float = 3600.0
    """Unreferenced remote chunks younger than this (seconds) are kept: a push in flight uploads chunks
    before its manifest. Must exceed the longest push."""
    pull_grace: float = 86400.0
    """What an unfinished pull (a killed daemon, a failed transfer) wrote is kept this long after its last
    write for a retry to resume, then removed (at start and whenever a pull starts); never listed."""
    gpu_prefill: str = "off"
    """``off`` or ``auto``: at restore, gpusnapd creates and fills the device memory of a worker's
    address-stable arenas itself while CRIU restores the worker, and hands it over (``docs/performance.md``,
    "Device memory filled by gpusnapd"); ``auto`` uses it where the start-time probe passes. It costs a CUDA
    context in gpusnapd (about 520 MiB of device memory on each GPU it fills)."""
    park_keep_warm: int = 0
    """``[park] keep_warm``: standbys the park ladder keeps ready per snapshot unless a policy says otherwise
    (``docs/standby.md``)."""
    park_priority: int = 0
    """``[park] priority``: the default priority; budgets take from the lowest first."""
    park_standby_idle_s: float = 3600.0
    """``[park] standby_idle_s``: a standby beyond keep_warm unused this long is dropped; 0: never."""
    park_standby_ram_bytes: int = 0
    """``[park] standby_ram_bytes``: host memory all standbys may hold together (measured live), bytes; 0: half
    of the host's physical memory."""
    park_gpu_bytes: int = 0
    """``[park] gpu_bytes``: GPU memory the trees gpusnapd restored may hold together, bytes; 0: no budget."""
    park_interval_s: float = 30.0
    """``[park] interval_s``: seconds between two passes of the park ladder (it also runs after operations)."""
    log_format: str = "auto"
    """``auto`` (JSON unless stderr is a terminal), ``json`` or ``console``."""
    log_level: str = "info"

    @classmethod
    def load(
        cls,
        file: Path | None = None,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> DaemonConfig:
        """Build a config from a TOML file, ``GPUSNAP_<FIELD>`` variables and explicit overrides.

        Raises:
            InvalidArgumentError: unknown keys, unreadable file, values of the wrong type.
        """
        values: dict[str, Any] = {}
        if file is not None:
            try:
                doc = tomllib.loads(file.read_text())
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise InvalidArgumentError(f"cannot read config file {file}: {exc}", reason="BAD_CONFIG") from exc
            top = doc.get("gpusnapd", doc)
            park = top.get("park", doc.get("park"))
            values.update({k: v for k, v in top.items() if k != "park"})
            if isinstance(park, dict):  # the [park] section: park_<key>
                values.update({f"park_{k}": v for k, v in park.items()})
        env = os.environ if env is None else env
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in fields:
            key = f"GPUSNAP_{name.upper()}"
            if key in env:
                values[name] = env[key]
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        if "socket" in values and "agent_socket" not in values:  # the agent socket goes beside the API socket
            values["agent_socket"] = Path(values["socket"]).parent / "agent.sock"
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise InvalidArgumentError(f"unknown config keys: {', '.join(unknown)}", reason="BAD_CONFIG")
        return cls(**{k: _coerce(k, fields[k].type, v) for k, v in values.items()})

    def validate(self) -> None:
        """Raise InvalidArgumentError for inconsistent settings (the remote store's URL is its backend's to
        check: ``gpusnap.daemon.server.check_config`` checks both)."""
        if self.listen and not (self.tls_cert and self.tls_key):
            raise InvalidArgumentError(
                "--listen needs TLS: set tls_cert and tls_key (and tls_client_ca for mutual TLS)", reason="BAD_CONFIG"
            )
        if self.metrics_listen:
            parse_listen(self.metrics_listen)
        if self.remote_endpoint and not self.remote_endpoint.startswith(("http://", "https://")):
            raise InvalidArgumentError(
                f"remote_endpoint must be an http:// or https:// URL, not {self.remote_endpoint!r}", reason="BAD_CONFIG"
            )
        if self.agent_wait < 0:
            raise InvalidArgumentError(f"agent_wait must not be negative, not {self.agent_wait:g}", reason="BAD_CONFIG")
        if self.remote_threads < 1 or self.remote_memory_bytes < 1 or self.remote_gc_grace < 0 or self.pull_grace < 0:
            raise InvalidArgumentError(
                "remote_threads and remote_memory_bytes must be positive, remote_gc_grace and pull_grace not negative",
                reason="BAD_CONFIG",
            )
        self.client_identities()
        if self.page_fill_threads < -1:
            raise InvalidArgumentError(
                f"page_fill_threads must be -1 (off), 0 (one per CPU) or a count, not {self.page_fill_threads}",
                reason="BAD_CONFIG",
            )
        if self.gpu_prefill not in ("off", "auto"):
            raise InvalidArgumentError(
                f"gpu_prefill must be off or auto, not {self.gpu_prefill!r}", reason="BAD_CONFIG"
            )
        if min(self.park_keep_warm, self.park_standby_idle_s, self.park_standby_ram_bytes, self.park_gpu_bytes) < 0 or (
            self.park_interval_s <= 0
        ):
            raise InvalidArgumentError(
                "[park] keep_warm, standby_idle_s, standby_ram_bytes and gpu_bytes must not be negative, interval_s "
                "must be positive",
                reason="BAD_CONFIG",
            )
        if min(self.max_trees_per_caller, self.max_tree_memory_per_caller, self.max_policies_per_caller) < 0:
            raise InvalidArgumentError(
                "max_trees_per_caller, max_tree_memory_per_caller and max_policies_per_caller must not be negative",
                reason="BAD_CONFIG",
            )
        if self.log_format not in ("auto", "json", "console"):
            raise InvalidArgumentError(
                f"log_format must be auto, json or console, not {self.log_format!r}", reason="BAD_CONFIG"
            )

    def tree_memory_per_caller(self) -> int:
        """``max_tree_memory_per_caller``, its default (a quarter of the host's memory) filled in."""
        return self.max_tree_memory_per_caller or physical_memory() // 4

    def park(self) -> ParkConfig:
        """The ``[park]`` section (``standby_ram_bytes``' default, half of the host's memory, filled in)."""
        return ParkConfig(
            keep_warm=self.park_keep_warm,
            priority=self.park_priority,
            standby_idle_s=self.park_standby_idle_s,
            standby_ram_bytes=self.park_standby_ram_bytes or physical_memory() // 2,
            gpu_bytes=self.park_gpu_bytes,
            interval_s=self.park_interval_s,
        )

    def client_identities(self) -> dict[str, int]:
        """``tls_client_identities`` as common name -> uid.

        Raises:
            InvalidArgumentError: a malformed pair (reason ``BAD_CONFIG``).
        """
        out: dict[str, int] = {}
        for pair in (p.strip() for p in self.tls_client_identities.split(",") if p.strip()):
            cn, sep, uid = pair.rpartition(":")
            if not sep or not cn or not uid.isdigit():
                raise InvalidArgumentError(
                    f"tls_client_identities: {pair!r} is not CN:UID (e.g. orchestrator:0)", reason="BAD_CONFIG"
                )
            out[cn] = int(uid)
        return out


def _coerce(name: str, typ: Any, value: Any) -> Any:
    try:
        if typ in ("Path", Path):
            return Path(value)
        if typ in ("float", float):
            return float(value)
        if typ in ("int", int):
            return int(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"config {name}: {value!r} is not a valid {typ}", reason="BAD_CONFIG") from exc


def physical_memory() -> int:
    """The host's physical memory, bytes (``sysconf``)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, ``:port`` or ``port`` (the last two on loopback) as (host, port).

    Raises:
        InvalidArgumentError: reason ``BAD_CONFIG``.
    """
    host, sep, port = listen.rpartition(":")
    if not sep:
        host, port = "", listen
    host = host.strip("[]") or DEFAULT_METRICS_HOST
    try:
        ipaddress.ip_address(host)
        number = int(port)
        if not 0 <= number <= 65535:
            raise ValueError(port)
    except ValueError as exc:
        raise InvalidArgumentError(
            f"metrics_listen {listen!r} is not IP:PORT (e.g. 127.0.0.1:9464; a bare port means loopback)",
            reason="BAD_CONFIG",
        ) from exc
    return host, number
