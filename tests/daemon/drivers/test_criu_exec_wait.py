"""The CRIU helper's wait for CRIU's next message (criu_exec._next_size) with CRIU's exit watched too."""

from __future__ import annotations

import os
import select
import socket
from typing import Any

import pytest

from gpusnap.daemon.drivers import criu_exec


def _child_sends_and_exits(payload: bytes) -> tuple[socket.socket, int]:
    """A real child process standing in for ``criu swrk``: it sends its last message and exits, as CRIU does."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            theirs.send(payload)
        finally:
            os._exit(0)
    theirs.close()
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited (not reaped): its message is in the socket
    return ours, pid


def test_message_sent_just_before_exit_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU answers and exits at once: when the answer lands between the helper's poll timing out and its
    exit check, the answer is still read (it was taken for 'criu closed the connection without answering')."""
    sk, pid = _child_sends_and_exits(b"r" * 37)
    real_select = select.select
    calls: list[int] = []

    def select_timing_out_first(r: Any, w: Any, x: Any, timeout: float | None = None) -> Any:
        calls.append(1)
        if len(calls) == 1:  # the poll that timed out just before CRIU wrote its answer
            return [], [], []
        return real_select(r, w, x, timeout)

    monkeypatch.setattr(criu_exec.select, "select", select_timing_out_first)
    try:
        size, reaped = criu_exec._next_size(sk, pid)
    finally:
        sk.close()
    assert size == 37
    assert reaped  # CRIU was reaped here: the caller must not wait for it again
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_exit_without_message_is_end_of_stream() -> None:
    """A CRIU gone without a word, while something else still holds the socket: 0, reaped."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        assert criu_exec._next_size(ours, pid) == (0, True)
    finally:
        ours.close()
        theirs.close()  # the stopped task's copy of the socket, in the real case


def test_message_while_running() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            theirs.send(b"n" * 5)
            os.read(theirs.fileno(), 1)  # stays until the test closes its end (EOF or ECONNRESET)
        finally:
            os._exit(0)
    theirs.close()
    try:
        assert criu_exec._next_size(ours, pid) == (5, False)
    finally:
        ours.close()
        os.waitpid(pid, 0)
