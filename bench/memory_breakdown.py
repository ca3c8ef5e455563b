"""What the GPU memory a capture leaves to the CUDA checkpoint is made of, for make bench-gpu-vllm (issue 29).

Three sources, put side by side per process:

- NVML's per-process figure at the capture (``gpusnap inspect``'s ``gpu_processes``: what the CUDA checkpoint
  copies);
- the worker's own report, written by its agent just before the checkpoint (``GPUSNAP_MEMORY_REPORT_DIR``,
  ``gpusnap.adapters.memory_report``): torch's caching allocator per pool (``torch.cuda.memory_snapshot()``), the
  allocated blocks by who holds them, gpusnap's arenas still mapped;
- the floor of a CUDA context, measured apart in a fresh process with the engine's torch: after its first
  kernel (``torch.zeros``), then after a bf16 matmul (cuBLAS loaded).

``rest_bytes`` = NVML − torch's pools outside arenas − arenas still mapped: the context, kernel modules and
library state, which only the driver holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpusnap.adapters import memory_report

FLOOR = """
import sys, time, torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize(); print("context", flush=True); sys.stdin.readline()
a = torch.ones(256, 256, device="cuda", dtype=torch.bfloat16); (a @ a).sum().item(); print("cublas", flush=True)
sys.stdin.readline()
"""


def nvml_used(pid: int) -> int:
    """GPU memory NVML counts for ``pid`` on any GPU (0 where it holds none)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        total = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == pid and p.usedGpuMemory:
                    total += int(p.usedGpuMemory)
        return total
    finally:
        pynvml.nvmlShutdown()


def context_floor(env: dict[str, str]) -> dict[str, int]:
    """NVML's figure for a fresh process of the engine's torch (``env``'s ``PYTHONPATH``): ``context_bytes``
    after its first kernel, ``cublas_bytes`` after a bf16 matmul."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOR], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    out: dict[str, int] = {}
    try:
        for step in ("context", "cublas"):
            line = proc.stdout.readline().strip()
            if line != step:
                raise SystemExit(f"the context probe said {line!r}, not {step!r}")
            time.sleep(0.5)  # NVML's accounting follows the allocation
            out[f"{step}_bytes"] = nvml_used(proc.pid)
            proc.stdin.write("\n")
            proc.stdin.flush()
    finally:
        proc.kill()
        proc.wait()
    return out


def reports(directory: Path) -> list[dict[str, Any]]:
    """The workers' reports (``<pid>.json``) in ``directory``."""
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def combine(found: list[dict[str, Any]], snapshot: dict[str, Any], floor: dict[str, int]) -> dict[str, Any]:
    """Per process that held GPU memory at the capture (``snapshot``: ``gpusnap inspect -o json``): NVML's bytes,
    torch's pools outside arenas, arenas still mapped, the rest, the owners of torch's blocks; and the floor."""
    by_pid = {int(r["pid"]): r for r in found if r.get("cuda")}
    rows = []
    for g in snapshot.get("gpu_processes", []):
        pid, used = int(g["pid"]), int(g["gpu_memory_bytes"])
        r = by_pid.get(pid)
        row: dict[str, Any] = {"pid": pid, "nvml_bytes": used, "report": r is not None}
        if r is not None:
            pools = r["torch"]["pools"]
            torch_bytes = sum(int(p["reserved_bytes"]) for p in pools.values() if not p["arenas"])
            arenas = int(r["arenas"]["mapped_bytes"])
            row.update(
                torch_pools_bytes=torch_bytes,
                torch_free_bytes=sum(int(p["free_bytes"]) for p in pools.values() if not p["arenas"]),
                arenas_mapped_bytes=arenas,
                rest_bytes=used - torch_bytes - arenas,
                by_owner=r["by_owner"],
                unattributed_bytes=r["unattributed_bytes"],
                largest_blocks=r["blocks"][:20],
                pools=pools,
                stats=r["torch"]["stats"],
                report_s=r.get("report_s"),
            )
        rows.append(row)
    return {"processes": rows, "cuda_floor": floor}


def request(directory: Path) -> None:
    """Ask the workers for a report at the next capture."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / memory_report.REQUEST).touch()


def withdraw(directory: Path) -> None:
    (directory / memory_report.REQUEST).unlink(missing_ok=True)


def env_for(directory: Path) -> dict[str, str]:
    """The server's environment entry that makes its agents report (when asked)."""
    return {memory_report.ENV: str(directory)}


def engine_env(site: Path) -> dict[str, str]:
    """An environment whose Python finds the engine's torch at ``site``."""
    return {**os.environ, "PYTHONPATH": str(site)}
