"""Run as a hostile user: attach an agent, then let its PID go while a child keeps the connection.

    python stale_agent.py AGENT_SOCKET

Prints the PID the daemon knows the agent by and exits once the daemon has had time to read the hello;
the child (in a session of its own, stdio closed) keeps the connected socket and answers the first
command it gets with a failure that names it, then lingers a few seconds.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from gpusnap.adapters.contract import wire
from gpusnap.adapters.contract._proto import agent_pb2

s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
hello = agent_pb2.AgentHello(
    protocol_version=wire.PROTOCOL_VERSION, engine="torch", instance_id="cd" * 16, wake_dir="/tmp"
)
wire.send(s, agent_pb2.AgentMessage(hello=hello))
time.sleep(1.0)  # the daemon has read the hello: the session is this PID's
if os.fork() == 0:
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    s.settimeout(60)
    try:
        msg, fds = wire.recv_with_fds(s, agent_pb2.DaemonMessage())
        result = agent_pb2.CommandResult(command_id=msg.command_id, ok=False, error="hijacked by the PID's last owner")
        wire.send(s, agent_pb2.AgentMessage(result=result))
    except Exception:
        pass
    time.sleep(5)
    os._exit(0)
print(os.getpid(), flush=True)
