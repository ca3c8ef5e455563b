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
PROTOCOL_VERSION = 3
"""3: what an agent says of its process and what a command reports travel in fields of their own, not in string
maps (agent.proto's header). 2: Offload writes into sealed memfds and keeps the buffers; Free releases them."""
MAX_FDS = 200
"""Descriptors per frame (the kernel's SCM_MAX_FD is 253)."""
AGENT_THREAD = "gpusnap-agent"
"""The kernel's name (``/proc/<pid>/task/<tid>/comm``) of the agent's thread in a worker process: the daemon's
preflight finds a process that runs an agent not attached to it (one dialing another socket) by it."""


class ChannelClosed(ConnectionError):
    """The peer closed the channel (or sent a malformed frame)."""


class BadFrame(ChannelClosed):
    """The peer sent a frame the channel refuses: oversized, with too many descriptors, or one that does not
    parse."""


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


class FrameReader:
    """One frame as it arrives: the channel's one reader, for blocking sockets (:func:`recv_with_fds` reads
    until the frame is whole) and non-blocking ones (the daemon's agent socket feeds each connection's
    reader what its socket holds, one thread for all of them).

    Args:
        max_frame: the largest body, bytes; a larger announced size is refused before the body is read.
        take_fds: receive the descriptors sent with the frame (at most ``MAX_FDS`` per frame; :attr:`fds`,
            opened close-on-exec, the caller's to close); when false the kernel drops any.
    """

    def __init__(self, max_frame: int = MAX_FRAME, take_fds: bool = True):
        self.max_frame = max_frame
        self.take_fds = take_fds
        self.fds: list[int] = []
        self._buf = bytearray()
        self._size: int | None = None

    def _need(self) -> int:
        return 4 - len(self._buf) if self._size is None else 4 + self._size - len(self._buf)

    def read(self, sock: socket.socket) -> bool:
        """Read what the socket holds of the frame (one receive); True once the frame is whole.

        Raises:
            ChannelClosed: end of stream.
            BadFrame: an oversized frame, or more than ``MAX_FDS`` descriptors with it.
            OSError: the socket's own errors (``BlockingIOError``: a non-blocking socket holds nothing yet).
        """
        if self.take_fds:
            chunk, received, flags, _ = socket.recv_fds(sock, self._need(), MAX_FDS, socket.MSG_CMSG_CLOEXEC)
            self.fds.extend(received)
            # the limit is per frame, not per read: a peer that trickles a frame in 1-byte pieces, 200
            # descriptors each, would otherwise fill the daemon's descriptor table from one connection
            if flags & socket.MSG_CTRUNC or len(self.fds) > MAX_FDS:
                raise BadFrame(f"more than {MAX_FDS} descriptors in one frame")
        else:
            chunk = sock.recv(self._need())
        if not chunk:
            raise ChannelClosed("peer closed the channel")
        self._buf += chunk
        if self._size is None and len(self._buf) == 4:
            (self._size,) = struct.unpack(">I", self._buf)
            if self._size > self.max_frame:
                raise BadFrame(f"frame of {self._size} bytes exceeds {self.max_frame}")
        return self._size is not None and len(self._buf) == 4 + self._size

    def message(self, message: M) -> M:
        """Parse the whole frame into ``message`` and return it.

        Raises:
            BadFrame: bytes that do not parse.
        """
        try:
            message.ParseFromString(bytes(self._buf[4:]))
        except Exception as exc:  # protobuf's DecodeError and friends
            raise BadFrame(f"malformed frame: {exc}") from exc
        return message

    def close_fds(self) -> None:
        """Close the descriptors received with the frame."""
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


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
    """Read one framed message from a blocking socket into ``message``; returns it and the descriptors that
    came with it (the caller owns them, opened close-on-exec).

    Raises:
        ChannelClosed: end of stream, an oversized frame or bytes that do not parse.
    """
    reader = FrameReader(max_frame)
    try:
        while not reader.read(sock):
            pass
        return reader.message(message), reader.fds
    except BaseException:
        reader.close_fds()
        raise
