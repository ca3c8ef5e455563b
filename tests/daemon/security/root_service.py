"""A root service listening on a unix socket by path, for tests in which a user swaps a directory for a link
to its directory: the restore must leave root's socket root's, in place, and answering."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def root_service(path: Path) -> Iterator[Callable[[], None]]:
    """Listen on ``path`` (mode 0600) and answer ``root`` to one connection; yields a check that raises
    AssertionError unless ``path`` is still that socket (inode, owner, mode) and it answers."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    os.chmod(path, 0o600)
    before = os.lstat(path)
    answered = threading.Event()

    def serve() -> None:
        conn, _ = server.accept()
        conn.sendall(b"root\n")
        conn.close()
        answered.set()

    def intact() -> None:
        after = os.lstat(path)
        fingerprint = (after.st_ino, after.st_uid, after.st_mode)
        assert fingerprint == (before.st_ino, before.st_uid, before.st_mode), "root's socket was replaced or re-owned"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(str(path))
            assert c.recv(16) == b"root\n", "root's service did not answer"
        assert answered.wait(5)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield intact
    finally:
        server.close()
