"""The CUDA driver checkpoint API (``cuCheckpointProcess*``), called in-process through ``cuda.bindings``.

State machine (CUDA Driver API, "CUDA Checkpointing"; ``CUprocessState``)::

    RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED --restore--> LOCKED --unlock--> RUNNING
    FAILED is terminal. A lock that times out (``timeoutMs``) leaves the process RUNNING.

:class:`CudaCheckpointApi` is the seam: :class:`CudaDriver` implements it with ``cuda-bindings >= 13.3.1``
(``from cuda.bindings import driver``), the tests with a fake (``tests/fakes/cuda.py``). Ordering, deadlines and
rollback across a process tree live in :mod:`gpusnap.daemon.gpu.controller`, not here.

cuda-bindings facts this module relies on (verified by introspection of 13.5.0, pinned by
``tests/daemon/drivers/test_cuda_driver.py``):

* ``cuCheckpointProcessGetState(pid) -> (CUresult, CUprocessState)``,
  ``cuCheckpointProcessGetRestoreThreadId(pid) -> (CUresult, int)``, and
  ``cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock}(pid, args | None) -> (CUresult,)``.
* ``CUcheckpointLockArgs.timeoutMs`` (unsigned int); ``CUcheckpointCheckpointArgs`` and
  ``CUcheckpointRestoreArgs`` also carry ``customStorageInfo_out`` (13.4+, left 0 = stage in host RAM);
  ``CUcheckpointUnlockArgs`` has no public fields. Fresh structs are zeroed, as the reserved fields require.
* ``CUuuid.bytes`` is **read-only** and ``CUuuid(b"...")`` is a TypeError; a ``CUuuid`` with given bytes is
  built as ``u = CUuuid(); ctypes.memmove(u.getPtr(), raw16, 16)`` (``getPtr()`` is the address of the
  struct's own storage). Assigning it to ``CUcheckpointGpuPair.oldUuid``/``.newUuid`` **copies** the 16 bytes
  into the pair.
* Assigning a list to ``CUcheckpointRestoreArgs.gpuPairs`` copies the pairs into storage owned by the args
  struct but does **not** set ``gpuPairsCount``: it must be set explicitly.
* ``CUprocessState`` in 13.5 also has ``CHECKPOINTING = 4`` and ``RESTORING = 5``.
* Without ``libcuda.so.1`` every call raises ``cuda.pathfinder.DynamicLibNotFoundError`` (a ``RuntimeError``),
  including ``cuGetErrorName``; result names therefore come from the pure-Python ``CUresult`` enum.
"""

from __future__ import annotations

import ctypes
import enum
import re
import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from gpusnap.daemon.api.errors import Code, FailedPreconditionError, InternalError, InvalidArgumentError


class ProcessState(enum.IntEnum):
    """``CUprocessState``: where a process is in the checkpoint state machine."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3
    #: Transient states that ``CUprocessState`` gained in cuda-bindings 13.4+ (a call is in progress);
    #: the stable drivers gpusnap targets are not known to report them.
    CHECKPOINTING = 4
    RESTORING = 5


class CudaResult(enum.IntEnum):
    """The ``CUresult`` values gpusnap reasons about (values equal ``cuda.bindings.driver.CUresult``)."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_DEINITIALIZED = 4
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_OPERATING_SYSTEM = 304
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803
    CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE = 804
    CUDA_ERROR_TIMEOUT = 909
    CUDA_ERROR_UNKNOWN = 999


#: Every ``cuda.bindings.driver`` attribute :class:`CudaDriver` uses; a test asserts they all exist.
REQUIRED_BINDING_NAMES: tuple[str, ...] = (
    "cuInit",
    "cuDriverGetVersion",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessGetRestoreThreadId",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "CUcheckpointLockArgs",
    "CUcheckpointCheckpointArgs",
    "CUcheckpointRestoreArgs",
    "CUcheckpointUnlockArgs",
    "CUcheckpointGpuPair",
    "CUuuid",
    "CUresult",
    "CUprocessState",
)

#: Struct fields :class:`CudaDriver` sets or reads, per struct; a test asserts they exist.
REQUIRED_BINDING_FIELDS: dict[str, tuple[str, ...]] = {
    "CUcheckpointLockArgs": ("timeoutMs",),
    "CUcheckpointRestoreArgs": ("gpuPairs", "gpuPairsCount"),
    "CUcheckpointGpuPair": ("oldUuid", "newUuid"),
    "CUuuid": ("bytes", "getPtr"),
}

_REMEDIES: dict[int, str] = {
    CudaResult.CUDA_ERROR_NOT_SUPPORTED: (
        "the driver or platform does not support this checkpoint call: gpusnap needs an x86-64 host with "
        "NVIDIA driver >= 570 (>= 580 to remap GPUs), no MIG, no MPS, no UVM or CUDA IPC memory (FC-14, FC-15)"
    ),
    CudaResult.CUDA_ERROR_ILLEGAL_STATE: (
        "the process is not in the state this call needs (lock needs RUNNING, checkpoint LOCKED, restore "
        "CHECKPOINTED, unlock LOCKED); read its state with cuCheckpointProcessGetState before retrying"
    ),
    CudaResult.CUDA_ERROR_INVALID_VALUE: (
        "the PID is not a CUDA process visible to the daemon (or a GPU pair is wrong: the map must cover every "
        "checkpointed GPU with same-model targets, FC-08); check the PID and that gpusnapd runs in the host PID "
        "namespace"
    ),
    CudaResult.CUDA_ERROR_NOT_INITIALIZED: "cuInit(0) has not succeeded in gpusnapd; check the daemon's CUDA setup",
    CudaResult.CUDA_ERROR_NOT_READY: (
        "the lock timed out: the process still has GPU work in flight or waits on a peer rank (FC-02); quiesce "
        "the worker or raise the lock timeout; the process was left RUNNING"
    ),
    CudaResult.CUDA_ERROR_TIMEOUT: (
        "the call timed out: the process still has GPU work in flight or waits on a peer rank (FC-02); quiesce "
        "the worker or raise the lock timeout"
    ),
    CudaResult.CUDA_ERROR_NO_DEVICE: (
        "no NVIDIA GPU is visible to gpusnapd: check /dev/nvidia*, the driver, and that CUDA_VISIBLE_DEVICES "
        "does not hide GPUs from the daemon"
    ),
    CudaResult.CUDA_ERROR_OUT_OF_MEMORY: (
        "not enough GPU memory (on the target GPU for restore, or MIG slices, FC-14); free GPU memory or pick "
        "another GPU"
    ),
    CudaResult.CUDA_ERROR_OPERATING_SYSTEM: (
        "an OS call inside the driver failed (seen with multi-rank NCCL jobs, FC-01); check dmesg and the "
        "worker's topology"
    ),
    CudaResult.CUDA_ERROR_NOT_PERMITTED: "the daemon may not act on this process; run gpusnapd as root",
    CudaResult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: (
        "libcuda and the NVIDIA kernel module versions differ; reboot or reinstall the driver"
    ),
    CudaResult.CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE: (
        "a CUDA forward-compatibility libcuda is in use on an unsupported GPU; use the driver's own libcuda"
    ),
}


def result_name(result: int) -> str:
    """Name a ``CUresult`` without calling into libcuda.

    Args:
        result: a ``CUresult`` value, e.g. ``801``.

    Returns:
        e.g. ``"CUDA_ERROR_NOT_SUPPORTED"``; ``"CUresult(12345)"`` for values neither gpusnap nor the installed
        cuda-bindings know.
    """
    try:
        return CudaResult(result).name
    except ValueError:
        pass
    try:
        drv = _bindings()
        return str(drv.CUresult(result).name)
    except Exception:  # noqa: BLE001 - bindings missing or value unknown to them
        return f"CUresult({result})"


class CudaError(InternalError):
    """A ``cuCheckpoint*`` (or ``cuInit``) call returned something other than ``CUDA_SUCCESS``.

    Args:
        call: the driver function, e.g. ``"cuCheckpointProcessLock"``.
        pid: the target process, or ``None`` for calls without one (``cuInit``).
        result: the ``CUresult`` value, e.g. ``401``.
        detail: optional extra context appended to the message.

    Attributes:
        call: as above.
        pid: as above.
        result: the ``CUresult`` as a plain int.
        result_name: e.g. ``"CUDA_ERROR_ILLEGAL_STATE"``; also the error's ``reason``.
        remedy: what to do about it, or ``""`` when gpusnap has no advice for that result.
    """

    def __init__(self, call: str, pid: int | None, result: int, *, detail: str = "") -> None:
        self.call = call
        self.pid = pid
        self.result = int(result)
        self.result_name = result_name(self.result)
        self.remedy = _REMEDIES.get(self.result, "")
        target = f"(pid={pid})" if pid is not None else "()"
        message = f"{call}{target} failed with {self.result_name} ({self.result})"
        if detail:
            message += f": {detail}"
        if self.remedy:
            message += f"; {self.remedy}"
        metadata = {"call": call, "result": str(self.result), "result_name": self.result_name}
        if pid is not None:
            metadata["pid"] = str(pid)
        super().__init__(message, reason=self.result_name, metadata=metadata)
        self.code = _CODES.get(self.result, Code.INTERNAL)


_CODES: dict[int, Code] = {
    CudaResult.CUDA_ERROR_TIMEOUT: Code.DEADLINE_EXCEEDED,  # e.g. cuCheckpointProcessLock's timeoutMs ran out
    CudaResult.CUDA_ERROR_NOT_READY: Code.UNAVAILABLE,
    CudaResult.CUDA_ERROR_ILLEGAL_STATE: Code.FAILED_PRECONDITION,
    CudaResult.CUDA_ERROR_NOT_SUPPORTED: Code.FAILED_PRECONDITION,
    CudaResult.CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE: Code.FAILED_PRECONDITION,
    CudaResult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: Code.FAILED_PRECONDITION,
    CudaResult.CUDA_ERROR_NOT_INITIALIZED: Code.FAILED_PRECONDITION,
    CudaResult.CUDA_ERROR_DEINITIALIZED: Code.FAILED_PRECONDITION,
    CudaResult.CUDA_ERROR_NO_DEVICE: Code.FAILED_PRECONDITION,
    CudaResult.CUDA_ERROR_INVALID_DEVICE: Code.FAILED_PRECONDITION,
    CudaResult.CUDA_ERROR_NOT_PERMITTED: Code.FAILED_PRECONDITION,
    CudaResult.CUDA_ERROR_OUT_OF_MEMORY: Code.RESOURCE_EXHAUSTED,
}
"""gRPC code of each CUresult a client can act on; the rest (INVALID_VALUE: gpusnap's bug, UNKNOWN,
OPERATING_SYSTEM) stay INTERNAL."""


@runtime_checkable
class CudaCheckpointApi(Protocol):
    """One method per ``cuCheckpointProcess*`` call; each acts on a process *other* than the caller.

    Every method raises :class:`CudaError` when the driver returns an error result, and may raise
    :class:`~gpusnap.daemon.api.errors.FailedPreconditionError` when no CUDA driver is usable at all.
    Implementations are blocking and may hang inside the driver (FC-03): callers bound them with
    :func:`~gpusnap.daemon.drivers.deadline.call_with_deadline`.
    """

    def get_state(self, pid: int) -> ProcessState:
        """``cuCheckpointProcessGetState``: the process's current state."""
        ...

    def get_restore_thread_id(self, pid: int) -> int:
        """``cuCheckpointProcessGetRestoreThreadId``: TID of its CUDA restore thread (proves it uses CUDA)."""
        ...

    def lock(self, pid: int, timeout_ms: int) -> None:
        """``cuCheckpointProcessLock``: RUNNING → LOCKED; ``timeout_ms`` 0 = no driver-side timeout."""
        ...

    def checkpoint(self, pid: int) -> None:
        """``cuCheckpointProcessCheckpoint``: LOCKED → CHECKPOINTED (GPU memory staged into host RAM)."""
        ...

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        """``cuCheckpointProcessRestore``: CHECKPOINTED → LOCKED, optionally onto other GPUs.

        ``gpu_pairs`` are ``(old_uuid, new_uuid)`` strings ``"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"``;
        empty = restore onto the original GPUs. Non-empty lists must cover every checkpointed GPU (FC-08).
        """
        ...

    def unlock(self, pid: int) -> None:
        """``cuCheckpointProcessUnlock``: LOCKED → RUNNING."""
        ...


# ---------------------------------------------------------------------------------------------- GPU UUIDs

_UUID_RE = re.compile(
    r"^(?:GPU-)?([0-9a-f]{8})-?([0-9a-f]{4})-?([0-9a-f]{4})-?([0-9a-f]{4})-?([0-9a-f]{12})$", re.IGNORECASE
)


def parse_gpu_uuid(text: str) -> bytes:
    """Parse an NVML-style GPU UUID into the 16 bytes of a ``CUuuid``.

    NVML and ``nvidia-smi`` print ``cuDeviceGetUuid``'s 16 bytes in order as
    ``GPU-`` + 8-4-4-4-12 lowercase hex. Accepted here: that form in any case, with or without the ``GPU-``
    prefix and dashes, surrounded by whitespace.

    Args:
        text: e.g. ``"GPU-5d0f3b7c-1a2b-3c4d-5e6f-0123456789ab"``.

    Returns:
        16 bytes, e.g. ``bytes.fromhex("5d0f3b7c1a2b3c4d5e6f0123456789ab")``.

    Raises:
        InvalidArgumentError: not a GPU UUID (reason ``INVALID_GPU_UUID``); MIG UUIDs (``MIG-…``) are refused
            because MIG is unsupported (FC-14).
    """
    stripped = text.strip()
    if stripped.upper().startswith("MIG-"):
        raise InvalidArgumentError(
            f"{stripped!r} is a MIG instance UUID; CUDA checkpoint does not support MIG (FC-14): disable MIG mode "
            "and use the GPU's UUID (GPU-…)",
            reason="INVALID_GPU_UUID",
            metadata={"uuid": stripped},
        )
    match = _UUID_RE.match(stripped)
    if match is None:
        raise InvalidArgumentError(
            f"{text!r} is not a GPU UUID; expected the NVML form GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx "
            "(see `nvidia-smi -L`)",
            reason="INVALID_GPU_UUID",
            metadata={"uuid": text},
        )
    return bytes.fromhex("".join(match.groups()))


def format_gpu_uuid(raw: bytes) -> str:
    """Format 16 ``CUuuid`` bytes the way NVML does.

    Args:
        raw: exactly 16 bytes.

    Returns:
        ``"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"`` (lowercase).

    Raises:
        InvalidArgumentError: ``raw`` is not 16 bytes long.
    """
    if len(raw) != 16:
        raise InvalidArgumentError(
            f"a GPU UUID has 16 bytes, got {len(raw)}", reason="INVALID_GPU_UUID", metadata={"length": str(len(raw))}
        )
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def normalize_gpu_uuid(text: str) -> str:
    """Canonical form of a GPU UUID string (``GPU-`` + lowercase 8-4-4-4-12), for comparisons.

    Raises:
        InvalidArgumentError: as :func:`parse_gpu_uuid`.
    """
    return format_gpu_uuid(parse_gpu_uuid(text))


def uuid_to_cuuuid(text: str) -> Any:
    """Build a ``cuda.bindings.driver.CUuuid`` holding the UUID ``text``.

    ``CUuuid.bytes`` cannot be assigned in cuda-bindings 13.x (``AttributeError: attribute 'bytes' of
    'cuda.bindings.driver.CUuuid_st' objects is not writable``). A fresh ``CUuuid()`` owns its 16 bytes and
    ``getPtr()`` returns their address, so the bytes are written there with ``ctypes.memmove``. (The other way,
    ``CUuuid(_ptr=ctypes.addressof(buf))``, makes a *view* that dangles once ``buf`` is freed.) Assigning the
    result to ``CUcheckpointGpuPair.oldUuid``/``.newUuid`` copies the bytes into the pair.

    Args:
        text: an NVML-style GPU UUID (see :func:`parse_gpu_uuid`).

    Returns:
        A ``CUuuid`` that owns its memory, whose ``.bytes`` equal :func:`parse_gpu_uuid` of ``text``.

    Raises:
        InvalidArgumentError: ``text`` is not a GPU UUID.
        FailedPreconditionError: cuda-bindings is not installed.
    """
    raw = parse_gpu_uuid(text)
    drv = _bindings()
    uuid = drv.CUuuid()
    ctypes.memmove(uuid.getPtr(), raw, 16)
    return uuid


def _make_gpu_pair(drv: Any, old_uuid: str, new_uuid: str) -> Any:
    pair = drv.CUcheckpointGpuPair()
    pair.oldUuid = uuid_to_cuuuid(old_uuid)
    pair.newUuid = uuid_to_cuuuid(new_uuid)
    return pair


def build_restore_args(gpu_pairs: Sequence[tuple[str, str]]) -> Any:
    """Build ``CUcheckpointRestoreArgs`` for ``gpu_pairs``.

    Args:
        gpu_pairs: ``[(old_uuid, new_uuid), …]`` GPU UUID strings; empty = restore onto the original GPUs.

    Returns:
        A zeroed ``CUcheckpointRestoreArgs`` with ``gpuPairs`` and ``gpuPairsCount`` set (both left at
        NULL/0 when ``gpu_pairs`` is empty).

    Raises:
        InvalidArgumentError: a UUID is malformed, or an old GPU appears twice.
        FailedPreconditionError: cuda-bindings is not installed.
    """
    drv = _bindings()
    args = drv.CUcheckpointRestoreArgs()
    if not gpu_pairs:
        return args
    seen: set[str] = set()
    pairs = []
    for old, new in gpu_pairs:
        key = normalize_gpu_uuid(old)
        if key in seen:
            raise InvalidArgumentError(
                f"GPU {key} appears twice as a source in the restore GPU pairs; give each checkpointed GPU once",
                reason="INVALID_GPU_MAP",
                metadata={"uuid": key},
            )
        seen.add(key)
        pairs.append(_make_gpu_pair(drv, old, new))
    args.gpuPairs = pairs
    args.gpuPairsCount = len(pairs)  # not derived from the list by the bindings
    return args


# ----------------------------------------------------------------------------------------- the driver


def _bindings() -> Any:
    """Import ``cuda.bindings.driver`` (pure import: works without a GPU or libcuda).

    Raises:
        FailedPreconditionError: cuda-bindings is not installed (reason ``CUDA_BINDINGS_MISSING``).
    """
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise FailedPreconditionError(
            f"cuda-bindings is not importable ({exc}); install cuda-bindings>=13.3.1 in gpusnapd's environment",
            reason="CUDA_BINDINGS_MISSING",
        ) from exc
    return driver


def missing_bindings() -> list[str]:
    """Names from :data:`REQUIRED_BINDING_NAMES` / :data:`REQUIRED_BINDING_FIELDS` absent from cuda.bindings.

    Returns:
        e.g. ``["CUcheckpointRestoreArgs", "CUcheckpointRestoreArgs.gpuPairsCount"]``; empty when complete
        (cuda-bindings 13.3.0 lacked ``CUcheckpointRestoreArgs``).

    Raises:
        FailedPreconditionError: cuda-bindings is not installed at all.
    """
    drv = _bindings()
    missing = [name for name in REQUIRED_BINDING_NAMES if not hasattr(drv, name)]
    for struct, fields in REQUIRED_BINDING_FIELDS.items():
        if not hasattr(drv, struct):
            continue
        instance = getattr(drv, struct)()
        missing.extend(f"{struct}.{f}" for f in fields if not hasattr(instance, f))
    return missing


# cuInit results that mean "this host cannot do CUDA", not "gpusnap has a bug".
_ENVIRONMENT_RESULTS = {
    CudaResult.CUDA_ERROR_NO_DEVICE,
    CudaResult.CUDA_ERROR_INVALID_DEVICE,
    CudaResult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
    CudaResult.CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE,
    CudaResult.CUDA_ERROR_OPERATING_SYSTEM,
    CudaResult.CUDA_ERROR_NOT_PERMITTED,
}


class CudaDriver:
    """:class:`CudaCheckpointApi` over ``cuda.bindings.driver``, in the daemon's own process.

    In-process calls cost ~0.6 ms for 17 PIDs against ~450 ms for exec'ing ``cuda-checkpoint`` (criu PR #3076).
    Construction does nothing; :meth:`init` (called lazily by every method) runs ``cuInit(0)`` once, which also
    satisfies restore's "persistence mode or cuInit" requirement. Thread-safe: calls may come from the
    deadline threads of :func:`~gpusnap.daemon.drivers.deadline.call_with_deadline`.

    Note that after :meth:`init` gpusnapd holds ``/dev/nvidiactl`` itself; it must never be part of a tree it
    checkpoints.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._initialized = False
        self._driver_version: int | None = None

    # -- lifecycle -----------------------------------------------------------------------------------

    def init(self) -> None:
        """Run ``cuInit(0)`` and ``cuDriverGetVersion`` once; later calls return at once.

        Raises:
            FailedPreconditionError: cuda-bindings missing (``CUDA_BINDINGS_MISSING``), libcuda missing
                (``CUDA_DRIVER_MISSING``), or ``cuInit`` says the host cannot run CUDA (no GPU, driver
                mismatch; reason = the ``CUresult`` name, metadata ``call``/``result``).
            CudaError: any other ``cuInit``/``cuDriverGetVersion`` failure.
        """
        with self._lock:
            if self._initialized:
                return
            drv = _bindings()
            try:
                (result,) = drv.cuInit(0)
            except RuntimeError as exc:  # cuda.pathfinder.DynamicLibNotFoundError: no libcuda.so.1
                raise FailedPreconditionError(
                    f"cannot load the CUDA driver library libcuda.so.1 ({exc}); gpusnap needs an NVIDIA driver "
                    ">= 570 on this host (>= 580 to remap GPUs)",
                    reason="CUDA_DRIVER_MISSING",
                    metadata={"call": "cuInit"},
                ) from exc
            if int(result) != CudaResult.CUDA_SUCCESS:
                err = CudaError("cuInit", None, int(result))
                if int(result) in _ENVIRONMENT_RESULTS:
                    raise FailedPreconditionError(err.message, reason=err.reason, metadata=err.metadata) from err
                raise err
            result, version = drv.cuDriverGetVersion()
            if int(result) != CudaResult.CUDA_SUCCESS:
                raise CudaError("cuDriverGetVersion", None, int(result))
            self._driver_version = int(version)
            self._initialized = True

    @property
    def driver_version(self) -> int | None:
        """CUDA version the driver supports, as ``cuDriverGetVersion`` gives it (``13000`` = 13.0).

        ``None`` until :meth:`init` has succeeded.
        """
        return self._driver_version

    @property
    def driver_version_string(self) -> str | None:
        """:attr:`driver_version` as ``"13.0"``; ``None`` before :meth:`init`."""
        v = self._driver_version
        return None if v is None else f"{v // 1000}.{(v % 1000) // 10}"

    # -- CudaCheckpointApi -----------------------------------------------------------------------------

    def get_state(self, pid: int) -> ProcessState:
        """``cuCheckpointProcessGetState(pid)``.

        Returns:
            The process's :class:`ProcessState`.

        Raises:
            CudaError: e.g. ``CUDA_ERROR_INVALID_VALUE`` for a PID that is not a CUDA process.
            InternalError: the driver reported a state this gpusnap does not know.
        """
        drv = self._ready()
        result, state = drv.cuCheckpointProcessGetState(pid)
        self._check("cuCheckpointProcessGetState", pid, result)
        try:
            return ProcessState(int(state))
        except ValueError as exc:
            raise InternalError(
                f"cuCheckpointProcessGetState(pid={pid}) returned unknown CUprocessState {int(state)}; "
                "upgrade gpusnap for this driver",
                reason="CUDA_UNKNOWN_STATE",
                metadata={"pid": str(pid), "state": str(int(state))},
            ) from exc

    def get_restore_thread_id(self, pid: int) -> int:
        """``cuCheckpointProcessGetRestoreThreadId(pid)``.

        Returns:
            The TID of the process's CUDA restore thread.

        Raises:
            CudaError: the PID is not a CUDA process (``CUDA_ERROR_INVALID_VALUE``) or similar.
        """
        drv = self._ready()
        result, tid = drv.cuCheckpointProcessGetRestoreThreadId(pid)
        self._check("cuCheckpointProcessGetRestoreThreadId", pid, result)
        return int(tid)

    def lock(self, pid: int, timeout_ms: int) -> None:
        """``cuCheckpointProcessLock(pid, {timeoutMs})``: RUNNING → LOCKED.

        Args:
            pid: target process.
            timeout_ms: driver-side timeout in milliseconds, 0 = none; on timeout the process stays RUNNING.

        Raises:
            InvalidArgumentError: ``timeout_ms`` outside ``0 … 2**32-1``.
            CudaError: e.g. ``CUDA_ERROR_ILLEGAL_STATE`` (not RUNNING), a timeout result.
        """
        if not 0 <= timeout_ms < 2**32:
            raise InvalidArgumentError(
                f"lock timeout {timeout_ms} ms is outside 0…{2**32 - 1}",
                reason="INVALID_TIMEOUT",
                metadata={"timeout_ms": str(timeout_ms)},
            )
        drv = self._ready()
        args = drv.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        (result,) = drv.cuCheckpointProcessLock(pid, args)
        self._check("cuCheckpointProcessLock", pid, result, detail=f"timeoutMs={timeout_ms}")

    def checkpoint(self, pid: int) -> None:
        """``cuCheckpointProcessCheckpoint(pid, {})``: LOCKED → CHECKPOINTED, GPU memory staged in host RAM.

        Raises:
            CudaError: e.g. ``CUDA_ERROR_NOT_SUPPORTED`` (aarch64, FC-15), ``CUDA_ERROR_OUT_OF_MEMORY`` (MIG, FC-14).
        """
        drv = self._ready()
        (result,) = drv.cuCheckpointProcessCheckpoint(pid, drv.CUcheckpointCheckpointArgs())
        self._check("cuCheckpointProcessCheckpoint", pid, result)

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        """``cuCheckpointProcessRestore(pid, {gpuPairs, gpuPairsCount})``: CHECKPOINTED → LOCKED.

        Args:
            pid: target process.
            gpu_pairs: ``[(old_uuid, new_uuid), …]``; empty = original GPUs. When non-empty it must name every
                checkpointed GPU, identity pairs included (driver rule, FC-08).

        Raises:
            InvalidArgumentError: malformed UUIDs or duplicate sources.
            CudaError: e.g. ``CUDA_ERROR_INVALID_VALUE`` for an incomplete or cross-model map (FC-08).
        """
        drv = self._ready()
        args = build_restore_args(gpu_pairs)
        (result,) = drv.cuCheckpointProcessRestore(pid, args)
        detail = ", ".join(f"{normalize_gpu_uuid(o)}->{normalize_gpu_uuid(n)}" for o, n in gpu_pairs)
        self._check("cuCheckpointProcessRestore", pid, result, detail=f"gpuPairs=[{detail}]" if detail else "")

    def unlock(self, pid: int) -> None:
        """``cuCheckpointProcessUnlock(pid, {})``: LOCKED → RUNNING.

        Raises:
            CudaError: e.g. ``CUDA_ERROR_ILLEGAL_STATE`` when the process is not LOCKED.
        """
        drv = self._ready()
        (result,) = drv.cuCheckpointProcessUnlock(pid, drv.CUcheckpointUnlockArgs())
        self._check("cuCheckpointProcessUnlock", pid, result)

    # -- helpers ---------------------------------------------------------------------------------------

    def _ready(self) -> Any:
        self.init()
        return _bindings()

    @staticmethod
    def _check(call: str, pid: int, result: Any, *, detail: str = "") -> None:
        if int(result) != CudaResult.CUDA_SUCCESS:
            raise CudaError(call, pid, int(result), detail=detail)
