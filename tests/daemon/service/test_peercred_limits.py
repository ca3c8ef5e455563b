"""The SO_PEERCRED proxy bounds the connections one uid holds open (an unprivileged member of the socket's
group could otherwise take every descriptor gpusnapd has: three per connection, the daemon then refused
everyone, root included, and logged an accept error a few thousand times a second)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

from gpusnap.daemon.service.peercred import PeerCredProxy

NOBODY = 65534  # nobody:nogroup

HOLDER = textwrap.dedent(
    """
    import socket, sys, time
    path, n = sys.argv[1], int(sys.argv[2])
    socks, alive = [], 0
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        socks.append(s)
    time.sleep(1.0)  # the proxy has accepted (or refused) every one
    for s in socks:
        s.settimeout(5)
        try:
            s.sendall(b"ping")
            alive += s.recv(4) == b"ping"
        except OSError:
            pass
    print(alive, flush=True)
    """
)


def _served_as_nobody(sock: Path, n: int) -> int:
    """How many of ``n`` connections that nobody holds open at once the proxy serves (an echo comes back)."""
    out = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", HOLDER]
        + [str(sock), str(n)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(out.stdout)


def _echo_server(path: Path) -> socket.socket:
    """The gRPC server's stand-in on the private socket: echoes what the proxy forwards."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(512)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(
                target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(64), b"")], daemon=True
            ).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_connections_per_uid_are_bounded_and_root_is_not() -> None:
    d = Path(tempfile.mkdtemp(prefix="gsn-peercred-", dir="/tmp"))
    os.chmod(d, 0o755)
    srv = _echo_server(d / "priv.sock")
    proxy = PeerCredProxy(d / "pub.sock", d / "priv.sock", "nogroup", max_connections_per_caller=8)
    proxy.start()
    try:
        assert _served_as_nobody(d / "pub.sock", 20) == 8, "of 20 connections of one user, only 8 are served"
        roots = []
        for _ in range(20):  # root is never bounded (and is not counted with the user's)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(str(d / "pub.sock"))
            roots.append(s)
        for s in roots:
            s.sendall(b"ping")
            assert s.recv(4) == b"ping"
            s.close()
        assert _served_as_nobody(d / "pub.sock", 3) == 3, "the user's connections closed: its slots are free again"
    finally:
        proxy.stop()
        srv.close()
        for p in d.iterdir():
            p.unlink()
        d.rmdir()
