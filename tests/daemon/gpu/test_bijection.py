"""Remaps are completed into one-to-one maps over every GPU the process could see."""

from __future__ import annotations

import pytest

from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.drivers.nvml import GpuDevice
from gpusnap.daemon.gpu.gpumap import complete_bijection, gpu_pairs_for_restore
from gpusnap.daemon.gpu.support import visible_gpus

A, B, C = (f"GPU-{n}{n}{n}{n}{n}{n}{n}{n}-1111-2222-3333-444444444444" for n in "abc")


def _gpus(*uuids: str) -> list[GpuDevice]:
    return [
        GpuDevice(
            index=i,
            uuid=u,
            name="NVIDIA H200",
            memory_total_bytes=1,
            memory_free_bytes=1,
            persistence_mode=True,
            mig_mode=False,
            pci_bus_id="",
        )
        for i, u in enumerate(uuids)
    ]


def test_move_to_a_visible_gpu_becomes_a_swap() -> None:
    assert complete_bijection({A: B}, [A, B], _gpus(A, B)) == {A: B, B: A}
    assert gpu_pairs_for_restore(complete_bijection({A: B}, [A, B], _gpus(A, B))) == sorted([(A, B), (B, A)])


def test_unrelated_visible_gpus_stay_in_place() -> None:
    assert complete_bijection({A: B}, [A, B, C], _gpus(A, B, C)) == {A: B, B: A, C: C}


def test_identity_needs_no_completion() -> None:
    assert complete_bijection({A: A}, [A, B], _gpus(A, B)) == {A: A}
    assert gpu_pairs_for_restore({A: A}) == []


def test_too_few_gpus() -> None:
    with pytest.raises(FailedPreconditionError):
        complete_bijection({A: B}, [A, B, C], _gpus(B))


def test_visible_gpus_from_cuda_visible_devices() -> None:
    gpus = _gpus(A, B, C)
    assert visible_gpus(None, gpus) == (A, B, C)
    assert visible_gpus("1", gpus) == (B,)
    assert visible_gpus("2,0", gpus) == (C, A)
    assert visible_gpus(C[:12], gpus) == (C,)
    assert visible_gpus("0,x,1", gpus) == (A,), "CUDA stops at the first invalid entry"
    assert visible_gpus("", gpus) == ()
