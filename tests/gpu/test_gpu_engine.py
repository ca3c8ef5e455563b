"""A transformers Llama-style model (random bf16 weights, ~1.1B parameters) served by a small generation
loop through the PyTorch adapter: the same greedy tokens after dump and restore."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DaemonProc, kill_tree, phase_seconds, wait_for

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).resolve().parent / "llm_worker.py"


def start_llm(daemon: DaemonProc, wd: Path, size: str = "1b", *args: str) -> subprocess.Popen[bytes]:
    wd.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "GPUSNAP_AGENT_SOCKET": str(daemon.agent_socket),
        "GPUSNAP_WAKE_DIR": str(wd.parent / "wake"),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(wd), "--size", size, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=open(wd / "out", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 600, "LLM worker did not start")
    assert proc.poll() is None, (wd / "out").read_text()[-3000:]
    return proc


def request(wd: Path, n: int, timeout: float = 120, tokens: int = 16) -> dict:  # type: ignore[type-arg]
    """Ask for generation ``n`` (``tokens`` greedy tokens); returns {"tokens", "t_done"}."""
    go = wd / f"go-{n}"
    go.with_suffix(".tmp").write_text(str(tokens))
    go.with_suffix(".tmp").rename(go)
    wait_for((wd / f"tokens-{n}").exists, timeout, f"no answer to request {n}")
    return json.loads((wd / f"tokens-{n}").read_text())  # type: ignore[no-any-return]


def dump_offload_restore(daemon: DaemonProc, proc: subprocess.Popen[bytes], ready: dict) -> tuple[dict, dict, int]:  # type: ignore[type-arg]
    """Dump ``proc`` with its weights offloaded, check they left the image and the GPU, restore it.

    Returns:
        (dump result, restore result, the worker's GPU bytes at capture).
    """
    dumped = json.loads(daemon.cli("-o", "json", "dump", str(proc.pid), check=True, timeout=900).stdout)
    assert {"warm-up", "quiesce", "offload", "gpu-checkpoint", "dump"} <= set(phase_seconds(dumped))
    assert dumped["buffer_bytes"] >= 2 * ready["params"], "the bf16 weights left the image"
    snap = json.loads(daemon.cli("-o", "json", "inspect", dumped["id"], check=True).stdout)
    at_capture = int(snap["gpu_processes"][0]["gpu_memory_bytes"])
    assert at_capture < dumped["buffer_bytes"], f"{at_capture} bytes on the GPU at capture: the weights stayed"
    assert proc.wait(timeout=60) == -9
    restored = json.loads(daemon.cli("-o", "json", "restore", dumped["id"], check=True, timeout=900).stdout)
    assert list(phase_seconds(restored))[-2:] == ["reload-buffers", "resume-worker"]
    return dumped, restored, at_capture


def test_llm_worker_same_tokens_after_restore(daemon: DaemonProc, tmp_path: Path) -> None:
    wd = tmp_path / "llm"
    proc = start_llm(daemon, wd)
    restored_pid = 0
    try:
        ready = json.loads((wd / "ready").read_text())
        assert ready["params"] > 1.0e9
        before = request(wd, 1)["tokens"]
        assert len(before) == 16
        dumped, restored, at_capture = dump_offload_restore(daemon, proc, ready)
        restored_pid = restored["pid"]
        after = request(wd, 2)["tokens"]
        assert after == before, "identical greedy tokens after restore"
        assert request(wd, 3)["tokens"] == before, "and it keeps serving"
        print(f"\nMEASURED llm 1b: dump {dumped['phases']} restore {restored['phases']}")
    finally:
        kill_tree(proc.pid, restored_pid)


def test_llm_with_cuda_graph_same_tokens_after_offload_restore(daemon: DaemonProc, tmp_path: Path) -> None:
    """The decode step is a CUDA graph over the named weights (in VMM arenas): the capture offloads them,
    the restore re-maps them at the same addresses, and the graph replays to the same greedy tokens."""
    wd = tmp_path / "llm-graphs"
    proc = start_llm(daemon, wd, "1b", "--graphs")
    restored_pid = 0
    try:
        ready = json.loads((wd / "ready").read_text())
        assert ready["graph_tokens"] == ready["eager_tokens"], "the captured graph decodes like the eager model"
        before = request(wd, 1)["tokens"]
        assert before == ready["graph_tokens"]
        dumped, restored, at_capture = dump_offload_restore(daemon, proc, ready)
        restored_pid = restored["pid"]
        assert request(wd, 2)["tokens"] == before, "the graph replays over the reloaded weights: same tokens"
        assert request(wd, 3)["tokens"] == before, "and it keeps serving"
        print(
            f"\nMEASURED llm 1b graphs: gpu at capture {at_capture} B; dump {dumped['phases']} "
            f"restore {restored['phases']}"
        )
    finally:
        kill_tree(proc.pid, restored_pid)
