"""Can this host use the CUDA checkpoint's custom storage? A run-time capability probe.

With custom storage (CUDA >= 13.4: ``CUcheckpointCustomStorageInfo`` in ``customStorageInfo_out`` of the
checkpoint and restore arguments, then ``cuCheckpointOperationComplete``), the driver maps a process's
device memory into the caller and the caller copies it to or from memory of its choice, instead of the
driver staging it in the process's host memory (``docs/performance.md``). No driver floor is published,
so gpusnap probes at run time and fails closed (prior art: Dynamo does the same):

1. the installed cuda-bindings has the types and the entry point;
2. ``cuDriverGetVersion`` reports CUDA >= 13.4;
3. ``cuCheckpointOperationComplete`` on a null handle reaches the driver and is refused as an invalid
   value; a driver without the entry point answers otherwise (or the binding raises).

Until a probe succeeds gpusnap keeps the named-buffer path, which works on every supported driver. The
custom-storage data path itself is not built yet: no driver available to gpusnap has it (the H200 here
reports CUDA 13.0, driver 580.159.04, with cuda-bindings 13.3.1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

MIN_DRIVER_VERSION = 13040
"""``cuDriverGetVersion`` of the first CUDA release with custom storage (13.4)."""

REQUIRED_NAMES = (
    "CUcheckpointCustomStorageInfo",
    "CUcheckpointCustomStoragePerDeviceData",
    "cuCheckpointOperationComplete",
    "CUcheckpointCheckpointArgs",
    "CUcheckpointRestoreArgs",
)
_INVALID_VALUE = 1


@dataclasses.dataclass(frozen=True)
class CustomStorage:
    """The probe's answer: ``supported``, and ``reason`` (why not, with the fix) when it is not."""

    supported: bool
    reason: str = ""


def _version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def probe(drv: Any, driver_version: int | None) -> CustomStorage:
    """Probe ``drv`` (``cuda.bindings.driver``, already ``cuInit``-ed) for custom storage.

    Args:
        drv: the bindings module (or a fake with the same names).
        driver_version: ``cuDriverGetVersion``'s answer (``13000`` = 13.0), ``None`` if unknown.

    Returns:
        :class:`CustomStorage`; never raises.
    """
    missing = [n for n in REQUIRED_NAMES if not hasattr(drv, n)]
    if not missing:
        try:
            args = (drv.CUcheckpointCheckpointArgs(), drv.CUcheckpointRestoreArgs())
            missing = [
                f"{type(a).__name__}.customStorageInfo_out" for a in args if not hasattr(a, "customStorageInfo_out")
            ]
        except Exception as exc:  # noqa: BLE001 - a broken binding is "not supported"
            missing = [f"CUcheckpoint*Args ({exc})"]
    if missing:
        return CustomStorage(
            False,
            f"cuda-bindings lacks {', '.join(missing)}: custom storage needs cuda-bindings "
            ">= 13.4 and a CUDA >= 13.4 driver",
        )
    if driver_version is None or driver_version < MIN_DRIVER_VERSION:
        have = "an unknown CUDA version" if driver_version is None else f"CUDA {_version(driver_version)}"
        return CustomStorage(
            False, f"the driver reports {have}; custom storage needs a CUDA >= {_version(MIN_DRIVER_VERSION)} driver"
        )
    try:
        out = drv.cuCheckpointOperationComplete(
            drv.CUcheckpointOperationHandle(0) if hasattr(drv, "CUcheckpointOperationHandle") else 0
        )
        result = int(out[0])
    except Exception as exc:  # noqa: BLE001 - e.g. the entry point is missing from libcuda
        return CustomStorage(
            False,
            f"cuCheckpointOperationComplete is not callable ({type(exc).__name__}: {exc}); update the NVIDIA driver",
        )
    if result != _INVALID_VALUE:
        return CustomStorage(
            False,
            f"cuCheckpointOperationComplete(NULL) answered CUresult {result}, not "
            "CUDA_ERROR_INVALID_VALUE: the driver does not implement custom storage",
        )
    return CustomStorage(True)
