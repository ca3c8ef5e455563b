"""configure_capture_env(): what a worker must set *before* building its engine to be checkpointable.

Call it first thing in the worker (before importing torch/NCCL-using code spawns anything). Each
setting is only a default: values already in the environment are kept. Sources: NVIDIA Dynamo
Snapshot's ``configure_snapshot_capture_env`` and the cuda-checkpoint README (prior-art.md §(c)).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

CAPTURE_ENV: Mapping[str, tuple[str, str]] = {
    "NCCL_CUMEM_ENABLE": ("0", "cuda-checkpoint cannot capture cuMem-backed NCCL buffers"),
    "NCCL_NVLS_ENABLE": ("0", "NVLink SHARP multicast objects cannot be checkpointed"),
    "NCCL_P2P_DISABLE": ("1", "CUDA IPC / P2P mappings between processes cannot be checkpointed"),
    "NCCL_IB_DISABLE": ("1", "InfiniBand verbs state cannot enter a CRIU image"),
    "NCCL_RAS_ENABLE": ("0", "NCCL's RAS thread keeps sockets open"),
    "TORCH_NCCL_ENABLE_MONITORING": ("0", "the NCCL watchdog kills processes that were frozen for the dump"),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("0", "same watchdog: no dumps on the restore-time gap"),
    "HF_HUB_OFFLINE": ("1", "no hub connections may be open in the image"),
    "HF_HUB_DISABLE_XET": ("1", "the Xet client keeps background connections"),
    "VLLM_WORKER_MULTIPROC_METHOD": ("spawn", "fork would copy CUDA state and open files into children"),
    "TLLM_NCCL_SYMMETRIC_ZERO_COPY": ("0", "TensorRT-LLM's NCCL registered windows cannot be captured"),
    "TORCHINDUCTOR_COMPILE_THREADS": ("1", "no compile worker pool processes in the image"),
}
"""Variable → (value, reason)."""


def configure_capture_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set every :data:`CAPTURE_ENV` default that is not set yet; returns what was set.

    Args:
        environ: the environment to change (default ``os.environ``).
    """
    env = os.environ if environ is None else environ
    changed = {}
    for name, (value, _reason) in CAPTURE_ENV.items():
        if name not in env:
            env[name] = value
            changed[name] = value
    return changed
