"""A buffer-offload worker between two nodes: the PyTorch CPU worker (tests/adapters/torch_cpu_worker.py)
names its weights, node A dumps and pushes it, node B restores it from the remote store alone, and it
gives the same tokens. A second snapshot of the same weights uploads no buffer bytes.

The nodes share one agent socket path, as real nodes do (/run/gpusnap/agent.sock on each): node A is
stopped before node B starts, so the restored worker's agent finds node B where it found node A."""

from __future__ import annotations

import os
from pathlib import Path

from tests.adapters import torch_venv
from tests.adapters.test_buffers_cpu import MIB, WEIGHT_BYTES, WORKER, Worker
from tests.conftest import DaemonProc, kill_tree, phase_seconds, stop_daemon, wait_for
from tests.daemon.remote.fleet import Fleet, cli_json

pytestmark = torch_venv.needs_venv


class NodeWorker(Worker):
    def __init__(self, node: DaemonProc, tmp: Path, name: str, agent_socket: Path):  # noqa: D107
        self.wd = tmp / name
        self.wd.mkdir()
        env = torch_venv.worker_env(node, tmp, GPUSNAP_AGENT_SOCKET=str(agent_socket))
        self.proc = torch_venv.start(WORKER, [str(self.wd), "--mib", str(MIB)], env, self.wd / "out")
        wait_for(lambda: (self.wd / "ready").exists() or self.proc.poll() is not None, 120, "worker did not start")
        assert self.proc.poll() is None, (self.wd / "out").read_text()[-3000:]
        self.n = 0


def test_weights_travel_once_and_the_worker_serves_on_node_b(fleet: Fleet, tmp_path: Path) -> None:
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    os.chmod(agent_dir, 0o755)
    agent = agent_dir / "agent.sock"
    a = fleet.node("a", GPUSNAP_AGENT_SOCKET=str(agent))
    w = NodeWorker(a, tmp_path, "w", agent)
    other = NodeWorker(a, tmp_path, "other", agent)  # same seed: the same weights
    pids = [w.proc.pid, other.proc.pid]
    try:
        before = w.generate()
        first = cli_json(a, "dump", str(w.proc.pid), "--name", "w")
        assert first["buffer_bytes"] == WEIGHT_BYTES
        pushed = cli_json(a, "push", "w")
        assert pushed["buffer_transferred_bytes"] == WEIGHT_BYTES, pushed

        second = cli_json(a, "dump", str(other.proc.pid))
        again = cli_json(a, "push", second["id"])
        assert again["buffer_transferred_bytes"] == 0, "the same weights are in the bucket already"
        assert again["skipped_bytes"] >= WEIGHT_BYTES
        stop_daemon(a)

        b = fleet.node("b", GPUSNAP_AGENT_SOCKET=str(agent))
        assert cli_json(b, "ls") == []
        restored = cli_json(b, "restore", "w", timeout=600)  # only in the remote store: pulled first
        pids.append(restored["pid"])
        assert list(phase_seconds(restored))[:3] == ["preflight", "download", "publish"]
        assert list(phase_seconds(restored))[-2:] == ["reload-buffers", "resume-worker"]
        assert w.generate() == before, "identical tokens from the weights that came through the bucket"
        blobs = [p for p in (b.store / "buffers" / "sha256").rglob("*") if p.is_file()]
        assert sum(p.stat().st_size for p in blobs) == WEIGHT_BYTES
    finally:
        kill_tree(*pids)
