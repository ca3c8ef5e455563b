"""Put on an engine's PYTHONPATH (as ``sitecustomize``, which Python imports at start in every process the
engine spawns) by CPU tests that run vLLM's address-stable path: gpusnap's VMM arenas then use the fake
driver of tests/fakes/cuda_vmm.py, whose "device" memory is host memory, so a CPU worker's weights and KV
cache move into arenas exactly as a CUDA worker's do (gpusnap.adapters.engines.vllm.processes.WorkerPart). The
checkout's root comes from ``GPUSNAP_TEST_REPO``; without it nothing happens."""

import os
import sys

_repo = os.environ.get("GPUSNAP_TEST_REPO")
if _repo:
    sys.path.append(_repo)
    from gpusnap.adapters import vmm
    from tests.fakes.cuda_vmm import FakeVmmDriver

    vmm.set_default_driver(FakeVmmDriver(capacity=int(os.environ.get("GPUSNAP_TEST_FAKE_VMM_BYTES", 4 << 30))))
