"""Preflight checks over plain facts."""

from __future__ import annotations

import pytest

from gpusnap.daemon.api.errors import FailedPreconditionError, ResourceExhaustedError
from gpusnap.daemon.drivers.nvml import GpuDevice
from gpusnap.daemon.preflight import gpu as pf

GIB = 1 << 30
U0 = "GPU-00000000-1111-2222-3333-444444444444"
U1 = "GPU-00000001-1111-2222-3333-444444444444"
SAFE_NCCL = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_CUMEM_HOST_ENABLE": "0",
}


def gpu(index: int, uuid: str, *, free_gib: int = 100, mig: bool = False) -> GpuDevice:
    return GpuDevice(index, uuid, "NVIDIA H200", 141 * GIB, free_gib * GIB, True, mig, "00000000:19:00.0")


def test_driver_version() -> None:
    pf.check_driver_version("570.86.15")
    pf.check_driver_version("580.159.04", remapping=True)
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_driver_version("560.35.03")
    assert e.value.reason == "NVIDIA_DRIVER_TOO_OLD" and "560.35.03" in e.value.message and ">= 570" in e.value.message
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_driver_version("575.51.03", remapping=True)
    assert ">= 580" in e.value.message and "original GPUs" in e.value.message
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_driver_version("")
    assert e.value.reason == "NVIDIA_DRIVER_UNKNOWN"
    assert pf.driver_major("595.71.05") == 595


def test_machine() -> None:
    pf.check_machine("x86_64")
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_machine("aarch64")
    assert e.value.reason == "ARCH_UNSUPPORTED" and "FC-15" in e.value.message


def test_mig() -> None:
    gpus = [gpu(0, U0), gpu(1, U1, mig=True)]
    pf.check_no_mig(gpus, [U0])
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_no_mig(gpus, [U0, U1.upper()])
    assert e.value.reason == "MIG_ENABLED" and U1 in e.value.message and "-mig 0" in e.value.message


def test_mps() -> None:
    pf.check_mps_inactive({}, pipe_dir_exists=False)
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_mps_inactive({"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"}, pipe_dir_exists=False, pid=7)
    assert e.value.reason == "MPS_ACTIVE" and "CUDA_MPS_PIPE_DIRECTORY=/run/mps" in e.value.message
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_mps_inactive({}, pipe_dir_exists=True)
    assert "/tmp/nvidia-mps" in e.value.message
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_mps_inactive({}, pipe_dir_exists=False, mps_daemon_running=True)
    assert "nvidia-cuda-mps-control" in e.value.message


def test_gpu_memory() -> None:
    gpus = [gpu(0, U0, free_gib=50)]
    pf.check_gpu_memory({U0: 50 * GIB}, gpus)
    with pytest.raises(ResourceExhaustedError) as e:
        pf.check_gpu_memory({U0: 50 * GIB}, gpus, headroom_bytes=1)
    assert e.value.reason == "GPU_MEMORY_INSUFFICIENT" and U0 in e.value.message
    assert e.value.metadata["gpus"] == U0 and e.value.metadata["missing_bytes"] == "1", "one byte short"
    with pytest.raises(FailedPreconditionError) as e2:
        pf.check_gpu_memory({U1: 1}, gpus)
    assert e2.value.reason == "GPU_NOT_FOUND"


def test_host_memory() -> None:
    pf.check_host_memory(20 * GIB, 16 * GIB)
    with pytest.raises(ResourceExhaustedError) as e:
        pf.check_host_memory(20 * GIB, 16 * GIB, image_bytes_in_ram=18 * GIB)
    assert e.value.reason == "HOST_MEMORY_INSUFFICIENT"
    assert "16.0 GiB of GPU memory" in e.value.message and "MemAvailable is 20.0 GiB" in e.value.message


def test_forbidden_devices_fc20() -> None:
    pf.check_no_forbidden_devices(1, ["/dev/null", "/dev/nvidia0", "/dev/gdrdrvx"])
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_no_forbidden_devices(42, ["/dev/null", "/dev/gdrdrv"])
    assert e.value.reason == "FORBIDDEN_DEVICE_OPEN" and "process 42" in e.value.message
    assert "gdrcopy" in e.value.message and "--external" in e.value.message
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_no_forbidden_devices(42, ["/dev/infiniband/uverbs0"])
    assert "NCCL_IB_DISABLE=1" in e.value.message


def test_nccl_env_fc05() -> None:
    pf.check_nccl_env(1, SAFE_NCCL)
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_nccl_env(9, {"NCCL_P2P_DISABLE": "1"})
    assert e.value.reason == "NCCL_ENV_UNSAFE"
    assert e.value.metadata["missing"] == "NCCL_NVLS_ENABLE=0,NCCL_SHM_DISABLE=1,NCCL_CUMEM_HOST_ENABLE=0"
    assert "FC-05" in e.value.message and "FC-06" in e.value.message and "configure_capture_env" in e.value.message
    pf.check_nccl_env(9, SAFE_NCCL, engine="vllm")  # not known to be tensor-parallel: no vLLM all-reduce rows
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_nccl_env(9, SAFE_NCCL, engine="vllm", tensor_parallel=2)
    assert e.value.metadata["missing"] == "VLLM_ALLREDUCE_USE_SYMM_MEM=0"
    pf.check_nccl_env(9, {**SAFE_NCCL, "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}, engine="vllm", tensor_parallel=2)
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_engine_args(9, ["vllm", "serve", "m", "-tp", "2"], engine="vllm", tensor_parallel=2)
    assert e.value.metadata["missing"] == "--disable-custom-all-reduce"
    pf.check_engine_args(
        9, ["vllm", "serve", "m", "-tp", "2", "--disable-custom-all-reduce"], engine="vllm", tensor_parallel=2
    )


def test_engine_and_tensor_parallel_from_argv() -> None:
    assert pf.engine_from_argv(["/venv/bin/vllm", "serve", "m"]) == "vllm"
    assert pf.engine_from_argv(["python", "-m", "vllm.entrypoints.openai.api_server"]) == "vllm"
    assert pf.engine_from_argv(["python", "-m", "sglang.launch_server"]) == "sglang"
    assert pf.engine_from_argv(["trtllm-serve", "m"]) == "trtllm"
    assert pf.engine_from_argv(["python", "serve.py", "--model", "vllm-model"]) is None
    assert pf.tensor_parallel_from_argv(["vllm", "serve", "m", "--tensor-parallel-size", "4"]) == 4
    assert pf.tensor_parallel_from_argv(["vllm", "serve", "m", "--tensor-parallel-size=2"]) == 2
    assert pf.tensor_parallel_from_argv(["x", "--tp-size", "8"]) == 8
    assert pf.tensor_parallel_from_argv(["x", "-tp", "junk"]) == 1
    assert pf.tensor_parallel_from_argv(["x", "--tp"]) == 1


def test_launch_job_fc07() -> None:
    pf.check_launch_job(1, {"CUDA_CHECKPOINT_JOB_FILE": "/proc/self/fd/5"})
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_launch_job(1, {})
    assert e.value.reason == "LAUNCH_JOB_MISSING" and "--launch-job" in e.value.message


def _capture(**kw: object) -> pf.CaptureFacts:
    base: dict[str, object] = dict(
        machine="x86_64",
        driver_version="580.159.04",
        gpus=[gpu(0, U0), gpu(1, U1)],
        gpu_uuids=[U0],
        cuda_pids=[10],
        env_by_pid={10: {}},
        open_paths_by_pid={10: ["/dev/nvidia0"], 11: ["/dev/null"]},
        mem_available_bytes=64 * GIB,
        gpu_bytes=16 * GIB,
    )
    base.update(kw)
    return pf.CaptureFacts(**base)  # type: ignore[arg-type]


def test_check_capture_ok_and_single_failure() -> None:
    pf.check_capture(_capture())
    pf.check_capture(_capture(cuda_pids=[10, 11], env_by_pid={10: SAFE_NCCL, 11: SAFE_NCCL}))
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_capture(_capture(open_paths_by_pid={11: ["/dev/gdrdrv"]}))
    assert e.value.reason == "FORBIDDEN_DEVICE_OPEN"
    with pytest.raises(ResourceExhaustedError):
        pf.check_capture(_capture(mem_available_bytes=8 * GIB))


def test_check_capture_reports_every_failure() -> None:
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_capture(_capture(machine="aarch64", driver_version="550.1", cuda_pids=[10, 11], env_by_pid={}))
    assert e.value.reason == "PREFLIGHT_FAILED"
    reasons = e.value.metadata["reasons"].split(",")
    assert reasons[:2] == ["ARCH_UNSUPPORTED", "NVIDIA_DRIVER_TOO_OLD"]
    assert "NCCL_ENV_UNSAFE" in reasons and "LAUNCH_JOB_MISSING" not in reasons  # launch-job only on request
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_capture(
            _capture(cuda_pids=[10, 11], env_by_pid={10: SAFE_NCCL, 11: SAFE_NCCL}, require_launch_job=True)
        )
    assert e.value.metadata["reasons"] == "LAUNCH_JOB_MISSING,LAUNCH_JOB_MISSING"
    # no NCCL requirements when the tree has one CUDA process
    pf.check_capture(_capture(cuda_pids=[10], env_by_pid={}))


def test_check_restore() -> None:
    gpus = [gpu(0, U0, free_gib=10), gpu(1, U1)]
    facts = pf.RestoreFacts(
        machine="x86_64", driver_version="575.1.1", gpus=gpus, gpu_map={U0: U0}, required_free_bytes={U0: 5 * GIB}
    )
    pf.check_restore(facts)
    with pytest.raises(FailedPreconditionError) as e:  # remapping on 575
        pf.check_restore(
            pf.RestoreFacts(
                machine="x86_64",
                driver_version="575.1.1",
                gpus=gpus,
                gpu_map={U0: U1},
                required_free_bytes={U0: 5 * GIB},
            )
        )
    assert e.value.reason == "NVIDIA_DRIVER_TOO_OLD"
    with pytest.raises(ResourceExhaustedError):
        pf.check_restore(
            pf.RestoreFacts(
                machine="x86_64",
                driver_version="580.1",
                gpus=gpus,
                gpu_map={U0: U0},
                required_free_bytes={U0: 20 * GIB},
            )
        )
