"""The agent channel's framing refuses a frame that brings more descriptors than it may."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from gpusnap.adapters.contract import wire
from gpusnap.adapters.contract._proto import agent_pb2


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_descriptors_are_limited_per_frame_not_per_read() -> None:
    ours, theirs = socket.socketpair()
    ours.settimeout(5)  # without the limit, recv waits for the rest of the frame
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(wire.MAX_FDS)]
    try:
        theirs.sendall(struct.pack(">I", 1000))
        for _ in range(3):  # a 1000-byte frame trickled in 1-byte pieces, MAX_FDS descriptors with each
            socket.send_fds(theirs, [b"x"], fds)
        before = _open_fds()
        with pytest.raises(wire.ChannelClosed, match="descriptors in one frame"):
            wire.recv(ours, agent_pb2.AgentMessage())
        assert _open_fds() <= before, "the descriptors received are closed"
    finally:
        for fd in fds:
            os.close(fd)
        ours.close()
        theirs.close()


def test_a_frame_trickled_to_a_non_blocking_socket_reads_as_a_blocking_read_does() -> None:
    """The daemon's agent socket reads hellos with the same reader, a piece at a time, one thread for all."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    hello = agent_pb2.AgentMessage(hello=agent_pb2.AgentHello(engine="vllm", instance_id="ab" * 16))
    data = hello.SerializeToString()
    frame = struct.pack(">I", len(data)) + data
    reader = wire.FrameReader(64 << 10, take_fds=False)
    try:
        with pytest.raises(BlockingIOError):
            reader.read(ours)  # nothing sent yet
        for i in range(0, len(frame), 3):
            theirs.sendall(frame[i : i + 3])
            assert reader.read(ours) == (i + 3 >= len(frame))
        assert reader.message(agent_pb2.AgentMessage()) == hello
        theirs.sendall(frame)
        ours.setblocking(True)
        assert wire.recv(ours, agent_pb2.AgentMessage()) == hello
    finally:
        ours.close()
        theirs.close()


def test_an_oversized_frame_is_refused_from_its_length_alone() -> None:
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(struct.pack(">I", 1 << 20))
        reader = wire.FrameReader(64 << 10, take_fds=False)
        with pytest.raises(wire.BadFrame, match=f"exceeds {64 << 10}"):
            reader.read(ours)
        theirs.close()
        with pytest.raises(wire.ChannelClosed, match="closed"):
            wire.FrameReader().read(ours)
    finally:
        ours.close()
        theirs.close()
