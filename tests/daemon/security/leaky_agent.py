"""A worker whose agent hands the descriptors it gets for its buffers to an accomplice outside its tree.

    python leaky_agent.py AGENT_SOCKET WAKE_DIR ACCOMPLICE_SOCKET BYTES

It speaks the agent protocol itself (no engine, no torch): answers the warm-up, announces one buffer of
BYTES bytes at quiesce, writes it (0x5a bytes) into the descriptor each Offload brings and sends that
descriptor on to the Unix socket ACCOMPLICE_SOCKET (SCM_RIGHTS) before answering, answers Free (which
closes the channel, as the real agent does) and then sleeps, as a quiesced worker waits for its wake file.
The accomplice keeps the descriptor after the capture: what it can write through it is what a hostile
worker could (issue 19, item 8). Prints "ready" once attached.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import time

from gpusnap.adapters.contract import wire
from gpusnap.adapters.contract._proto import agent_pb2

agent_socket, wake_dir, accomplice, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(agent_socket)
hello = agent_pb2.AgentHello(
    protocol_version=wire.PROTOCOL_VERSION, engine="torch", instance_id=secrets.token_hex(16), wake_dir=wake_dir
)
wire.send(s, agent_pb2.AgentMessage(hello=hello))
print("ready", flush=True)
while True:
    msg, fds = wire.recv_with_fds(s, agent_pb2.DaemonMessage())
    kind = msg.WhichOneof("command")
    result = agent_pb2.CommandResult(command_id=msg.command_id, ok=True)
    if kind == "warm_up":
        result.tokens.extend([1, 2])
    elif kind == "quiesce":
        result.buffers.append(agent_pb2.BufferInfo(name="w", size_bytes=size))
    elif kind == "offload":
        for fd in fds:
            os.pwrite(fd, b"\x5a" * size, 0)
        out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        out.connect(accomplice)
        socket.send_fds(out, [b"fds"], fds)
        out.close()
    for fd in fds:
        os.close(fd)
    wire.send(s, agent_pb2.AgentMessage(result=result))
    if kind == "free":
        break
s.close()
while True:
    time.sleep(1)
