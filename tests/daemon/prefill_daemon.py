"""gpusnapd on a node whose one GPU is a fake: its prefill (``--gpu-prefill``) drives the fake VMM driver of
tests/fakes/cuda_vmm.py, and its CUDA checkpoint driver and NVML (tests/daemon/operations/fakes_cuda.py,
fakes_nvml.py) see a process that maps that driver's device memory (a worker's arena) as a CUDA process on
that GPU, so a CPU test restores a real worker through the daemon-filled path (tests/adapters/test_prefill_cpu.py)
with the GPU use its snapshot records, as on a GPU node.

    python tests/daemon/prefill_daemon.py [gpusnapd flags]

``GPUSNAP_TEST_PREFILL_FAIL=CALL:N`` makes the fake's Nth ``CALL`` (e.g. ``cuMemcpyAsync:2``) fail, and
``GPUSNAP_TEST_PREFILL_CAPACITY`` sets its device memory in bytes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for tests.fakes

from gpusnap.daemon.drivers.cuda import ProcessState  # noqa: E402
from gpusnap.daemon.gpu.support import GpuSupport  # noqa: E402
from gpusnap.daemon.main import main  # noqa: E402
from gpusnap.daemon.operations.failpoints import Failpoints  # noqa: E402
from gpusnap.daemon.server import Overrides  # noqa: E402
from tests.daemon.operations.fakes_cuda import ProcessCuda  # noqa: E402
from tests.daemon.operations.fakes_nvml import FakeGpu, FakeNvml, fake_uuid  # noqa: E402
from tests.fakes.cuda_vmm import CUresult, FakeVmmDriver  # noqa: E402

GPU = fake_uuid(0)
"""The one GPU: the fake VMM's device 0 (``cuda_vmm.uuid_of(0)``, in NVML's form)."""
CONTEXT_BYTES = 64 << 20
"""Device memory a CUDA process holds for NVML: its context's (the weights go out with the offload)."""


class ArenaCuda(ProcessCuda):
    """The CUDA checkpoint driver of that node: a process that maps the fake VMM's device memory is, from then
    on, a CUDA process on :data:`GPU` (a restored copy of a checkpointed one comes back CHECKPOINTED, as
    ``ProcessCuda`` does)."""

    def discover(self) -> None:
        """Take every process that maps the fake device memory now (gpusnapd's own fills aside) as a CUDA
        process."""
        for maps in Path("/proc").glob("[0-9]*/maps"):
            pid = int(maps.parent.name)
            with self._lock:
                known = pid in self.states or pid == os.getpid()
            if known:
                continue
            try:
                holds = "fake-cuda-physical" in maps.read_text()
            except OSError:
                continue
            if holds:
                self.add(pid, gpus=[GPU], visible=[GPU], memory_bytes=CONTEXT_BYTES, state=ProcessState.RUNNING)

    def usage(self) -> dict[int, list[tuple[str, int]]]:
        self.discover()
        return super().usage()

    def _enter(self, method: str, pid: int, args: tuple[object, ...] = ()) -> bool:
        self.discover()
        return super()._enter(method, pid, args)


driver = FakeVmmDriver(capacity=int(os.environ.get("GPUSNAP_TEST_PREFILL_CAPACITY", 1 << 30)))
fault = os.environ.get("GPUSNAP_TEST_PREFILL_FAIL", "")
if fault:
    call, _, nth = fault.partition(":")
    driver.fail(call, on_call=int(nth or 1), result=CUresult.CUDA_ERROR_INVALID_VALUE)
cuda = ArenaCuda()
overrides = Overrides(
    failpoints=Failpoints.from_env(),
    fill_driver=driver,
    gpu=GpuSupport(cuda, FakeNvml([FakeGpu(0)], usage=cuda.usage), "", call_timeout_s=30),  # type: ignore[arg-type]
)

if __name__ == "__main__":
    main(obj=overrides)
