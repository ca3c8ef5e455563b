"""Work done by a process that *is* a given user, so that the kernel checks every step against that user's rights.

gpusnapd and its helpers are root; what they do by a path a user controls (make a restored tree's sockets
and file copies, remove those copies, check that a snapshot's owner may still open its files) is done by a
process that has dropped to that user's uid, gid and groups for good (:func:`become`). From a single-threaded
helper (``criu_exec``, the reaper) that is a forked child (:func:`run_as`): it sends its answers back over a
socket pair, each one message of the saved documents' codec (``gpusnap.daemon.store.documents``, a frozen
dataclass the caller names) with the descriptors it made; gpusnapd itself, which is threaded, starts a process
instead (``gpusnap.daemon.access.asowner``).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from gpusnap.daemon.api.types import Creds
from gpusnap.daemon.store import documents

M = TypeVar("M")
MAX_MESSAGE = 65536


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the owner's child says of a piece of work: done (what it made comes with it as descriptors), or the
    OS error the owner met, at which item."""

    at: int = -1
    """The item it failed at (-1: it did them all)."""
    errno: int = 0
    error: str = ""

    @staticmethod
    def failed(at: int, exc: OSError) -> Outcome:
        return Outcome(at, exc.errno or 0, exc.strerror or str(exc))


def become(creds: Creds) -> None:
    """Drop this process to ``creds`` (uid, gid and groups) for good.

    Raises:
        OSError: it could not (``EPERM``: it kept root's uid, or root's gid for another gid).
    """
    os.setgroups(list(creds.groups))
    os.setresgid(creds.gid, creds.gid, creds.gid)
    os.setresuid(creds.uid, creds.uid, creds.uid)
    if creds.uid != 0 and (os.geteuid() == 0 or os.getegid() == 0 and creds.gid != 0):
        raise OSError(errno.EPERM, "could not drop to the owner's credentials")


def run_as(
    creds: Creds,
    work: Callable[[], Iterable[tuple[object, Sequence[int]]]],
    reply: type[M],
    *,
    max_fds: int = 1,
) -> tuple[list[tuple[M, list[int]]], int]:
    """Run ``work()`` in a forked child that is ``creds`` (:func:`become`); each ``(message, fds)`` it yields
    comes back as ``reply`` with the descriptors (at most ``max_fds`` a message; the child's own are closed
    once sent). Returns the replies and the child's exit status (0: it finished; the replies are then all
    of them). Fork only from a single-threaded process.

    Raises:
        DocumentError: a message that is not a ``reply`` (its descriptors are closed).
    """
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - its replies and exit status are checked by the parent
        code = 1
        try:
            parent.close()
            become(creds)
            for message, fds in work():
                socket.send_fds(child, [documents.encode(message)], list(fds))
                for fd in fds:
                    os.close(fd)
            code = 0
        finally:
            os._exit(code)
    child.close()
    out: list[tuple[M, list[int]]] = []
    try:
        while True:
            msg, fds, _flags, _addr = socket.recv_fds(parent, MAX_MESSAGE, max_fds)
            if not msg:
                break
            try:
                out.append((documents.decode(msg, reply), fds))
            except documents.DocumentError:
                for fd in fds:
                    os.close(fd)
                raise
    except BaseException:
        for _, fds in out:
            for fd in fds:
                os.close(fd)
        raise
    finally:
        parent.close()
        _, status = os.waitpid(pid, 0)
    return out, os.waitstatus_to_exitcode(status)


def close_all(replies: Iterable[tuple[object, Sequence[int]]]) -> None:
    """Close the descriptors of ``replies`` (:func:`run_as`'s)."""
    for _, fds in replies:
        for fd in fds:
            os.close(fd)
