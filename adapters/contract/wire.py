"""Framing of the daemon ↔ agent channel: a 4-byte big-endian length, then one protobuf message.

Shared by the agent (inside workers) and the daemon; see ``proto/gpusnap/v1/agent.proto``.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Sequence
from typing import TypeVar

from google.protobuf.message import Message

M = TypeVar("M", bound=Message)

MAX_FRAME = 16 << 20
PROTOCOL_VERSION = 2
"""2: Offload writes into sealed memfds and keeps the buffers; Free releases them (agent.proto)."""
MAX_FDS = 200
"""Descriptors per frame (the kernel's SCM_MAX_FD is 253)."""
AGENT_THREAD = "gpusnap-agent"
"""The kernel's name (``/proc/<pid>/task/<tid>/comm``) of the agent's thread in a worker process: the daemon's
preflight finds a process that runs an agent not attached to it (one dialing another socket) by it."""


class ChannelClosed(ConnectionError):
    """The peer closed the channel (or sent a malformed frame)."""


def send(sock: socket.socket, message: Message, fds: Sequence[int] = ()) -> None:
    """Write one framed message; ``fds`` (at most ``MAX_FDS``) travel with its first byte (SCM_RIGHTS)."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"{len(fds)} descriptors in one frame; at most {MAX_FDS}")
    data = message.SerializeToString()
    frame = struct.pack(">I", len(data)) + data
    if not fds:
        sock.sendall(frame)
        return
    sent = socket.send_fds(sock, [frame], list(fds))
    if sent < len(frame):
        sock.sendall(frame[sent:])


def recv(sock: socket.socket, message: M, max_frame: int = MAX_FRAME) -> M:
    """Read one framed message (at most ``max_frame`` bytes) into ``message`` and return it; descriptors
    sent with it are closed.

    Raises:
        ChannelClosed: end of stream, an oversized frame or bytes that do not parse.
    """
    message, fds = recv_with_fds(sock, message, max_frame)
    for fd in fds:
        os.close(fd)
    return message


def recv_with_fds(sock: socket.socket, message: M, max_frame: int = MAX_FRAME) -> tuple[M, list[int]]:
    """Read one framed message into ``message``; returns it and the descriptors that came with it (the
    caller owns them, opened close-on-exec).

    Raises:
        ChannelClosed: end of stream, an oversized frame or bytes that do not parse.
    """
    fds: list[int] = []
    try:
        (size,) = struct.unpack(">I", _read_exactly(sock, 4, fds))
        if size > max_frame:
            raise ChannelClosed(f"frame of {size} bytes exceeds {max_frame}")
        body = _read_exactly(sock, size, fds)
        try:
            message.ParseFromString(body)
        except Exception as exc:  # protobuf's DecodeError and friends
            raise ChannelClosed(f"malformed frame: {exc}") from exc
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


def _read_exactly(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk, received, flags, _ = socket.recv_fds(sock, n - len(buf), MAX_FDS, socket.MSG_CMSG_CLOEXEC)
        fds.extend(received)
        # the limit is per frame, not per read: a peer that trickles a frame in 1-byte pieces, 200
        # descriptors each, would otherwise fill the daemon's descriptor table from one connection
        if flags & socket.MSG_CTRUNC or len(fds) > MAX_FDS:
            raise ChannelClosed(f"more than {MAX_FDS} descriptors in one frame")
        if not chunk:
            raise ChannelClosed("peer closed the channel")
        buf += chunk
    return bytes(buf)
