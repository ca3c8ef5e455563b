"""What an agent's command results report, read by AgentClient the same way from protocol 3's fields and
protocol 2's ``details`` strings (agent.proto's header: the agents inside snapshots taken before 3), and
bounded either way: the agent is not trusted."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from gpusnap.adapters.contract import wire
from gpusnap.adapters.contract._proto import agent_pb2
from gpusnap.daemon.workers.agents import AgentInfo, AgentSession
from gpusnap.daemon.workers.client import AgentClient

Answer = Callable[[agent_pb2.DaemonMessage], agent_pb2.CommandResult]


def _client(protocol: int, answer: Answer) -> Iterator[AgentClient]:
    ours, theirs = socket.socketpair()
    info = AgentInfo(pid=1, uid=0, engine="test", instance_id="0" * 32, wake_dir="/", resumed=True, protocol=protocol)

    def agent() -> None:
        try:
            while True:
                msg = wire.recv(theirs, agent_pb2.DaemonMessage())
                result = answer(msg)
                result.command_id, result.ok = msg.command_id, True
                wire.send(theirs, agent_pb2.AgentMessage(result=result))
        except wire.ChannelClosed:
            pass

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    try:
        yield AgentClient(AgentSession(ours, info))
    finally:
        ours.close()
        thread.join(5)
        theirs.close()


def _v3(msg: agent_pb2.DaemonMessage) -> agent_pb2.CommandResult:
    kind = msg.WhichOneof("command")
    if kind in ("warm_up", "resume"):
        return agent_pb2.CommandResult(tokens=[1, 7, 9], timings=agent_pb2.Timings(resume=0.25, canary=0.5))
    if kind == "quiesce":
        return agent_pb2.CommandResult(released_bytes=1 << 30)
    return agent_pb2.CommandResult(timings=agent_pb2.Timings(copy=1.5, alloc=0.25, map=float("nan")))


def _v2(msg: agent_pb2.DaemonMessage) -> agent_pb2.CommandResult:
    kind = msg.WhichOneof("command")
    if kind in ("warm_up", "resume"):
        return agent_pb2.CommandResult(details={"tokens": "1,7,9", "resume_s": "0.2500", "canary_s": "0.5000"})
    if kind == "quiesce":
        return agent_pb2.CommandResult(details={"released_bytes": str(1 << 30)})
    return agent_pb2.CommandResult(details={"copy_s": "1.500", "alloc_s": "0.250", "map_s": "nan", "pid": "x"})


@pytest.mark.parametrize(("protocol", "answer"), [(3, _v3), (2, _v2)])
def test_results_read_alike_in_both_protocols(protocol: int, answer: Answer) -> None:
    for client in _client(protocol, answer):
        assert client.warm_up(5) == "1,7,9"
        assert client.quiesce(False, 5) == [] and client.released_bytes == 1 << 30
        moved = client.reload(["w"], [], 5)
        assert dict(moved.timings) == {"copy": 1.5, "alloc": 0.25}, "a NaN and unknown keys are not believed"
        assert client.resume(5, restored=False) == "1,7,9"


def test_an_agent_s_byte_count_beyond_int64_reads_as_nothing() -> None:
    def huge(msg: agent_pb2.DaemonMessage) -> agent_pb2.CommandResult:
        return agent_pb2.CommandResult(released_bytes=(1 << 64) - 1)

    for client in _client(3, huge):
        client.quiesce(False, 5)
        assert client.released_bytes == 0
