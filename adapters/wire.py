"""Framing of the daemon ↔ agent channel: a 4-byte big-endian length, then one protobuf message.

Shared by the agent (inside workers) and the daemon; see ``proto/gpusnap/v1/agent.proto``.
"""

from __future__ import annotations

import socket
import struct
from typing import TypeVar

from google.protobuf.message import Message

M = TypeVar("M", bound=Message)

MAX_FRAME = 16 << 20
PROTOCOL_VERSION = 1


class ChannelClosed(ConnectionError):
    """The peer closed the channel (or sent a malformed frame)."""


def send(sock: socket.socket, message: Message) -> None:
    """Write one framed message."""
    data = message.SerializeToString()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv(sock: socket.socket, message: M) -> M:
    """Read one framed message into ``message`` and return it.

    Raises:
        ChannelClosed: end of stream, an oversized frame or bytes that do not parse.
    """
    (size,) = struct.unpack(">I", _read_exactly(sock, 4))
    if size > MAX_FRAME:
        raise ChannelClosed(f"frame of {size} bytes exceeds {MAX_FRAME}")
    try:
        message.ParseFromString(_read_exactly(sock, size))
    except Exception as exc:  # protobuf's DecodeError and friends
        raise ChannelClosed(f"malformed frame: {exc}") from exc
    return message


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ChannelClosed("peer closed the channel")
        buf += chunk
    return bytes(buf)
