"""Agents report their process's capture settings in the hello; the registry hands them to the preflight."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

from gpusnap.adapters.contract import wire
from gpusnap.adapters.contract._proto import agent_pb2
from gpusnap.daemon.workers.agents import AgentRegistry, agent_info
from tests.conftest import wait_for


def _hello(registry: AgentRegistry, tmp_path: Path, hello: agent_pb2.AgentHello) -> dict[int, dict[str, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert registry.capture_env([os.getpid()]) == {}
        sock.connect(str(tmp_path / "agent.sock"))
        wire.send(sock, agent_pb2.AgentMessage(hello=hello))
        wait_for(lambda: registry.find([os.getpid()]) is not None, 10, "agent did not attach")
        return registry.capture_env([1, os.getpid()])
    finally:
        sock.close()
        wait_for(lambda: registry.find([os.getpid()]) is None, 10, "agent did not leave")


def test_registry_returns_reported_settings_by_pid(tmp_path: Path) -> None:
    """Protocol 3's ``capture_env``, and protocol 2's ``info`` keys ``capture_env.NAME`` (agents inside snapshots
    taken before 3): the table's names only."""
    registry = AgentRegistry(tmp_path / "agent.sock")
    registry.start()
    env = {"NCCL_SHM_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "HOME": "/root"}
    want = {os.getpid(): {"NCCL_SHM_DISABLE": "1", "NCCL_P2P_DISABLE": "1"}}
    try:
        hello = agent_pb2.AgentHello(
            protocol_version=wire.PROTOCOL_VERSION,
            engine="toy",
            instance_id="0" * 32,
            wake_dir=str(tmp_path),
            info={"model": "m"},
            capture_env={**env, "LD_PRELOAD": "/evil.so"},
        )
        assert _hello(registry, tmp_path, hello) == want
        v2 = agent_pb2.AgentHello(
            protocol_version=2,
            engine="toy",
            instance_id="1" * 32,
            wake_dir=str(tmp_path),
            info={
                "model": "m",
                "role": "frontend",
                "expect_pids": "12,x,13",
                **{f"capture_env.{k}": v for k, v in env.items()},
                "capture_env.LD_PRELOAD": "/evil.so",
            },
        )
        assert _hello(registry, tmp_path, v2) == want
    finally:
        registry.stop()


def test_a_protocol_2_hello_reads_as_protocol_3_s() -> None:
    """What agents of protocol 2 said in ``info`` lands in the same fields as protocol 3's."""
    v2 = agent_pb2.AgentHello(
        protocol_version=2,
        engine="vllm",
        instance_id="ab" * 16,
        wake_dir="/w",
        info={"role": "frontend", "process": "VLLM::APIServer", "expect_pids": "12,13", "weights": "w", "dp": "1"},
    )
    v3 = agent_pb2.AgentHello(
        protocol_version=3,
        engine="vllm",
        instance_id="ab" * 16,
        wake_dir="/w",
        info={"dp": "1"},
        role="frontend",
        process="VLLM::APIServer",
        expect_pids=[12, 13, -1],
        weights="w",
    )
    old, new = agent_info(v2, 7, 1000, 1.5), agent_info(v3, 7, 1000, 1.5)
    assert old.protocol == 2 and new.protocol == 3
    assert dataclasses.replace(old, protocol=3) == new
    assert new.expect_pids == (12, 13) and new.label == "vllm process VLLM::APIServer (PID 7)"
