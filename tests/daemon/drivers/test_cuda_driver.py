"""CudaDriver against the installed cuda-bindings.

Every name it uses exists, structs are filled as the driver expects, and without a GPU ``init()`` fails cleanly.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import pytest

from gpusnap.daemon.api.errors import FailedPreconditionError, InternalError, InvalidArgumentError
from gpusnap.daemon.drivers import cuda as cuda_mod
from gpusnap.daemon.drivers.cuda import (
    REQUIRED_BINDING_FIELDS,
    REQUIRED_BINDING_NAMES,
    CudaCheckpointApi,
    CudaDriver,
    CudaError,
    CudaResult,
    ProcessState,
    build_restore_args,
    missing_bindings,
    result_name,
)

driver = pytest.importorskip("cuda.bindings.driver")

GPU_A = "GPU-5d0f3b7c-1a2b-3c4d-5e6f-0123456789ab"
GPU_B = "GPU-00112233-4455-6677-8899-aabbccddeeff"


def _libcuda_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- bindings surface


def test_every_binding_name_used_exists() -> None:
    assert missing_bindings() == []
    for name in REQUIRED_BINDING_NAMES:
        assert hasattr(driver, name), name
    for struct, fields in REQUIRED_BINDING_FIELDS.items():
        instance = getattr(driver, struct)()
        for f in fields:
            assert hasattr(instance, f), f"{struct}.{f}"


def test_cuda_bindings_version_pinned() -> None:
    import cuda.bindings

    major, minor, patch = (int(x) for x in cuda.bindings.__version__.split(".")[:3])
    assert (major, minor, patch) >= (13, 3, 1)


def test_enums_match_bindings() -> None:
    for member in CudaResult:
        assert int(getattr(driver.CUresult, member.name)) == member.value, member.name
    for state in ProcessState:
        assert int(getattr(driver.CUprocessState, f"CU_PROCESS_STATE_{state.name}")) == state.value


def test_result_name() -> None:
    assert result_name(801) == "CUDA_ERROR_NOT_SUPPORTED"
    assert result_name(int(driver.CUresult.CUDA_ERROR_LAUNCH_FAILED)) == "CUDA_ERROR_LAUNCH_FAILED"  # via bindings
    assert result_name(123456) == "CUresult(123456)"


def test_struct_defaults_are_zero() -> None:
    assert driver.CUcheckpointLockArgs().timeoutMs == 0
    args = driver.CUcheckpointRestoreArgs()
    assert args.gpuPairsCount == 0 and list(args.gpuPairs) == []


def test_build_restore_args_pairs_and_count() -> None:
    args = build_restore_args([(GPU_A, GPU_B), (GPU_B.upper(), GPU_A)])
    assert args.gpuPairsCount == 2
    pairs = list(args.gpuPairs)
    assert pairs[0].oldUuid.bytes == bytes.fromhex("5d0f3b7c1a2b3c4d5e6f0123456789ab")
    assert pairs[0].newUuid.bytes == bytes.fromhex("00112233445566778899aabbccddeeff")
    assert pairs[1].oldUuid.bytes == bytes.fromhex("00112233445566778899aabbccddeeff")
    empty = build_restore_args([])
    assert empty.gpuPairsCount == 0 and list(empty.gpuPairs) == []
    with pytest.raises(InvalidArgumentError):
        build_restore_args([(GPU_A, GPU_B), (GPU_A, GPU_A)])


# ---------------------------------------------------------------------------------------------- the driver class


def test_driver_constructs_without_side_effects() -> None:
    d = CudaDriver()
    assert d.driver_version is None and d.driver_version_string is None
    assert isinstance(d, CudaCheckpointApi)


@pytest.mark.skipif(_libcuda_loadable(), reason="host has libcuda.so.1")
def test_init_without_gpu_fails_cleanly() -> None:
    d = CudaDriver()
    with pytest.raises(FailedPreconditionError) as e:
        d.init()
    assert e.value.reason == "CUDA_DRIVER_MISSING"
    assert "libcuda.so.1" in e.value.message and ">= 570" in e.value.message
    with pytest.raises(FailedPreconditionError):  # every API call goes through init
        d.get_state(1)


class FakeBindings:
    """Real cuda.bindings structs, fake driver functions that record what they were given."""

    def __init__(self, *, init_result: int = 0, results: dict[str, int] | None = None) -> None:
        self.init_result = init_result
        self.results = results or {}
        self.calls: list[tuple[str, int, Any]] = []
        structs = [n for n in REQUIRED_BINDING_NAMES if not n.startswith("cu")]  # CU* types, not cu* functions
        for name in structs:
            setattr(self, name, getattr(driver, name))

    def _r(self, name: str) -> Any:
        return driver.CUresult(self.results.get(name, 0))

    def cuInit(self, flags: int) -> tuple[Any]:
        self.calls.append(("cuInit", flags, None))
        return (driver.CUresult(self.init_result),)

    def cuDriverGetVersion(self) -> tuple[Any, int]:
        return (driver.CUresult.CUDA_SUCCESS, 13000)

    def cuCheckpointProcessGetState(self, pid: int) -> tuple[Any, Any]:
        self.calls.append(("get_state", pid, None))
        return (self._r("get_state"), driver.CUprocessState.CU_PROCESS_STATE_CHECKPOINTED)

    def cuCheckpointProcessGetRestoreThreadId(self, pid: int) -> tuple[Any, int]:
        return (self._r("tid"), pid + 7)

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> tuple[Any]:
        self.calls.append(("lock", pid, args.timeoutMs))
        return (self._r("lock"),)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> tuple[Any]:
        assert isinstance(args, driver.CUcheckpointCheckpointArgs)
        self.calls.append(("checkpoint", pid, None))
        return (self._r("checkpoint"),)

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> tuple[Any]:
        pairs = [(p.oldUuid.bytes.hex(), p.newUuid.bytes.hex()) for p in args.gpuPairs]
        self.calls.append(("restore", pid, (args.gpuPairsCount, pairs)))
        return (self._r("restore"),)

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> tuple[Any]:
        assert isinstance(args, driver.CUcheckpointUnlockArgs)
        self.calls.append(("unlock", pid, None))
        return (self._r("unlock"),)


@pytest.fixture
def fake_bindings(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeBindings]:
    fake = FakeBindings()
    monkeypatch.setattr(cuda_mod, "_bindings", lambda: fake)
    yield fake


def test_driver_calls_with_fake_bindings(fake_bindings: FakeBindings) -> None:
    d = CudaDriver()
    assert d.get_state(42) == ProcessState.CHECKPOINTED
    assert d.driver_version == 13000 and d.driver_version_string == "13.0"
    assert d.get_restore_thread_id(42) == 49
    d.lock(42, 5000)
    d.checkpoint(42)
    d.restore(42)
    d.restore(42, [(GPU_A, GPU_B)])
    d.unlock(42)
    d.init()
    assert [c for c in fake_bindings.calls if c[0] == "cuInit"] == [("cuInit", 0, None)]  # once
    assert fake_bindings.calls[1:] == [
        ("get_state", 42, None),
        ("lock", 42, 5000),
        ("checkpoint", 42, None),
        ("restore", 42, (0, [])),
        ("restore", 42, (1, [("5d0f3b7c1a2b3c4d5e6f0123456789ab", "00112233445566778899aabbccddeeff")])),
        ("unlock", 42, None),
    ]


def test_driver_error_results(fake_bindings: FakeBindings) -> None:
    fake_bindings.results = {"checkpoint": 801, "lock": 401}
    d = CudaDriver()
    with pytest.raises(CudaError) as e:
        d.checkpoint(7)
    err = e.value
    assert isinstance(err, InternalError)
    assert (err.call, err.pid, err.result, err.result_name) == (
        "cuCheckpointProcessCheckpoint",
        7,
        801,
        "CUDA_ERROR_NOT_SUPPORTED",
    )
    assert err.reason == "CUDA_ERROR_NOT_SUPPORTED" and err.metadata["pid"] == "7"
    assert err.message.startswith("cuCheckpointProcessCheckpoint(pid=7) failed with CUDA_ERROR_NOT_SUPPORTED (801)")
    assert "driver >= 570" in err.message
    with pytest.raises(CudaError) as e:
        d.lock(7, 100)
    assert "timeoutMs=100" in e.value.message and "state" in e.value.remedy
    with pytest.raises(InvalidArgumentError):
        d.lock(7, -1)


def test_init_no_device_is_failed_precondition(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeBindings(init_result=100)
    monkeypatch.setattr(cuda_mod, "_bindings", lambda: fake)
    with pytest.raises(FailedPreconditionError) as e:
        CudaDriver().init()
    assert e.value.reason == "CUDA_ERROR_NO_DEVICE" and "no NVIDIA GPU" in e.value.message
    fake2 = FakeBindings(init_result=999)
    monkeypatch.setattr(cuda_mod, "_bindings", lambda: fake2)
    with pytest.raises(CudaError):
        CudaDriver().init()


def test_unknown_state_is_internal_error(fake_bindings: FakeBindings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake_bindings, "cuCheckpointProcessGetState", lambda pid: (driver.CUresult.CUDA_SUCCESS, 17))
    with pytest.raises(InternalError) as e:
        CudaDriver().get_state(3)
    assert e.value.reason == "CUDA_UNKNOWN_STATE"


def test_cuda_error_without_pid_and_unknown_result() -> None:
    err = CudaError("cuInit", None, 123456)
    assert err.message == "cuInit() failed with CUresult(123456) (123456)" and "pid" not in err.metadata
