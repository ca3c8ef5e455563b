"""gpusnapd whose prefill (``--gpu-prefill``) drives the fake VMM driver of tests/fakes/cuda_vmm.py, so a
CPU test restores a real worker through the daemon-filled path (tests/adapters/test_prefill_cpu.py).

    python tests/daemon/prefill_daemon.py [gpusnapd flags]

``GPUSNAP_TEST_PREFILL_FAIL=CALL:N`` makes the fake's Nth ``CALL`` (e.g. ``cuMemcpyAsync:2``) fail, and
``GPUSNAP_TEST_PREFILL_CAPACITY`` sets its device memory in bytes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for tests.fakes

from gpusnap.daemon.main import main  # noqa: E402
from gpusnap.daemon.operations.failpoints import Failpoints  # noqa: E402
from gpusnap.daemon.server import Overrides  # noqa: E402
from tests.fakes.cuda_vmm import CUresult, FakeVmmDriver  # noqa: E402

driver = FakeVmmDriver(capacity=int(os.environ.get("GPUSNAP_TEST_PREFILL_CAPACITY", 1 << 30)))
fault = os.environ.get("GPUSNAP_TEST_PREFILL_FAIL", "")
if fault:
    call, _, nth = fault.partition(":")
    driver.fail(call, on_call=int(nth or 1), result=CUresult.CUDA_ERROR_INVALID_VALUE)
overrides = Overrides(
    failpoints=Failpoints.from_env(),
    fill_driver=driver,
    prefill_require_gpu_use=False,  # the CPU workers' snapshots record no GPU use (no NVML process)
)

if __name__ == "__main__":
    main(obj=overrides)
