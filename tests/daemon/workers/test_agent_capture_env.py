"""Agents report their process's capture settings in the hello; the registry hands them to the preflight."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from gpusnap.adapters.contract import capture_settings, wire
from gpusnap.adapters.contract._proto import agent_pb2
from gpusnap.daemon.workers.agents import AgentRegistry
from tests.conftest import wait_for


def test_registry_returns_reported_settings_by_pid(tmp_path: Path) -> None:
    registry = AgentRegistry(tmp_path / "agent.sock")
    registry.start()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert registry.capture_env([os.getpid()]) == {}
        sock.connect(str(tmp_path / "agent.sock"))
        env = {"NCCL_SHM_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "HOME": "/root"}
        hello = agent_pb2.AgentHello(
            protocol_version=wire.PROTOCOL_VERSION,
            engine="toy",
            instance_id="0" * 32,
            wake_dir=str(tmp_path),
            info={"model": "m", **capture_settings.report(env), "capture_env.LD_PRELOAD": "/evil.so"},
        )
        wire.send(sock, agent_pb2.AgentMessage(hello=hello))
        wait_for(lambda: registry.find([os.getpid()]) is not None, 10, "agent did not attach")
        assert registry.capture_env([1, os.getpid()]) == {
            os.getpid(): {"NCCL_SHM_DISABLE": "1", "NCCL_P2P_DISABLE": "1"}
        }
    finally:
        sock.close()
        registry.stop()
