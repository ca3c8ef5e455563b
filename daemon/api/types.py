"""Domain types: what a snapshot, an operation and their parts are, independent of gRPC.

Conversions to and from protobuf live in ``gpusnap.daemon.service.convert``; the JSON form of a
snapshot's manifest lives in ``gpusnap.daemon.store.manifest``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from datetime import datetime

from gpusnap.daemon.api.errors import GpusnapError, InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class ProcessFacts:
    """The process tree a snapshot was taken from."""

    pid: int
    """Root PID in the daemon's PID namespace."""
    comm: str
    cmdline: tuple[str, ...]
    uid: int
    gid: int
    tree_pids: tuple[int, ...]
    """Every PID of the tree, root first."""
    rss_bytes: int
    """Resident memory of the whole tree, bytes."""
    cwd: str
    listening: tuple[str, ...] = ()
    """TCP addresses the tree listens on, ``"ip:port"``; a restore on the host network needs them free."""


@dataclasses.dataclass(frozen=True)
class HostFacts:
    """The host a snapshot was taken on."""

    hostname: str
    kernel: str
    machine: str
    criu_version: str
    gpusnap_version: str
    cpu_model: str
    cpu_flags: tuple[str, ...]
    nvidia_driver_version: str = ""
    cuda_driver_version: str = ""


@dataclasses.dataclass(frozen=True)
class ImageFile:
    """One file of a snapshot's images; ``path`` is relative to the images directory."""

    path: str
    size_bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class PhaseTiming:
    """Duration (seconds) and bytes moved of one phase of an operation."""

    phase: str
    duration_seconds: float
    bytes: int = 0


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    """GPU use of one CUDA process at capture."""

    pid: int
    gpu_uuids: tuple[str, ...]
    gpu_memory_bytes: int
    visible_gpu_uuids: tuple[str, ...] = ()
    """Every GPU the process could see (``CUDA_VISIBLE_DEVICES``, else all of the node's): a remap must
    be a one-to-one map over all of them."""


@dataclasses.dataclass(frozen=True)
class ProcessImage:
    """What CRIU's images hold of one process: ``pid`` (as CRIU saw it: the host PID for a tree in the host's
    PID namespace) and ``image_bytes``, its memory pages (private, and shared memory it was the first to map:
    the CUDA checkpoint's host copy of a worker's device memory is such memory)."""

    pid: int
    image_bytes: int


@dataclasses.dataclass(frozen=True)
class BufferRef:
    """A worker's named buffer kept outside the images: a blob of the buffer store, by digest."""

    name: str
    size_bytes: int
    sha256: str
    """Digest of the blob (``checksum.DIGEST_ALGORITHM``), which is also its name in the buffer store."""
    agent: str = ""
    """Instance id of the agent whose process holds it (empty: the snapshot's ``worker``, as before agents)."""
    arena: int = 0
    """1-based index into its worker's ``arenas`` when it lies in an address-stable arena; 0: not."""
    arena_offset: int = 0
    """Byte offset of its storage from the arena's start."""


@dataclasses.dataclass(frozen=True)
class ArenaLayout:
    """A worker's address-stable arena (``gpusnap.adapters.vmm``), as its agent reported it at capture: what
    gpusnapd needs to create and fill its physical memory at restore (``--gpu-prefill``)."""

    gpu_uuid: str
    size_bytes: int
    granularity: int
    chunk_bytes: tuple[int, ...]
    """Sizes of its physical allocations, in address order (they sum to ``size_bytes``)."""
    storages: int
    """Storages placed in it; gpusnapd fills it only when all of them are the snapshot's buffers."""


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """How a snapshot's worker cooperates: a gpusnap agent, or the control-directory contract."""

    engine: str = ""
    instance_id: str = ""
    """The agent's instance id (empty for control-directory workers)."""
    wake_dir: str = ""
    canary_tokens: str = ""
    """Token ids of the warm-up canary at capture, comma separated; a restore must reproduce them."""
    control_dir: str = ""
    """``SNAPSHOT_CONTROL_DIR`` of a worker following Dynamo Snapshot's contract."""
    uid: int = 0
    """The agent's user (its wake file is created in a directory of that user's or root's)."""
    pid: int = 0
    """The agent's process at capture (host PID)."""
    role: str = ""
    """``frontend`` (quiesced first, resumed last, gives the canary), ``core`` or ``worker``; empty for a
    single-process worker, which counts as a front end."""
    process: str = ""
    """The process's title at capture (``VLLM::Worker``…), for messages."""
    weights: str = ""
    """Where the process's weights went, and why (``offloaded: …`` or ``in image: …``), from its adapter."""
    arenas: tuple[ArenaLayout, ...] = ()
    """Its address-stable arenas holding buffers (``BufferRef.arena`` indexes them); empty in older snapshots."""
    released_bytes: int = 0
    """Memory its quiesce freed without saving it (a KV cache), as its agent reported; 0 when none or unknown."""

    @property
    def is_front(self) -> bool:
        return self.role in ("", "frontend")


@dataclasses.dataclass(frozen=True)
class HeldFile:
    """A file a process of the tree held when it was frozen, which CRIU reopens by its path on restore
    (an open file, a mapped file, the cwd, the root or the exe): where it was and which inode it was."""

    pid: int
    """The holder (host PID at dump)."""
    what: str
    """``fd 3``, ``map 7f1c2a000000``, ``cwd``, ``root`` or ``exe``."""
    path: str
    dev: int
    ino: int
    access: int
    """What the holder needs of it: ``os.R_OK | os.W_OK | os.X_OK`` bits (0: only that it resolves)."""
    size: int = -1
    """A regular file held by an fd: its size at dump in bytes, as CRIU records it (-1: not recorded)."""
    pos: int = -1
    """A regular file held by an fd: the fd's file position at dump (-1: not recorded)."""
    flags: int = -1
    """A regular file held by an fd: its ``open(2)`` flags at dump (``fdinfo``; -1: not recorded)."""


@dataclasses.dataclass(frozen=True)
class Terminal:
    """A terminal the tree was started from whose other side (terminal emulator, sshd, tmux) stays outside
    the tree: it is left behind at dump. A restore gives each descriptor of it a file (``/dev/null`` unless
    the restore names one: CRIU's ``inherit_fd``), in a session of the restore's own."""

    path: str
    """``/dev/pts/N`` at dump."""
    key: str
    """CRIU's name of it, ``tty[<rdev>:<dev>]`` in hex: the ``inherit_fd`` key a restore replaces it by."""
    fds: tuple[str, ...] = ()
    """``"PID/FD"`` of each descriptor the tree held on it (none: only its controlling terminal)."""
    controlling: bool = False
    """The controlling terminal of the tree's session, which is led outside the tree (a shell's job)."""


@dataclasses.dataclass(frozen=True)
class Creds:
    """A process's real uid, gid and supplementary groups (``/proc/<pid>/status``)."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ProcessCreds:
    """The rights one process of a tree ran with when it was frozen, which CRIU gives it back at restore
    (``/proc/<pid>/status``): what a restore opens, binds and creates for it with (``access.tree_rights``)."""

    pid: int
    """Host PID at dump (as ``HeldFile.pid``)."""
    uid: int
    """Its filesystem uid: the one the kernel checks its opens against (0: root's rights)."""
    gid: int
    """Its filesystem gid."""
    groups: tuple[int, ...] = ()
    """Its supplementary groups."""

    @property
    def creds(self) -> Creds:
        return Creds(uid=self.uid, gid=self.gid, groups=self.groups)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A complete, published snapshot."""

    id: str
    name: str
    created: datetime
    labels: Mapping[str, str]
    source: ProcessFacts
    host: HostFacts
    files: tuple[ImageFile, ...]
    phases: tuple[PhaseTiming, ...]
    owner_uid: int
    gpu_processes: tuple[GpuProcess, ...] = ()
    worker: WorkerInfo | None = None
    buffers: tuple[BufferRef, ...] = ()
    """The named buffers (weights) of every agent, in the buffer store; reloaded into their processes on
    restore (``BufferRef.agent`` says whose)."""
    agents: tuple[WorkerInfo, ...] = ()
    """The tree's other agents (EngineCore, Workers, more front ends), beside ``worker``."""
    held_files: tuple[HeldFile, ...] = ()
    """Files reopened by path on restore; checked against the owner's rights first (``file_rights``)."""
    owner_creds: Creds | None = None
    """The root process's credentials at dump (``None`` in snapshots of older gpusnap)."""
    tree_creds: tuple[ProcessCreds, ...] = ()
    """Every process's rights at dump (empty in snapshots of older gpusnap: ``access.tree_rights`` derives
    them from ``owner_creds``). A restore acts with these, not with the rights of whoever took or restores it."""
    process_images: tuple[ProcessImage, ...] = ()
    """Bytes of the images per process (empty in snapshots of older gpusnap, or where CRIU's images could not
    be read); what they do not cover is shared memory no process was counted for, and the images' metadata."""
    terminals: tuple[Terminal, ...] = ()
    """Terminals left behind at dump (a job started from an interactive shell)."""

    @property
    def all_workers(self) -> tuple[WorkerInfo, ...]:
        """``worker`` and ``agents``."""
        return ((self.worker,) if self.worker else ()) + self.agents

    def buffers_of(self, worker: WorkerInfo) -> tuple[BufferRef, ...]:
        """The buffers that ``worker``'s process holds."""
        primary = self.worker.instance_id if self.worker else ""
        return tuple(b for b in self.buffers if (b.agent or primary) == worker.instance_id)

    @property
    def size_bytes(self) -> int:
        """Sum of the image files' sizes, bytes (the buffers are counted in :attr:`buffer_bytes`)."""
        return sum(f.size_bytes for f in self.files)

    @property
    def buffer_uid(self) -> int:
        """The user whose worker wrote the buffers (their blobs live under that uid in the buffer store)."""
        return self.worker.uid if self.worker else self.source.uid

    @property
    def buffer_bytes(self) -> int:
        """Sum of the buffers' sizes, bytes (blobs may be shared with other snapshots)."""
        return sum(b.size_bytes for b in self.buffers)


class OperationKind(enum.Enum):
    """What an operation does."""

    CHECKPOINT = "checkpoint"
    RESTORE = "restore"
    SUSPEND = "suspend"
    RESUME = "resume"
    PUSH = "push"
    PULL = "pull"
    STANDBY = "standby"
    ACTIVATE = "activate"


class OperationState(enum.Enum):
    """Where an operation is: running, or ended one way or the other."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    """Cancelled (``gpusnap cancel``, Ctrl-C) and rolled back; its error is a ``CancelledError``."""


class EventType(enum.Enum):
    """What an operation event reports (``OperationEvent.type``)."""

    PHASE_STARTED = "phase_started"
    PHASE_FINISHED = "phase_finished"
    PHASE_FAILED = "phase_failed"
    PROGRESS = "progress"
    ROLLBACK = "rollback"
    OPERATION_FINISHED = "operation_finished"
    CANCEL_REQUESTED = "cancel_requested"


@dataclasses.dataclass(frozen=True)
class FinishedOperation:
    """The end of one operation, as the operation registry publishes it once to its subscribers (the park
    ladder, the metrics, the prefill): what it was, how it ended, and its result."""

    id: str
    kind: OperationKind
    state: OperationState
    """``SUCCEEDED``, ``FAILED`` or ``CANCELLED``."""
    owner_uid: int
    target_pid: int
    target_snapshot: str
    started: datetime
    finished: datetime
    phases: tuple[PhaseTiming, ...]
    result: object = None
    """A checkpoint's or pull's :class:`Snapshot`, a restore's :class:`RestoreResult`, ...; None when it failed."""
    error: GpusnapError | None = None

    @property
    def succeeded(self) -> bool:
        return self.state is OperationState.SUCCEEDED


@dataclasses.dataclass(frozen=True)
class Policy:
    """How a snapshot's workload is kept on the park ladder (``gpusnap.daemon.park.policy``); ``None``:
    inherit."""

    keep_warm: int | None = None
    priority: int | None = None
    standby_idle_s: float | None = None

    def over(self, base: Policy) -> Policy:
        """This policy's set knobs over ``base``'s."""
        return Policy(
            keep_warm=self.keep_warm if self.keep_warm is not None else base.keep_warm,
            priority=self.priority if self.priority is not None else base.priority,
            standby_idle_s=self.standby_idle_s if self.standby_idle_s is not None else base.standby_idle_s,
        )

    def check(self) -> Policy:
        """Raises InvalidArgumentError (``INVALID_POLICY``) for out-of-range knobs; returns ``self``."""
        if self.keep_warm is not None and not 0 <= self.keep_warm <= MAX_KEEP_WARM:
            raise InvalidArgumentError(f"keep_warm must be 0 to {MAX_KEEP_WARM}", reason="INVALID_POLICY")
        if self.priority is not None and not -1000 <= self.priority <= 1000:
            raise InvalidArgumentError("priority must be -1000 to 1000", reason="INVALID_POLICY")
        if self.standby_idle_s is not None and not 0 <= self.standby_idle_s <= 365 * 86400:
            raise InvalidArgumentError("standby_idle_s must be 0 to a year (in seconds)", reason="INVALID_POLICY")
        return self


MAX_KEEP_WARM = 64
"""The most standbys one policy may keep ready."""


@dataclasses.dataclass(frozen=True)
class GpuPrefill:
    """Whether restores fill address-stable weights on the GPU (``gpu_prefill``), and how far it is."""

    enabled: bool
    reason: str | None = None
    """Why not, when not enabled."""
    gpus: int = 0
    """GPUs probed."""
    usable_gpus: int = 0
    """GPUs it can fill."""
    contexts: str | None = None
    """gpusnapd's contexts: ``creating``, ``ready`` or ``failed (why)``; ``None`` before they are asked for."""
    registered_bytes: int = 0
    """Blobs registered ahead with the GPU driver, bytes."""
    registering: bool = False
    """Registrations still queued."""

    def summary(self) -> str:
        """One line for people: ``on (1 of 1 GPUs); contexts ready; 16.0 GiB of blobs registered`` or ``off: why``."""
        if not self.enabled:
            reason = self.reason or "off"
            return reason if reason.startswith("off") else f"off: {reason}"
        parts = [f"on ({self.usable_gpus} of {self.gpus} GPUs)"]
        if self.contexts:
            parts.append(f"contexts {self.contexts}")
        if self.registered_bytes:
            parts.append(f"{self.registered_bytes / 2**30:.1f} GiB of blobs registered")
        if self.registering:
            parts.append("registering blobs")
        return "; ".join(parts)


class TcpMode(enum.Enum):
    """What a checkpoint does with established TCP connections."""

    REFUSE = "refuse"
    ESTABLISHED = "established"
    CLOSE = "close"


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """A validated checkpoint request."""

    pid: int
    name: str = ""
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    leave_running: bool = False
    tcp: TcpMode = TcpMode.REFUSE
    timeout_s: float | None = None
    gpu_lock_timeout_s: float | None = None
    control_dir: str = ""
    """Follow the control-directory contract: wait for ``ready-for-snapshot`` there before capturing."""
    quiesce: bool = True
    """Warm up and quiesce the worker through its agent when one is attached."""
    offload: bool = True
    """Keep the buffers the worker's agent names (weights) out of the images, in the buffer store."""
    dry_run: bool = False
    """Run the preflight only (every refusal a capture would meet before it touches the tree), then end."""


@dataclasses.dataclass(frozen=True)
class RestoreOptions:
    """A validated restore request."""

    snapshot: str
    host_pid_namespace: bool = False
    gpu_map: Mapping[str, str] = dataclasses.field(default_factory=dict)
    timeout_s: float | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Restore context: environment the restored worker sets before resuming."""
    unset_env: tuple[str, ...] = ()
    values: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Restore context: identity values for the worker's adapter (new port, node name…)."""
    verify_buffers: bool = False
    """Re-digest the snapshot's buffers before handing them to the worker (they were digested when
    written; see ``gpusnap.daemon.store.buffers``)."""
    private_network: bool = False
    """Restore into a fresh network namespace (loopback only): copies of one snapshot, or a copy and its
    running source, then keep their listening ports and loopback connections to themselves."""
    replicas: int = 1
    """Fan-out: copies to restore in one operation, each in its own network namespace; ``{i}`` in ``env``
    and ``values`` becomes the copy's index (from 0)."""
    terminal: str = ""
    """Absolute path of the file that stands in for the terminals the tree was started from (appended to,
    created if missing, opened as the snapshot's owner); ``""``: ``/dev/null``."""
    no_standby: bool = False
    """Restore from the images even when a ready standby of the snapshot exists (by default a restore
    activates one: ``gpusnap.daemon.operations.standby``)."""


@dataclasses.dataclass(frozen=True)
class FileCopy:
    """A file the restored tree continues writing in a copy of its own (``operations.file_copies``)."""

    path: str
    """The file the tree held at dump."""
    copy: str
    """The copy it writes instead: ``<path>.gpusnap-<operation>[-<i>]``."""
    size_bytes: int
    """Bytes copied: the file's size at dump."""


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """Where a restored tree lives: host PIDs, root first."""

    pid: int
    pids: tuple[int, ...]
    snapshot_id: str
    namespace_pid: int
    replicas: tuple[RestoreResult, ...] = ()
    """With fan-out, every copy in index order (the fields above are the first's); else empty."""
    file_copies: tuple[FileCopy, ...] = ()
    """Files this tree continues writing in a copy of its own, not where it held them (the first copy's)."""
    standby_id: str = ""
    """The standby activated instead of a restore from the images; empty: restored from the images."""
    standbys_skipped: str = ""
    """Restored from the images although the snapshot has ready standbys: why none was taken, how to take one."""


@dataclasses.dataclass(frozen=True)
class RestoredTree:
    """A restored tree running now, under the init of its PID namespace (``gpusnap.daemon.drivers.restored``)."""

    pid: int
    """Host PID of its root: what ``restore`` printed."""
    init_pid: int
    """Host PID of its PID namespace's init (``gpusnap.daemon.drivers.reaper``, comm ``gpusnap-init``)."""
    snapshot_id: str
    snapshot_name: str
    """``""`` when the snapshot has no name."""
    operation_id: str
    """The restore that made it."""
    uid: int
    """The real uid its root runs as: who may stop it (and root)."""
    started: datetime
    """When its root was restored (UTC)."""
    process_count: int


@dataclasses.dataclass(frozen=True)
class TransferResult:
    """What a push or pull moved (``gpusnap.v1.TransferResult``); bytes are chunk bytes."""

    snapshot_id: str
    remote: str
    transferred_bytes: int = 0
    skipped_bytes: int = 0
    transferred_chunks: int = 0
    skipped_chunks: int = 0
    buffer_transferred_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who asked, from the socket's peer credentials (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int
    anonymous: bool = False
    """A TCP caller without a verified client certificate: it may only read what is public (nothing)."""

    @property
    def is_root(self) -> bool:
        return self.uid == 0 and not self.anonymous


ROOT_CALLER = Caller(pid=0, uid=0, gid=0)
ANONYMOUS_CALLER = Caller(pid=0, uid=2**32 - 2, gid=2**32 - 2, anonymous=True)
"""A TCP caller without a verified client certificate: matches no user, owns nothing, may change nothing."""
