"""NvmlDriver over a fake pynvml module (and the real one, which has no library here)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from gpusnap.daemon.api.errors import FailedPreconditionError, InternalError, UnavailableError
from gpusnap.daemon.drivers.nvml import GpuDevice, NvmlDriver

U0 = "GPU-00000000-1111-2222-3333-444444444444"
U1 = "GPU-00000001-1111-2222-3333-444444444444"


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - pynvml's naming
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    pass


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801
    pass


class FakeNvml:
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_FEATURE_ENABLED = 1

    def __init__(self, *, missing: bool = False) -> None:
        self.missing = missing
        self.init_calls = 0
        self.lost: set[int] = set()
        self.devices: list[dict[str, Any]] = [
            dict(uuid=U0, name="NVIDIA H200", total=141, free=100, persist=1, mig=None, bus=b"00000000:19:00.0",
                 procs=[SimpleNamespace(pid=10, usedGpuMemory=5 << 30), SimpleNamespace(pid=11, usedGpuMemory=None)]),
            dict(uuid=U1, name="NVIDIA H200", total=141, free=141, persist=0, mig=[1, 1], bus="00000000:2A:00.0",
                 procs=[SimpleNamespace(pid=10, usedGpuMemory=3 << 30)]),
        ]  # fmt: skip

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.missing:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.159.04"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return 13000

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i in self.lost:
            raise NVMLError_GpuIsLost("GPU is lost")
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return str(self.devices[h]["uuid"])

    def nvmlDeviceGetName(self, h: int) -> str:
        return str(self.devices[h]["name"])

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        d = self.devices[h]
        return SimpleNamespace(total=int(d["total"]) << 30, free=int(d["free"]) << 30)

    def nvmlDeviceGetPersistenceMode(self, h: int) -> int:
        return int(self.devices[h]["persist"])

    def nvmlDeviceGetMigMode(self, h: int) -> list[int]:
        mig = self.devices[h]["mig"]
        if mig is None:
            raise NVMLError_NotSupported("Not Supported")
        return list(mig)

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self.devices[h]["bus"])

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return list(self.devices[h]["procs"])


def test_gpus_and_versions() -> None:
    nvml = NvmlDriver(FakeNvml())
    assert nvml.available() and nvml.unavailable_reason is None
    assert nvml.driver_version() == "580.159.04"
    assert nvml.cuda_driver_version() == "13.0"
    gpus = nvml.gpus()
    assert gpus[0] == GpuDevice(
        index=0,
        uuid=U0,
        name="NVIDIA H200",
        memory_total_bytes=141 << 30,
        memory_free_bytes=100 << 30,
        persistence_mode=True,
        mig_mode=False,
        pci_bus_id="00000000:19:00.0",
        processes=((10, 5 << 30), (11, 0)),
    )
    assert gpus[1].mig_mode and not gpus[1].persistence_mode and gpus[1].pci_bus_id == "00000000:2A:00.0"
    assert nvml.processes_by_pid() == {10: [(U0, 5 << 30), (U1, 3 << 30)], 11: [(U0, 0)]}


def test_init_once_thread_safe() -> None:
    fake = FakeNvml()
    nvml = NvmlDriver(fake)
    threads = [threading.Thread(target=nvml.gpus) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake.init_calls == 1
    nvml.close()
    nvml.driver_version()
    assert fake.init_calls == 2


def test_unavailable_without_library_then_retry() -> None:
    now = [0.0]
    fake = FakeNvml(missing=True)
    nvml = NvmlDriver(fake, retry_interval_s=30, clock=lambda: now[0])
    assert not nvml.available()
    assert nvml.unavailable_reason is not None and "libnvidia-ml.so.1 not found" in nvml.unavailable_reason
    with pytest.raises(FailedPreconditionError) as e:
        nvml.gpus()
    assert e.value.reason == "NVML_UNAVAILABLE" and "libnvidia-ml" in e.value.message
    assert fake.init_calls == 1  # cached within the retry interval
    fake.missing = False
    now[0] = 31.0
    assert nvml.available() and fake.init_calls == 2


def test_lost_gpu_is_unavailable_error() -> None:
    fake = FakeNvml()
    fake.lost.add(1)
    with pytest.raises(UnavailableError) as e:
        NvmlDriver(fake).gpus()
    assert "nvmlDeviceGetHandleByIndex(index=1)" in e.value.message and e.value.reason == "NVML_GPUISLOST"


def test_other_nvml_errors_are_internal() -> None:
    fake = FakeNvml()

    def broken(h: int) -> Any:
        raise NVMLError("boom")

    fake.nvmlDeviceGetPciInfo = broken  # type: ignore[method-assign]
    with pytest.raises(InternalError) as e:
        NvmlDriver(fake).gpus()
    assert "nvmlDeviceGetPciInfo(index=0) failed" in e.value.message


def test_real_pynvml_reports_reason_without_gpu() -> None:
    pynvml = pytest.importorskip("pynvml")
    nvml = NvmlDriver()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        assert not nvml.available()
        assert nvml.unavailable_reason
    else:  # a GPU host
        pynvml.nvmlShutdown()
        assert nvml.available()


def test_hung_nvml_is_bounded() -> None:
    """A query NVML never answers fails within call_timeout_s instead of blocking the daemon."""
    import threading
    import time

    fake = FakeNvml()
    release = threading.Event()
    fake.nvmlDeviceGetCount = lambda: release.wait(60) and 0  # type: ignore[method-assign, assignment]
    nvml = NvmlDriver(fake, call_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(UnavailableError) as e:
        nvml.gpus()
    release.set()
    assert e.value.reason == "NVML_TIMEOUT" and time.monotonic() - start < 5
