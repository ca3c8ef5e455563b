"""The one table of capture settings: the helper and the preflight agree for every process layout.

Layouts are built as fake ``/proc`` trees (environ and cmdline files) the way a worker configured as the
README says would look, and go through the real fact readers and ``check_capture``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpusnap.adapters import configure_capture_env
from gpusnap.adapters.contract import capture_settings as cs
from gpusnap.adapters.env import CAPTURE_ENV
from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.drivers import procfs
from gpusnap.daemon.drivers.nvml import GpuDevice
from gpusnap.daemon.preflight import gpu as pf
from tests.fakes.cuda import FakeProc

GIB = 1 << 30
U0 = "GPU-00000000-1111-2222-3333-444444444444"
U1 = "GPU-00000001-1111-2222-3333-444444444444"
VLLM_TP2 = ["/venv/bin/vllm", "serve", "/models/llama", "--tensor-parallel-size", "2"]


def _gpus() -> list[GpuDevice]:
    return [
        GpuDevice(i, u, "NVIDIA H200", 141 * GIB, 100 * GIB, True, False, f"00000000:1{i}:00.0")
        for i, u in enumerate((U0, U1))
    ]


def _preflight(proc: FakeProc, cuda_pids: list[int], all_pids: list[int], reported: dict[int, dict[str, str]]) -> None:
    """What ``preflight.gpu.check_tree`` gathers, read from the fake tree."""
    pf.check_capture(
        pf.CaptureFacts(
            machine="x86_64",
            driver_version="580.159.04",
            gpus=_gpus(),
            gpu_uuids=[U0, U1],
            cuda_pids=cuda_pids,
            env_by_pid={p: procfs.effective_environ(p, reported.get(p, {}), proc.root) for p in cuda_pids},
            open_paths_by_pid={p: procfs.open_paths(p, proc.root) for p in all_pids},
            cmdline_by_pid={p: procfs.read_cmdline(p, proc.root) for p in all_pids},
            mem_available_bytes=64 * GIB,
            gpu_bytes=2 * GIB,
        )
    )


def _configured(**kw: object) -> dict[str, str]:
    env = {"PATH": "/usr/bin"}
    configure_capture_env(env, **kw)  # type: ignore[arg-type]
    return env


def test_table_rows_are_complete_and_unique() -> None:
    names = [s.name for s in cs.CAPTURE_SETTINGS]
    assert len(names) == len(set(names))
    for s in cs.CAPTURE_SETTINGS:
        assert s.reason and not s.reason.endswith("."), s
        assert all(re.fullmatch(r"FC-\d\d", fc) for fc in s.failure_cases), s
        assert (s.kind is cs.Kind.ENGINE_ARG) == bool(s.engine_field), s
        assert s.engine in (None, "vllm", "sglang", "trtllm"), s
    # the helper's public mapping is the table's environment rows, nothing else
    assert CAPTURE_ENV == {s.name: (s.value, s.reason) for s in cs.CAPTURE_SETTINGS if s.kind is cs.Kind.ENV}
    # preflight names what FC-05/FC-06 ask for
    multi = {s.requirement() for s in cs.settings([cs.Scope.MULTI_PROCESS])}
    assert multi == {"NCCL_P2P_DISABLE=1", "NCCL_NVLS_ENABLE=0", "NCCL_SHM_DISABLE=1", "NCCL_CUMEM_HOST_ENABLE=0"}


def test_helper_keeps_existing_values_and_rejects_bad_sizes() -> None:
    env = {"NCCL_SHM_DISABLE": "0"}
    changed = configure_capture_env(env)
    assert env["NCCL_SHM_DISABLE"] == "0" and "NCCL_SHM_DISABLE" not in changed
    assert changed["NCCL_P2P_DISABLE"] == "1" and "VLLM_ALLREDUCE_USE_SYMM_MEM" not in changed
    assert configure_capture_env(env) == {}
    assert configure_capture_env(env, tensor_parallel=2) == {
        "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
        "TLLM_NCCL_SYMMETRIC_ZERO_COPY": "0",
    }
    only_vllm = _configured(tensor_parallel=2, engine="vllm")
    assert "VLLM_ALLREDUCE_USE_SYMM_MEM" in only_vllm and "TLLM_NCCL_SYMMETRIC_ZERO_COPY" not in only_vllm
    with pytest.raises(ValueError):
        configure_capture_env({}, tensor_parallel=0)
    assert cs.engine_args("vllm", tensor_parallel=2) == {"disable_custom_all_reduce": "--disable-custom-all-reduce"}
    assert cs.engine_args("vllm") == {} and cs.engine_args("sglang", tensor_parallel=2) == {}
    # the user's conflicting value is what preflight then names
    with pytest.raises(FailedPreconditionError) as e:
        pf.check_nccl_env(5, env)
    assert e.value.metadata["missing"] == "NCCL_SHM_DISABLE=1"


def test_single_process_passes_without_settings(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    proc.add(10, fds=["/dev/nvidia0"], env={"PATH": "/usr/bin"})
    _preflight(proc, [10], [10], {})


def test_front_end_and_worker_configured_in_process(tmp_path: Path) -> None:
    """The README's layout: the front end calls configure_capture_env() itself and starts a CUDA worker.

    The front end's /proc environ is its exec-time environment (without the settings); its agent reports
    them. The worker inherited them at exec.
    """
    proc = FakeProc(tmp_path / "proc")
    proc.add(10, fds=["/dev/nvidia0"], env={"PATH": "/usr/bin"}, cmdline=["python", "serve.py"])
    proc.add(11, fds=["/dev/nvidia0"], env=_configured(), cmdline=["python", "-c", "spawn_main()"])
    agent_hello = cs.report(_configured())
    _preflight(proc, [10, 11], [10, 11], {10: cs.reported(agent_hello)})
    with pytest.raises(FailedPreconditionError) as e:  # without the agent's report: the exec-time view
        _preflight(proc, [10, 11], [10, 11], {})
    assert e.value.reason == "NCCL_ENV_UNSAFE" and e.value.metadata["pid"] == "10"


def test_data_parallel_two_ranks(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    proc.add(20, env=_configured(), cmdline=["vllm", "serve", "m", "--data-parallel-size", "2"])
    proc.add(21, fds=["/dev/nvidia0"], env=_configured())
    proc.add(22, fds=["/dev/nvidia1"], env=_configured())
    _preflight(proc, [21, 22], [20, 21, 22], {})
    proc.add(22, fds=["/dev/nvidia1"], env={"PATH": "/usr/bin"})  # a rank started outside the helper
    with pytest.raises(FailedPreconditionError) as e:
        _preflight(proc, [21, 22], [20, 21, 22], {})
    assert e.value.metadata["pid"] == "22" and "NCCL_P2P_DISABLE=1" in e.value.metadata["missing"]
    assert "launch-job" not in e.value.message


def test_vllm_tensor_parallel(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    proc.add(30, env=_configured(), cmdline=VLLM_TP2)
    for pid in (31, 32):
        proc.add(pid, fds=[f"/dev/nvidia{pid - 31}"], env=_configured())
    with pytest.raises(FailedPreconditionError) as e:  # configured without tensor_parallel=2, no engine flag
        _preflight(proc, [31, 32], [30, 31, 32], {})
    assert e.value.reason == "PREFLIGHT_FAILED"
    assert "VLLM_ALLREDUCE_USE_SYMM_MEM=0" in e.value.message and "--disable-custom-all-reduce" in e.value.message
    for pid in (30, 31, 32):
        proc.add(pid, fds=[f"/dev/nvidia{max(pid - 31, 0)}"], env=_configured(tensor_parallel=2), cmdline=VLLM_TP2)
    with pytest.raises(FailedPreconditionError) as e:
        _preflight(proc, [31, 32], [30, 31, 32], {})
    assert e.value.metadata["missing"] == "--disable-custom-all-reduce" and e.value.metadata["pid"] == "30"
    proc.add(30, env=_configured(tensor_parallel=2), cmdline=[*VLLM_TP2, "--disable-custom-all-reduce"])
    _preflight(proc, [31, 32], [30, 31, 32], {})


def test_report_carries_only_table_names() -> None:
    hello = cs.report({"NCCL_P2P_DISABLE": "1", "AWS_SECRET_ACCESS_KEY": "x", "PATH": "/bin"})
    assert hello == {"NCCL_P2P_DISABLE": "1"}
    assert cs.reported({**hello, "LD_PRELOAD": "/x.so", "model": "m"}) == {"NCCL_P2P_DISABLE": "1"}
