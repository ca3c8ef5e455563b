"""AgentSession.peer_open while another thread is in a call on the same session: the registry asks it under
its lock (find_all, wait_for, every hello), so it must answer at once rather than wait out the call's timeout
(seen with two scheduler agents of one SGLang engine resumed in parallel: one's hello waited for the other)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from gpusnap.adapters.contract._proto import agent_pb2
from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.workers.agents import AgentInfo, AgentSession

CALL_TIMEOUT_S = 60.0


def test_peer_open_during_a_call_answers_at_once() -> None:
    ours, agent = socket.socketpair()
    info = AgentInfo(pid=1, uid=0, engine="test", instance_id="0" * 32, wake_dir="/", resumed=True)
    session = AgentSession(ours, info)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            session.call(agent_pb2.DaemonMessage(health=agent_pb2.Health()), CALL_TIMEOUT_S, "answer")
        except BaseException as exc:
            errors.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        agent.recv(1)  # the command reached the agent, which does not answer yet: the call is waiting
        start = time.monotonic()
        assert session.peer_open(), "an agent in a call is open"
        assert time.monotonic() - start < CALL_TIMEOUT_S / 4, "peer_open waited on the call's timeout"
    finally:
        agent.close()  # the call then sees the agent go away
        caller.join(10)
    assert not caller.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], FailedPreconditionError), errors
    assert not session.peer_open(), "a session whose agent went away is not open"
    ours.close()


@pytest.mark.parametrize("closed", [False, True])
def test_peer_open_idle(closed: bool) -> None:
    ours, agent = socket.socketpair()
    info = AgentInfo(pid=1, uid=0, engine="test", instance_id="0" * 32, wake_dir="/", resumed=True)
    session = AgentSession(ours, info)
    if closed:
        agent.close()
    assert session.peer_open() is not closed
    ours.close()
    agent.close()
