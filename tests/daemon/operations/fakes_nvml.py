"""A fake NVML for operation-level tests: the node's GPUs, and who uses them.

:class:`FakeNvml` offers what :class:`~gpusnap.daemon.gpu.support.GpuSupport` and the operations call on an
:class:`~gpusnap.daemon.drivers.nvml.NvmlDriver`: ``available()``, ``unavailable_reason``, ``driver_version()``,
``cuda_driver_version()``, ``gpus()`` and ``processes_by_pid()``. Which process holds how much memory on which GPU
comes from a ``usage`` callable (normally :meth:`ProcessCuda.usage`, so a checkpointed process disappears from
NVML and a restored one shows up on the GPU it was restored onto, as with the real driver).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.drivers.cuda import normalize_gpu_uuid
from gpusnap.daemon.drivers.nvml import GpuDevice

GIB = 1 << 30
H200 = "NVIDIA H200"
DRIVER = "580.95.05"
CUDA = "13.0"

Usage = Mapping[int, Sequence[tuple[str, int]]]


def fake_uuid(index: int) -> str:
    """A well-formed, canonical (lowercase) GPU UUID for fake GPU ``index``."""
    return f"GPU-{index:08x}-1111-4222-8333-{index:012x}"


@dataclasses.dataclass
class FakeGpu:
    """One fake GPU; ``other_used`` is memory held by processes outside the test (``(pid, bytes)``)."""

    index: int
    name: str = H200
    memory_total_bytes: int = 141 * GIB
    mig_mode: bool = False
    persistence_mode: bool = True
    other_used: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def uuid(self) -> str:
        return fake_uuid(self.index)


class FakeNvml:
    """NVML facts from a list of :class:`FakeGpu` and a ``usage`` source.

    Args:
        gpus: the node's GPUs, in index order.
        usage: ``{pid: [(gpu_uuid, bytes), …]}`` of the processes under test, read on every call.
        driver_version, cuda_version: what ``driver_version()``/``cuda_driver_version()`` report.
        unavailable_reason: when set, NVML is unavailable (``available()`` is False).
    """

    def __init__(
        self,
        gpus: Sequence[FakeGpu],
        *,
        usage: Callable[[], Usage] = dict,
        driver_version: str = DRIVER,
        cuda_version: str = CUDA,
        unavailable_reason: str | None = None,
    ) -> None:
        self.devices = list(gpus)
        self.usage = usage
        self._driver = driver_version
        self._cuda = cuda_version
        self._reason = unavailable_reason
        self.calls: list[str] = []

    # -- NvmlDriver surface --------------------------------------------------------------------------

    def available(self) -> bool:
        return self._reason is None

    @property
    def unavailable_reason(self) -> str | None:
        return self._reason

    def driver_version(self) -> str:
        self._ready("driver_version")
        return self._driver

    def cuda_driver_version(self) -> str:
        self._ready("cuda_driver_version")
        return self._cuda

    def gpus(self) -> list[GpuDevice]:
        self._ready("gpus")
        used: dict[str, list[tuple[int, int]]] = {}
        for pid, entries in self.usage().items():
            for uuid, nbytes in entries:
                used.setdefault(normalize_gpu_uuid(uuid), []).append((pid, nbytes))
        out = []
        for gpu in self.devices:
            procs = tuple(used.get(gpu.uuid, [])) + tuple(gpu.other_used)
            out.append(
                GpuDevice(
                    index=gpu.index,
                    uuid=gpu.uuid,
                    name=gpu.name,
                    memory_total_bytes=gpu.memory_total_bytes,
                    memory_free_bytes=max(0, gpu.memory_total_bytes - sum(b for _, b in procs)),
                    persistence_mode=gpu.persistence_mode,
                    mig_mode=gpu.mig_mode,
                    pci_bus_id=f"00000000:{0x19 + gpu.index:02X}:00.0",
                    processes=procs,
                )
            )
        return out

    def processes_by_pid(self) -> dict[int, list[tuple[str, int]]]:
        by_pid: dict[int, list[tuple[str, int]]] = {}
        for gpu in self.gpus():
            for pid, nbytes in gpu.processes:
                by_pid.setdefault(pid, []).append((gpu.uuid, nbytes))
        return by_pid

    # -- helpers -------------------------------------------------------------------------------------

    def gpu(self, index: int) -> FakeGpu:
        return next(g for g in self.devices if g.index == index)

    def _ready(self, what: str) -> None:
        self.calls.append(what)
        if self._reason is not None:
            raise FailedPreconditionError(f"NVML is unavailable: {self._reason}", reason="NVML_UNAVAILABLE")
