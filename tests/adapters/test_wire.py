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
