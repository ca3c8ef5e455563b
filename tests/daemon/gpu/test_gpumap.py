"""resolve_gpu_map / gpu_pairs_for_restore (FC-08): completeness, models, indexes, auto-pick, memory."""

from __future__ import annotations

import pytest

from gpusnap.daemon.api.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from gpusnap.daemon.drivers.nvml import GpuDevice
from gpusnap.daemon.gpu.gpumap import gpu_pairs_for_restore, resolve_gpu_map

GIB = 1 << 30
U = [f"GPU-{i:08x}-1111-2222-3333-444444444444" for i in range(6)]


def gpu(index: int, *, name: str = "NVIDIA H200", free_gib: int = 100, mig: bool = False, procs: int = 0) -> GpuDevice:
    return GpuDevice(
        index=index,
        uuid=U[index],
        name=name,
        memory_total_bytes=141 * GIB,
        memory_free_bytes=free_gib * GIB,
        persistence_mode=True,
        mig_mode=mig,
        pci_bus_id=f"00000000:{index + 0x19:02X}:00.0",
        processes=tuple((1000 + i, GIB) for i in range(procs)),
    )


NODE = [gpu(0), gpu(1), gpu(2), gpu(3, name="NVIDIA L4", free_gib=20)]


def test_identity_when_originals_present_and_free() -> None:
    m = resolve_gpu_map({}, [U[0], U[1]], NODE, required_free_bytes={U[0]: 40 * GIB, U[1]: 40 * GIB})
    assert m == {U[0]: U[0], U[1]: U[1]}
    assert gpu_pairs_for_restore(m) == []


def test_uuid_case_and_prefix_normalised() -> None:
    m = resolve_gpu_map({}, [U[0].upper().replace("GPU-", "gpu-")], NODE, required_free_bytes={})
    assert m == {U[0]: U[0]}


def test_auto_pick_free_same_model_gpu() -> None:
    node = [gpu(0, free_gib=10), gpu(1, procs=2), gpu(2), gpu(3, name="NVIDIA L4")]
    m = resolve_gpu_map({}, [U[0]], node, required_free_bytes={U[0]: 40 * GIB})
    assert m == {U[0]: U[2]}  # GPU 1 is free enough too but already has compute processes
    assert gpu_pairs_for_restore(m) == [(U[0], U[2])]


def test_auto_pick_for_gpu_absent_from_node_uses_source_model() -> None:
    absent = "GPU-deadbeef-0000-0000-0000-000000000000"
    m = resolve_gpu_map(
        {}, [absent, U[0]], NODE, required_free_bytes={absent: GIB}, source_models={absent: "NVIDIA L4"}
    )
    assert m == {absent: U[3], U[0]: U[0]}
    # mixed map: every entry (identity included) goes to the driver (FC-08)
    assert gpu_pairs_for_restore(m) == sorted([(absent, U[3]), (U[0], U[0])])


def test_auto_pick_never_steals_a_checkpointed_gpu() -> None:
    node = [gpu(0, free_gib=1), gpu(1)]
    with pytest.raises(ResourceExhaustedError) as e:
        resolve_gpu_map({}, [U[0], U[1]], node, required_free_bytes={U[0]: 40 * GIB, U[1]: 40 * GIB})
    assert e.value.reason == "GPU_MEMORY_INSUFFICIENT" and U[0] in e.value.message
    assert e.value.metadata["gpu"] == U[0] and e.value.metadata["needed_bytes"] == str(40 * GIB)


def test_auto_pick_unknown_model() -> None:
    with pytest.raises(FailedPreconditionError) as e:
        resolve_gpu_map({}, ["GPU-deadbeef-0000-0000-0000-000000000000"], NODE, required_free_bytes={})
    assert e.value.reason == "GPU_MODEL_UNKNOWN" and "explicit GPU map" in e.value.message


def test_auto_pick_no_gpu_of_model() -> None:
    absent = "GPU-deadbeef-0000-0000-0000-000000000000"
    with pytest.raises(FailedPreconditionError) as e:
        resolve_gpu_map({}, [absent], NODE, required_free_bytes={}, source_models={absent: "NVIDIA B200"})
    assert e.value.reason == "NO_SUITABLE_GPU" and "NVIDIA B200" in e.value.message


def test_not_enough_memory_anywhere() -> None:
    node = [gpu(0, free_gib=10), gpu(1, free_gib=10)]
    with pytest.raises(ResourceExhaustedError) as e:
        resolve_gpu_map({}, [U[0]], node, required_free_bytes={U[0]: 40 * GIB})
    msg = e.value.message
    assert "10.0 GiB free, needs 40.0 GiB" in msg and U[1] in msg and "free GPU memory" in msg


def test_requested_map_by_uuid_and_index() -> None:
    m = resolve_gpu_map({U[0]: "2", "1": U[1]}, [U[0], U[1]], NODE, required_free_bytes={})
    assert m == {U[0]: U[2], U[1]: U[1]}
    assert gpu_pairs_for_restore(m) == [(U[0], U[2]), (U[1], U[1])]


def test_requested_map_incomplete_fc08() -> None:
    with pytest.raises(InvalidArgumentError) as e:
        resolve_gpu_map({U[0]: U[2]}, [U[0], U[1]], NODE, required_free_bytes={})
    assert e.value.reason == "GPU_MAP_INCOMPLETE" and U[1] in e.value.message and "FC-08" in e.value.message


def test_requested_map_cross_model() -> None:
    with pytest.raises(InvalidArgumentError) as e:
        resolve_gpu_map({U[0]: "3"}, [U[0]], NODE, required_free_bytes={})
    assert e.value.reason == "GPU_MODEL_MISMATCH"
    assert "NVIDIA H200" in e.value.message and "NVIDIA L4" in e.value.message


def test_requested_map_cross_model_from_source_models() -> None:
    absent = "GPU-deadbeef-0000-0000-0000-000000000000"
    with pytest.raises(InvalidArgumentError) as e:
        resolve_gpu_map({absent: U[0]}, [absent], NODE, required_free_bytes={}, source_models={absent: "NVIDIA L4"})
    assert e.value.reason == "GPU_MODEL_MISMATCH"


def test_requested_map_errors() -> None:
    with pytest.raises(InvalidArgumentError) as e:
        resolve_gpu_map({U[2]: U[2]}, [U[0]], NODE, required_free_bytes={})
    assert e.value.reason == "GPU_NOT_CHECKPOINTED"
    with pytest.raises(InvalidArgumentError) as e:
        resolve_gpu_map({"2": U[1]}, [U[0]], NODE, required_free_bytes={})
    assert e.value.reason == "GPU_NOT_CHECKPOINTED" and "index 2" in e.value.message
    with pytest.raises(InvalidArgumentError) as e:
        resolve_gpu_map({U[0]: "9"}, [U[0]], NODE, required_free_bytes={})
    assert e.value.reason == "GPU_NOT_FOUND" and "index 9" in e.value.message
    with pytest.raises(InvalidArgumentError) as e:
        resolve_gpu_map({U[0]: "GPU-ffffffff-0000-0000-0000-000000000000"}, [U[0]], NODE, required_free_bytes={})
    assert e.value.reason == "GPU_NOT_FOUND"
    with pytest.raises(InvalidArgumentError) as e:
        resolve_gpu_map({U[0]: U[2], U[1]: U[2]}, [U[0], U[1]], NODE, required_free_bytes={})
    assert e.value.reason == "GPU_MAP_DUPLICATE_TARGET"
    with pytest.raises(InvalidArgumentError) as e:
        resolve_gpu_map({U[0]: "not-a-gpu"}, [U[0]], NODE, required_free_bytes={})
    assert e.value.reason == "INVALID_GPU_UUID"


def test_requested_map_memory_and_mig() -> None:
    node = [gpu(0), gpu(1, free_gib=5), gpu(2, mig=True)]
    with pytest.raises(ResourceExhaustedError) as e:
        resolve_gpu_map({U[0]: U[1]}, [U[0]], node, required_free_bytes={U[0]: 40 * GIB})
    assert U[1] in e.value.message and "5.0 GiB free, needs 40.0 GiB" in e.value.message
    with pytest.raises(FailedPreconditionError) as e2:
        resolve_gpu_map({U[0]: U[2]}, [U[0]], node, required_free_bytes={})
    assert e2.value.reason == "MIG_ENABLED"


def test_identity_skips_mig_gpu() -> None:
    node = [gpu(0, mig=True), gpu(1)]
    assert resolve_gpu_map({}, [U[0]], node, required_free_bytes={}) == {U[0]: U[1]}
