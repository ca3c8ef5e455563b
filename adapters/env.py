"""configure_capture_env(): what a worker must set *before* building its engine to be checkpointable.

Call it first thing in the worker (before torch or NCCL-using code starts anything). The settings and
their reasons are the one table in :mod:`gpusnap.adapters.contract.capture_settings`, which the daemon's
preflight checks against, so a worker configured with this helper passes preflight with one or several
CUDA processes. Each setting is only a default: values already in the environment are kept (and a
conflicting one is what preflight then names). Sources: NVIDIA Dynamo Snapshot's
``configure_snapshot_capture_env`` (ai-dynamo/dynamo) and the README of NVIDIA/cuda-checkpoint; each
setting's reason and failure cases (docs/failure-cases.md) are in its row of the table.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from gpusnap.adapters.contract.capture_settings import CAPTURE_SETTINGS, Kind, env_defaults

CAPTURE_ENV: Mapping[str, tuple[str, str]] = {
    s.name: (s.value, s.reason) for s in CAPTURE_SETTINGS if s.kind is Kind.ENV
}
"""Variable → (value, reason), every environment row of the table (any scope)."""


def configure_capture_env(
    environ: MutableMapping[str, str] | None = None, *, tensor_parallel: int = 1, engine: str | None = None
) -> dict[str, str]:
    """Set every capture default this worker's layout needs that is not set yet; returns what was set.

    Sets the ``ANY`` and ``MULTI_PROCESS`` rows always (the latter change nothing in a process without
    NCCL peers) and, when ``tensor_parallel > 1``, the ``TENSOR_PARALLEL`` rows too. Engine flags
    (vLLM ``--disable-custom-all-reduce``) cannot be set from here: pass
    :func:`~gpusnap.adapters.contract.capture_settings.engine_args` to the engine.

    Args:
        environ: the environment to change (default ``os.environ``).
        tensor_parallel: the worker's tensor-parallel size (≥ 1).
        engine: ``"vllm"``, ``"sglang"``, ``"trtllm"`` to leave out other engines' rows; ``None`` sets all.

    Raises:
        ValueError: ``tensor_parallel < 1``.
    """
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    changed = {}
    for name, value in env_defaults(tensor_parallel=tensor_parallel, engine=engine).items():
        if name not in env:
            env[name] = value
            changed[name] = value
    return changed
