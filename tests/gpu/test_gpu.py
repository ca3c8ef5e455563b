"""GPU checkpoint/restore on a real NVIDIA GPU (``make test-gpu``; skipped by ``make test``).

A PyTorch process holds N GiB with a known pattern and a captured CUDA graph. After dump → restore the
pattern's checksum matches and the graph replays; suspend frees its GPU memory while it lives on;
restore can move it onto another GPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import DaemonProc, criu_killed, phase_seconds, wait_for

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).resolve().parent / "torch_worker.py"
GIB = float(os.environ.get("GPUSNAP_TEST_GIB", "4"))


def _nvml_gpus() -> list[tuple[int, str]]:
    import pynvml

    pynvml.nvmlInit()
    return [
        (i, pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(pynvml.nvmlDeviceGetCount())
    ]


def _gpu_memory_of(pid: int) -> dict[str, int]:
    """NVML's view: GPU UUID -> bytes used by ``pid``."""
    import pynvml

    pynvml.nvmlInit()
    out: dict[str, int] = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == pid:
                out[pynvml.nvmlDeviceGetUUID(h)] = int(p.usedGpuMemory or 0)
    return out


@dataclass
class TorchWorker:
    workdir: Path
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expected(self) -> list[str]:
        return (self.workdir / "expected").read_text().split()

    def probe(self, pid: int) -> list[str]:
        """Ask the (possibly restored) process ``pid`` to re-read its GPU memory and replay its graph."""
        now = self.workdir / "now"
        now.unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR1)
        wait_for(now.exists, 120, "the worker did not answer the probe (GPU state lost?)")
        return now.read_text().split()

    def ticks(self) -> int:
        lines = (self.workdir / "ticks").read_text().split()
        return int(lines[-1]) if lines else 0


@pytest.fixture
def torch_worker(tmp_path: Path) -> Iterator[TorchWorker]:
    workers: list[TorchWorker] = []

    def start(gib: float = GIB, device: int = 0) -> TorchWorker:
        wd = tmp_path / f"torch{len(workers)}"
        wd.mkdir()
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(wd), "--gib", str(gib), "--device", str(device)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(wd / "stderr", "wb"),
            start_new_session=True,
        )
        w = TorchWorker(wd, proc)
        workers.append(w)
        wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 300, "torch worker did not start")
        assert proc.poll() is None, (wd / "stderr").read_text()
        return w

    yield start  # type: ignore[misc]
    for w in workers:
        for p in [w.pid, *_restored]:
            try:
                psutil.Process(p).kill()
            except psutil.Error:
                pass
        w.proc.wait(timeout=30)
    _restored.clear()


_restored: list[int] = []


def _dump_restore(daemon: DaemonProc, w: TorchWorker, *restore_args: str) -> tuple[dict, dict]:  # type: ignore[type-arg]
    dumped = json.loads(daemon.cli("-o", "json", "dump", str(w.pid), check=True, timeout=1800).stdout)
    assert w.proc.wait(timeout=60) == -signal.SIGKILL
    restored = json.loads(
        daemon.cli("-o", "json", "restore", dumped["id"], *restore_args, check=True, timeout=1800).stdout
    )
    _restored.append(restored["pid"])
    return dumped, restored


def test_gpu_round_trip(daemon: DaemonProc, torch_worker) -> None:  # type: ignore[no-untyped-def]
    w = torch_worker()
    expected = w.expected()
    before = w.probe(w.pid)
    assert before[:2] == expected
    held = _gpu_memory_of(w.pid)
    assert held and sum(held.values()) >= GIB * 2**30

    dumped, restored = _dump_restore(daemon, w)
    snap = json.loads(daemon.cli("-o", "json", "inspect", dumped["id"], check=True).stdout)
    assert snap["gpu_processes"][0]["pid"] == w.pid
    assert int(snap["gpu_processes"][0]["gpu_memory_bytes"]) >= GIB * 2**30
    assert snap["host"]["nvidia_driver_version"]
    assert int(snap["size_bytes"]) >= GIB * 2**30, "the images hold the GPU memory"
    assert {"gpu-lock", "gpu-checkpoint", "dump"} <= set(phase_seconds(dumped))
    assert {"restore", "gpu-restore", "gpu-unlock", "validate"} <= set(phase_seconds(restored))

    root = restored["pid"]
    after = w.probe(root)
    assert after[:2] == expected, "device memory and CUDA graph output survive dump and restore"
    assert _gpu_memory_of(root), "the restored process holds GPU memory again"
    ticks = w.ticks()
    wait_for(lambda: w.ticks() > ticks + 5, 60, "restored worker does not keep running its kernels")
    print(f"\nMEASURED gpu round trip {GIB} GiB: dump {dumped['phases']} restore {restored['phases']}")


def test_gpu_suspend_resume_in_place(daemon: DaemonProc, torch_worker) -> None:  # type: ignore[no-untyped-def]
    w = torch_worker()
    expected = w.expected()
    assert sum(_gpu_memory_of(w.pid).values()) >= GIB * 2**30
    res = json.loads(daemon.cli("-o", "json", "suspend", str(w.pid), check=True, timeout=900).stdout)
    assert res["suspend"]["gpu_processes"][0]["pid"] == w.pid
    held = sum(_gpu_memory_of(w.pid).values())
    assert held < 64 * 2**20, f"GPU memory not freed while suspended ({held} bytes held)"
    assert psutil.Process(w.pid).status() != psutil.STATUS_ZOMBIE
    res = json.loads(daemon.cli("-o", "json", "resume", str(w.pid), check=True, timeout=900).stdout)
    assert res["state"] == "succeeded"
    assert w.probe(w.pid)[:2] == expected
    assert sum(_gpu_memory_of(w.pid).values()) >= GIB * 2**30


def test_failed_dump_rolls_the_gpu_back(daemon: DaemonProc, torch_worker) -> None:  # type: ignore[no-untyped-def]
    """CRIU killed after the GPU was checkpointed: the worker is restored, unlocked and keeps computing."""
    w = torch_worker()
    expected = w.expected()
    with criu_killed(daemon.proc.pid, delay_s=0.3) as killed:
        res = daemon.cli("dump", str(w.pid), timeout=1800)
    assert killed and res.returncode != 0, res.stderr
    assert w.proc.poll() is None
    assert w.probe(w.pid)[:2] == expected
    assert sum(_gpu_memory_of(w.pid).values()) >= GIB * 2**30
    assert json.loads(daemon.cli("-o", "json", "ls", check=True).stdout) == []


def test_restore_onto_another_gpu(daemon: DaemonProc, torch_worker) -> None:  # type: ignore[no-untyped-def]
    gpus = _nvml_gpus()
    if len(gpus) < 2:
        pytest.skip("needs two GPUs (nvidia-h200-x2)")
    w = torch_worker(device=0)
    expected = w.expected()
    dumped, restored = _dump_restore(daemon, w, "--gpu-map", f"{gpus[0][1]}={gpus[1][1]}")
    root = restored["pid"]
    assert w.probe(root)[:2] == expected
    assert list(_gpu_memory_of(root)) == [gpus[1][1]], "the restored process runs on the second GPU"


def test_gpu_map_for_cpu_snapshot_is_refused(daemon: DaemonProc, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        snap = json.loads(daemon.cli("-o", "json", "dump", str(proc.pid), check=True).stdout)["id"]
        res = daemon.cli("restore", snap, "--gpu-map", "0=0")
        assert res.returncode == 2 and "holds no GPU state" in res.stderr
        node = json.loads(daemon.cli("-o", "json", "node", check=True).stdout)
        assert node["cuda_checkpoint_supported"] and node["gpus"][0]["uuid"].startswith("GPU-")
    finally:
        proc.kill()
        proc.wait()
