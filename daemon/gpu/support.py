"""GpuSupport: this node's GPU capability as operations see it, and the GPU phases they share.

Built once at daemon start (``cuInit`` there, which restore needs unless persistence mode is on). On a
host without an NVIDIA driver it records why, and every GPU-touching request fails with that reason,
while CPU-only process trees are checkpointed as usual.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import structlog

from gpusnap.daemon.api.errors import FailedPreconditionError, GpusnapError
from gpusnap.daemon.api.types import GpuProcess
from gpusnap.daemon.drivers import host, procfs
from gpusnap.daemon.drivers.cuda import CudaCheckpointApi, CudaDriver
from gpusnap.daemon.drivers.nvml import GpuDevice, NvmlDriver
from gpusnap.daemon.gpu.controller import GpuTreeController, suggest_transfer_timeout_s

log = structlog.get_logger(__name__)

NVIDIA_DEVICE_PREFIX = "/dev/nvidia"


@dataclasses.dataclass(frozen=True)
class GpuTree:
    """The CUDA side of one process tree: its CUDA PIDs and what each holds on which GPU."""

    cuda_pids: tuple[int, ...]
    processes: tuple[GpuProcess, ...]

    @property
    def gpu_bytes(self) -> int:
        return sum(p.gpu_memory_bytes for p in self.processes)

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(u for p in self.processes for u in p.gpu_uuids))


class GpuSupport:
    """CUDA checkpoint driver + NVML, or the reason this node has neither.

    Args:
        cuda: the checkpoint API (``CudaDriver``; a fake in tests), ``None`` when unavailable.
        nvml: NVML facts, ``None`` when unavailable.
        reason: why GPU support is missing (empty when present).
        call_timeout_s: deadline for quick driver calls, seconds.
    """

    def __init__(
        self,
        cuda: CudaCheckpointApi | None,
        nvml: NvmlDriver | None,
        reason: str,
        *,
        call_timeout_s: float,
        host_memory_bytes: int = 0,
    ):
        self.cuda = cuda
        self.nvml = nvml
        self.reason = reason
        self.call_timeout_s = call_timeout_s
        self.host_memory_bytes = host_memory_bytes
        self.suspended: dict[int, GpuTree] = {}
        """Trees suspended in place, by root PID (for ``Resume``)."""
        self._lock = threading.Lock()

    @classmethod
    def probe(cls, call_timeout_s: float, host_memory_bytes: int = 0) -> GpuSupport:
        """Initialise the CUDA driver and NVML; never raises (a CPU-only node gets a reason instead)."""
        nvml = NvmlDriver()
        if not nvml.available():
            reason = nvml.unavailable_reason or "NVML unavailable"
            log.info("gpu.unavailable", reason=reason)
            return cls(None, None, reason, call_timeout_s=call_timeout_s, host_memory_bytes=host_memory_bytes)
        cuda = CudaDriver()
        try:
            cuda.init()
        except GpusnapError as exc:
            log.warning("gpu.cuda_unavailable", reason=str(exc))
            return cls(None, nvml, str(exc), call_timeout_s=call_timeout_s, host_memory_bytes=host_memory_bytes)
        log.info("gpu.ready", driver=nvml.driver_version(), cuda=cuda.driver_version_string, gpus=len(nvml.gpus()))
        return cls(cuda, nvml, "", call_timeout_s=call_timeout_s, host_memory_bytes=host_memory_bytes)

    @property
    def available(self) -> bool:
        return self.cuda is not None and self.nvml is not None

    def require(self, what: str) -> tuple[CudaCheckpointApi, NvmlDriver]:
        """The driver pair, or FailedPreconditionError (reason ``GPU_UNAVAILABLE``) naming ``what`` needed it."""
        if self.cuda is None or self.nvml is None:
            raise FailedPreconditionError(
                f"{what} needs the NVIDIA driver (>= 570) and NVML, which gpusnapd could not use: {self.reason}",
                reason="GPU_UNAVAILABLE",
            )
        return self.cuda, self.nvml

    def host_memory(self) -> int:
        """RAM the preflight counts on: the configured figure, else MemAvailable (bytes)."""
        return self.host_memory_bytes or host.mem_available_bytes()

    def gpus(self) -> list[GpuDevice]:
        return self.nvml.gpus() if self.nvml is not None and self.nvml.available() else []

    def driver_versions(self) -> tuple[str, str]:
        """(NVIDIA driver version, CUDA driver version) or empty strings."""
        if self.nvml is None or not self.nvml.available():
            return "", ""
        return self.nvml.driver_version(), self.nvml.cuda_driver_version()

    def controller(self, gpu_bytes: int = 0) -> GpuTreeController:
        cuda, _ = self.require("this operation")
        return GpuTreeController(
            cuda, call_timeout_s=self.call_timeout_s, transfer_timeout_s=suggest_transfer_timeout_s(gpu_bytes)
        )

    def find_tree(self, tree_pids: Sequence[int]) -> GpuTree | None:
        """The CUDA side of ``tree_pids``; ``None`` for a CPU-only tree.

        Raises:
            FailedPreconditionError: the tree holds ``/dev/nvidia*`` but GPU support is missing (reason
                ``GPU_UNAVAILABLE``), or a GPU user is not checkpointable.
        """
        if not self.available:
            users = [p for p in tree_pids if _uses_nvidia_devices(p)]
            if users:
                self.require(f"process(es) {', '.join(map(str, users))} hold NVIDIA devices; checkpointing them")
            return None
        cuda, nvml = self.require("GPU capture")
        usage = nvml.processes_by_pid()
        ctl = self.controller()
        cuda_pids = ctl.find_cuda_pids(tree_pids, nvml_pids=[p for p in tree_pids if p in usage])
        if not cuda_pids:
            return None
        gpus = self.gpus()
        processes = tuple(
            GpuProcess(
                pid=p,
                gpu_uuids=tuple(u for u, _ in usage.get(p, [])),
                gpu_memory_bytes=sum(b for _, b in usage.get(p, [])),
                visible_gpu_uuids=visible_gpus(procfs.read_environ(p).get("CUDA_VISIBLE_DEVICES"), gpus),
            )
            for p in cuda_pids
        )
        return GpuTree(cuda_pids=tuple(cuda_pids), processes=processes)


def visible_gpus(cuda_visible_devices: str | None, gpus: Sequence[GpuDevice]) -> tuple[str, ...]:
    """UUIDs of the GPUs a process sees, from its ``CUDA_VISIBLE_DEVICES`` (indexes, UUIDs or UUID prefixes,
    as CUDA accepts them; parsing stops at the first invalid entry, as CUDA's does); all GPUs when unset."""
    if cuda_visible_devices is None:
        return tuple(g.uuid for g in gpus)
    out: list[str] = []
    for item in (x.strip() for x in cuda_visible_devices.split(",")):
        match = [
            g
            for g in gpus
            if (item.isdigit() and g.index == int(item)) or (item.startswith("GPU-") and g.uuid.startswith(item))
        ]
        if len(match) != 1:
            break
        out.append(match[0].uuid)
    return tuple(out)


def _uses_nvidia_devices(pid: int) -> bool:
    try:
        return any(p.startswith(NVIDIA_DEVICE_PREFIX) for p in procfs.open_paths(pid))
    except OSError:
        return False
