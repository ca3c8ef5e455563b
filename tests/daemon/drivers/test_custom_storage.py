"""The custom-storage capability probe against fake bindings: each way a host can lack it is refused
with its reason, and only a driver that implements the entry point passes."""

from __future__ import annotations

import types
from typing import Any

from gpusnap.daemon.drivers import custom_storage
from gpusnap.daemon.drivers.custom_storage import probe


class _Args:
    customStorageInfo_out = 0  # noqa: N815 (the binding's name)


def _bindings(*, complete_result: int | None = 1, fields: bool = True, drop: str = "") -> Any:
    calls: list[Any] = []

    def complete(handle: Any) -> tuple[int]:
        calls.append(handle)
        if complete_result is None:
            raise RuntimeError('Function "cuCheckpointOperationComplete" not found')
        return (complete_result,)

    args = _Args if fields else object
    ns = types.SimpleNamespace(
        CUcheckpointCustomStorageInfo=object,
        CUcheckpointCustomStoragePerDeviceData=object,
        cuCheckpointOperationComplete=complete,
        CUcheckpointCheckpointArgs=args,
        CUcheckpointRestoreArgs=args,
        calls=calls,
    )
    if drop:
        delattr(ns, drop)
    return ns


def test_old_bindings_are_refused_without_calling_the_driver() -> None:
    drv = _bindings(drop="cuCheckpointOperationComplete")
    got = probe(drv, 13040)
    assert not got.supported and "cuCheckpointOperationComplete" in got.reason and ">= 13.4" in got.reason
    got = probe(_bindings(fields=False), 13050)
    assert not got.supported and "customStorageInfo_out" in got.reason


def test_old_driver_is_refused_by_version() -> None:
    drv = _bindings()
    got = probe(drv, 13000)  # the H200 here: 580.159.04 reports CUDA 13.0
    assert not got.supported and "CUDA 13.0" in got.reason and "13.4" in got.reason
    assert drv.calls == [], "no driver call on a driver that is too old"
    assert not probe(drv, None).supported


def test_driver_without_the_entry_point_is_refused() -> None:
    got = probe(_bindings(complete_result=None), 13040)
    assert not got.supported and "not callable" in got.reason
    got = probe(_bindings(complete_result=801), 13040)  # CUDA_ERROR_NOT_SUPPORTED
    assert not got.supported and "801" in got.reason


def test_a_driver_that_rejects_a_null_handle_supports_it() -> None:
    drv = _bindings(complete_result=1)  # CUDA_ERROR_INVALID_VALUE: the call reached the implementation
    assert probe(drv, custom_storage.MIN_DRIVER_VERSION).supported
    assert len(drv.calls) == 1


def test_installed_bindings_against_this_hosts_driver_version() -> None:
    """With the real cuda-bindings (13.5 here has the types), a CUDA 13.0 driver is refused by version."""
    import pytest

    drv = pytest.importorskip("cuda.bindings.driver")
    got = probe(drv, 13000)
    assert not got.supported and ("CUDA 13.0" in got.reason or "cuda-bindings lacks" in got.reason)
