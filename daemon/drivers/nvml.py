"""NVML (``libnvidia-ml.so.1``) through ``pynvml`` (PyPI ``nvidia-ml-py``): the node's GPUs and who uses them.

:class:`NvmlDriver` initialises NVML lazily, once, under a lock; it reports "unavailable, because …" instead of
raising when the host has no NVIDIA driver, so ``gpusnapd`` still starts on CPU-only nodes. Facts come back as
:class:`GpuDevice` values whose fields match ``gpusnap.v1.GpuInfo`` one to one.

pynvml facts relied on (nvidia-ml-py 13.x): ``nvmlInit`` raises ``NVMLError_LibraryNotFound`` without
``libnvidia-ml``; string getters (``nvmlSystemGetDriverVersion``, ``nvmlDeviceGetUUID``, ``nvmlDeviceGetName``)
return ``str``; ``nvmlSystemGetCudaDriverVersion_v2`` returns ``1000*major + 10*minor``;
``nvmlDeviceGetMigMode`` returns ``[current, pending]`` and raises ``NVMLError_NotSupported`` on GPUs without MIG;
``nvmlDeviceGetPciInfo(h).busId`` may be ``bytes``; ``nvmlDeviceGetComputeRunningProcesses`` entries have ``.pid``
and ``.usedGpuMemory`` (``None`` when not available).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpusnap.daemon.api.errors import DeadlineExceededError, FailedPreconditionError, InternalError, UnavailableError
from gpusnap.daemon.drivers.deadline import call_with_deadline

CALL_TIMEOUT_S = 30.0
"""Bound on one public NVML query (all the library calls it makes); NVML answers in milliseconds."""


@dataclass(frozen=True)
class GpuDevice:
    """One NVIDIA GPU of the node, as NVML saw it at one moment (``gpusnap.v1.GpuInfo``).

    Attributes:
        index: NVML index (``nvidia-smi`` order; not necessarily ``CUDA_VISIBLE_DEVICES`` order).
        uuid: ``"GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"``.
        name: product name, e.g. ``"NVIDIA H200"``; restore needs the same chip type (FC-08).
        memory_total_bytes: framebuffer size in bytes.
        memory_free_bytes: free framebuffer in bytes.
        persistence_mode: ``nvidia-persistenced``/persistence mode on.
        mig_mode: MIG currently enabled (unsupported by CUDA checkpoint, FC-14).
        pci_bus_id: e.g. ``"00000000:19:00.0"``.
        processes: compute processes ``((pid, used_memory_bytes), …)``; PIDs as NVML reports them (the
            daemon's PID namespace when it runs on the host); ``used_memory_bytes`` 0 when NVML cannot tell.
    """

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    persistence_mode: bool
    mig_mode: bool
    pci_bus_id: str
    processes: tuple[tuple[int, int], ...] = ()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlDriver:
    """Read-only NVML facts. Thread-safe; NVML is initialised on first use and shut down by :meth:`close`.

    Args:
        nvml: the ``pynvml`` module, or a fake with the same functions (tests); default imports ``pynvml``.
        retry_interval_s: after a failed ``nvmlInit``, how long to report the cached failure before trying
            again (the driver may be loaded after gpusnapd starts).
        clock: monotonic clock in seconds (tests).
        call_timeout_s: bound on ``nvmlInit`` and on each public query (:func:`call_with_deadline`); a hung
            NVML raises ``UnavailableError`` (reason ``NVML_TIMEOUT``).
    """

    def __init__(
        self,
        nvml: Any | None = None,
        *,
        retry_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self._nvml = nvml
        self._call_timeout_s = call_timeout_s
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self._lock = threading.RLock()
        self._initialized = False
        self._reason: str | None = None
        self._failed_at: float | None = None

    # -- availability ----------------------------------------------------------------------------------

    def available(self) -> bool:
        """Whether NVML can be used; initialises it on first call.

        Returns:
            ``True`` once ``nvmlInit`` has succeeded; ``False`` otherwise, with :attr:`unavailable_reason` saying
            why (e.g. ``libnvidia-ml.so.1`` not found). Never raises.
        """
        with self._lock:
            if self._initialized:
                return True
            if self._failed_at is not None and self._clock() - self._failed_at < self._retry_interval_s:
                return False
            try:
                nvml = self._module()
                call_with_deadline(nvml.nvmlInit, timeout_s=self._call_timeout_s, what="nvmlInit")
            except Exception as exc:  # noqa: BLE001 - turned into a reason
                self._reason = self._describe_init_failure(exc)
                self._failed_at = self._clock()
                return False
            self._initialized = True
            self._reason = None
            self._failed_at = None
            return True

    @property
    def unavailable_reason(self) -> str | None:
        """Why the last :meth:`available` returned ``False``; ``None`` when NVML works or was never tried."""
        return self._reason

    def close(self) -> None:
        """``nvmlShutdown`` if NVML was initialised; later calls initialise it again."""
        with self._lock:
            if self._initialized:
                self._initialized = False
                try:
                    self._module().nvmlShutdown()
                except Exception:  # noqa: BLE001 - shutting down anyway
                    pass

    # -- facts -------------------------------------------------------------------------------------------

    def driver_version(self) -> str:
        """NVIDIA display driver version.

        Returns:
            e.g. ``"580.159.04"``.

        Raises:
            FailedPreconditionError: NVML unavailable (reason ``NVML_UNAVAILABLE``).
            UnavailableError / InternalError: the NVML call failed.
        """
        nvml = self._ready()
        name = "nvmlSystemGetDriverVersion"
        return _text(self._bounded(name, lambda: self._call(name, nvml.nvmlSystemGetDriverVersion)))

    def cuda_driver_version(self) -> str:
        """Newest CUDA version the driver supports.

        Returns:
            ``"major.minor"``, e.g. ``"13.0"`` (from ``nvmlSystemGetCudaDriverVersion_v2`` = 13000).

        Raises:
            FailedPreconditionError: NVML unavailable.
            UnavailableError / InternalError: the NVML call failed.
        """
        nvml = self._ready()
        name = "nvmlSystemGetCudaDriverVersion_v2"
        value = int(self._bounded(name, lambda: self._call(name, nvml.nvmlSystemGetCudaDriverVersion_v2)))
        return f"{value // 1000}.{(value % 1000) // 10}"

    def gpus(self) -> list[GpuDevice]:
        """Every GPU of the node with memory, modes and compute processes.

        Returns:
            One :class:`GpuDevice` per NVML index, in index order; empty on a driver without GPUs.

        Raises:
            FailedPreconditionError: NVML unavailable.
            UnavailableError: a GPU fell off the bus or NVML is not ready (reason = the NVML error class).
            InternalError: any other NVML failure; the message names the call and GPU index.
        """
        nvml = self._ready()

        def query() -> list[GpuDevice]:
            with self._lock:
                count = int(self._call("nvmlDeviceGetCount", nvml.nvmlDeviceGetCount))
                return [self._device(nvml, index) for index in range(count)]

        devices: list[GpuDevice] = self._bounded("the GPU query", query)
        return devices

    def processes_by_pid(self) -> dict[int, list[tuple[str, int]]]:
        """Compute processes across all GPUs, grouped by PID.

        Returns:
            ``{pid: [(gpu_uuid, used_memory_bytes), …]}``; a multi-GPU process appears once with several
            entries. Checkpointed processes hold no GPU memory and are absent.

        Raises:
            As :meth:`gpus`.
        """
        by_pid: dict[int, list[tuple[str, int]]] = {}
        for gpu in self.gpus():
            for pid, used in gpu.processes:
                by_pid.setdefault(pid, []).append((gpu.uuid, used))
        return by_pid

    # -- helpers -------------------------------------------------------------------------------------------

    def _module(self) -> Any:
        if self._nvml is None:
            import pynvml

            self._nvml = pynvml
        return self._nvml

    def _ready(self) -> Any:
        if not self.available():
            raise FailedPreconditionError(
                f"NVML is unavailable: {self._reason}",
                reason="NVML_UNAVAILABLE",
                metadata={"detail": self._reason or ""},
            )
        return self._module()

    def _describe_init_failure(self, exc: Exception) -> str:
        kind = type(exc).__name__
        if kind == "NVMLError_LibraryNotFound" or isinstance(exc, (ImportError, OSError)):
            return (
                f"libnvidia-ml.so.1 not found ({exc}); install the NVIDIA driver (>= 570) or run gpusnapd where it "
                "is visible"
            )
        if kind == "NVMLError_DriverNotLoaded":
            return f"the NVIDIA kernel module is not loaded ({exc}); load it (modprobe nvidia) or check dmesg"
        if kind == "NVMLError_NoPermission":
            return f"no permission to open the NVIDIA devices ({exc}); run gpusnapd as root"
        return f"nvmlInit failed: {kind}: {exc}"

    def _bounded(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` (which may make several NVML calls through :meth:`_call`) within ``call_timeout_s``."""
        try:
            return call_with_deadline(fn, timeout_s=self._call_timeout_s, what=what)
        except DeadlineExceededError as exc:
            raise UnavailableError(
                f"NVML did not answer {what} within {self._call_timeout_s:g} s; the driver may be hung: check "
                "`nvidia-smi` and dmesg",
                reason="NVML_TIMEOUT",
                metadata={"call": what},
            ) from exc

    def _call(self, name: str, fn: Callable[..., Any], *args: Any, where: str = "") -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            kind = type(exc).__name__
            reason = kind.removeprefix("NVMLError_").upper() if kind.startswith("NVMLError") else "NVML_ERROR"
            message = f"{name}{where} failed: {kind}: {exc}"
            metadata = {"call": name}
            if kind in (
                "NVMLError_GpuIsLost",
                "NVMLError_Uninitialized",
                "NVMLError_DriverNotLoaded",
                "NVMLError_Timeout",
            ):
                raise UnavailableError(
                    message + "; check `nvidia-smi` and dmesg (a lost GPU needs a reset or reboot)",
                    reason=f"NVML_{reason}",
                    metadata=metadata,
                ) from exc
            raise InternalError(message, reason=f"NVML_{reason}", metadata=metadata) from exc

    def _device(self, nvml: Any, index: int) -> GpuDevice:
        where = f"(index={index})"
        handle = self._call("nvmlDeviceGetHandleByIndex", nvml.nvmlDeviceGetHandleByIndex, index, where=where)
        uuid = _text(self._call("nvmlDeviceGetUUID", nvml.nvmlDeviceGetUUID, handle, where=where))
        name = _text(self._call("nvmlDeviceGetName", nvml.nvmlDeviceGetName, handle, where=where))
        memory = self._call("nvmlDeviceGetMemoryInfo", nvml.nvmlDeviceGetMemoryInfo, handle, where=where)
        persistence = self._call("nvmlDeviceGetPersistenceMode", nvml.nvmlDeviceGetPersistenceMode, handle, where=where)
        try:
            current_mig, _pending = nvml.nvmlDeviceGetMigMode(handle)
            mig = int(current_mig) == int(nvml.NVML_DEVICE_MIG_ENABLE)
        except Exception as exc:  # noqa: BLE001
            if type(exc).__name__ != "NVMLError_NotSupported":  # GPUs without MIG say NotSupported
                self._call("nvmlDeviceGetMigMode", _reraise(exc), where=where)
            mig = False
        pci = self._call("nvmlDeviceGetPciInfo", nvml.nvmlDeviceGetPciInfo, handle, where=where)
        procs = self._call(
            "nvmlDeviceGetComputeRunningProcesses", nvml.nvmlDeviceGetComputeRunningProcesses, handle, where=where
        )
        return GpuDevice(
            index=index,
            uuid=uuid,
            name=name,
            memory_total_bytes=int(memory.total),
            memory_free_bytes=int(memory.free),
            persistence_mode=int(persistence) == int(nvml.NVML_FEATURE_ENABLED),
            mig_mode=mig,
            pci_bus_id=_text(pci.busId),
            processes=tuple((int(p.pid), int(p.usedGpuMemory or 0)) for p in procs),
        )


def _reraise(exc: Exception) -> Callable[[], Any]:
    def fn() -> Any:
        raise exc

    return fn
