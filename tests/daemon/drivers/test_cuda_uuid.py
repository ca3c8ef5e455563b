"""GPU UUID strings ↔ CUuuid bytes."""

from __future__ import annotations

import gc

import pytest

from gpusnap.daemon.api.errors import InvalidArgumentError
from gpusnap.daemon.drivers.cuda import format_gpu_uuid, normalize_gpu_uuid, parse_gpu_uuid, uuid_to_cuuuid

UUID = "GPU-5d0f3b7c-1a2b-3c4d-5e6f-0123456789ab"
RAW = bytes.fromhex("5d0f3b7c1a2b3c4d5e6f0123456789ab")


@pytest.mark.parametrize(
    "text",
    [
        UUID,
        UUID.upper(),
        "  " + UUID + "\n",
        "5d0f3b7c-1a2b-3c4d-5e6f-0123456789ab",
        "GPU-5d0f3b7c1a2b3c4d5e6f0123456789ab",
        "5D0F3B7C1A2B3C4D5E6F0123456789AB",
    ],
)
def test_parse_accepts_nvml_forms(text: str) -> None:
    assert parse_gpu_uuid(text) == RAW
    assert normalize_gpu_uuid(text) == UUID


@pytest.mark.parametrize(
    "text",
    [
        "",
        "GPU-",
        "GPU-5d0f3b7c-1a2b-3c4d-5e6f-0123456789a",
        "GPU-5d0f3b7c-1a2b-3c4d-5e6f-0123456789abc",
        "GPU-zz0f3b7c-1a2b-3c4d-5e6f-0123456789ab",
        "0",
    ],
)
def test_parse_rejects_garbage(text: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        parse_gpu_uuid(text)
    assert e.value.reason == "INVALID_GPU_UUID" and "nvidia-smi -L" in e.value.message


def test_parse_rejects_mig() -> None:
    with pytest.raises(InvalidArgumentError) as e:
        parse_gpu_uuid("MIG-5d0f3b7c-1a2b-3c4d-5e6f-0123456789ab")
    assert "MIG" in e.value.message and "FC-14" in e.value.message


def test_format_roundtrip() -> None:
    assert format_gpu_uuid(RAW) == UUID
    assert parse_gpu_uuid(format_gpu_uuid(bytes(range(16)))) == bytes(range(16))
    with pytest.raises(InvalidArgumentError):
        format_gpu_uuid(b"\x00" * 15)


def test_uuid_to_cuuuid_owns_its_bytes() -> None:
    driver = pytest.importorskip("cuda.bindings.driver")
    values = [uuid_to_cuuuid(format_gpu_uuid(bytes([i]) * 16)) for i in range(32)]
    gc.collect()
    _churn = [bytearray(64) for _ in range(10000)]
    assert all(isinstance(v, driver.CUuuid) for v in values)
    assert [v.bytes for v in values] == [bytes([i]) * 16 for i in range(32)]
    assert uuid_to_cuuuid(UUID).bytes == RAW
    # copying into a pair member keeps the value (assignment copies)
    pair = driver.CUcheckpointGpuPair()
    pair.oldUuid = uuid_to_cuuuid(UUID)
    gc.collect()
    assert pair.oldUuid.bytes == RAW
