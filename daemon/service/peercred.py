"""Kernel-attested caller identity (SO_PEERCRED) for gRPC over a Unix socket.

gRPC's Python server does not expose a connection's peer credentials. gpusnapd therefore listens on
the public socket itself: for every accepted connection it reads ``SO_PEERCRED`` (see unix(7)), opens
a connection to the gRPC server's private socket from a client socket autobound by the kernel to a
unique abstract address (unix(7) "autobind": nobody can claim it first), and copies bytes both ways.
gRPC reports that address as the call's peer (``unix-abstract:<5 hex digits>``), which
:meth:`PeerCredProxy.caller_for` maps back to the credentials. A call whose connection is no longer
known (it closed before gRPC ran the handler) is refused, never trusted. The private socket lives in a
mode 0700 directory, so only root can bypass the proxy.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
from pathlib import Path

import structlog

from gpusnap.daemon.access.rundirs import socket_answers, unlink_if_ours
from gpusnap.daemon.api.errors import FailedPreconditionError, UnauthenticatedError
from gpusnap.daemon.api.types import ROOT_CALLER, Caller
from gpusnap.daemon.logthrottle import Throttle

log = structlog.get_logger(__name__)

_CHUNK = 1 << 16


class PeerCredProxy:
    """Accept on ``public`` (mode 0660, group ``group`` when it exists) and forward to ``private``.

    Args:
        public: the API socket callers use.
        private: the gRPC server's own socket (in a 0700 directory).
        group: group allowed to connect.
        max_connections_per_caller: connections one non-root uid may hold open at once (0: no bound); more
            are closed as they are accepted. Each costs the daemon three descriptors (this side, the
            forwarded one, gRPC's), so without a bound one user could take them all.
    """

    def __init__(self, public: Path, private: Path, group: str, max_connections_per_caller: int = 0):
        self.public = public
        self.private = private
        self.group = group
        self.max_connections_per_caller = max_connections_per_caller
        self._open: dict[int, int] = {}  # uid -> connections held open (touched on the loop's thread only)
        self._refusals = Throttle(burst=1)
        self._callers: dict[str, Caller] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gpusnap-peercred", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._bound: tuple[int, int] | None = None

    def check_free(self) -> None:
        """Raise FailedPreconditionError (``SOCKET_IN_USE``) if another daemon serves the public socket."""
        if (self.public.exists() or self.public.is_symlink()) and socket_answers(self.public):
            raise FailedPreconditionError(
                f"another gpusnapd already serves {self.public}; stop it first or pass another --socket",
                reason="SOCKET_IN_USE",
            )

    def start(self) -> None:
        """Bind the public socket and start forwarding."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.check_free()
        if self.public.exists() or self.public.is_symlink():
            self.public.unlink()
        sock.bind(str(self.public))
        st = os.lstat(self.public)
        self._bound = (st.st_dev, st.st_ino)
        _set_mode_and_group(self.public, self.group)
        sock.listen(128)
        sock.setblocking(False)
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._serve(sock), self._loop)
        fut.result(timeout=10)

    def stop(self) -> None:
        """Stop accepting, cut the forwarded connections and stop the loop."""

        async def close() -> None:
            if self._server:
                self._server.close()
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        unlink_if_ours(self.public, self._bound)

    def caller(self, peer: str) -> Caller | None:
        """The credentials behind a gRPC peer string; ``None`` if it did not come through the proxy.

        Calls straight to the private socket can only come from root (the directory is 0700) and are
        treated as root by :func:`caller_for`.
        """
        if peer.startswith("unix-abstract:"):
            with self._lock:
                return self._callers.get(peer.removeprefix("unix-abstract:"))
        return None

    def caller_for(self, peer: str) -> Caller:
        """The caller behind ``peer``: proxied connections by their SO_PEERCRED, direct connections to the
        private socket (root only: its directory is 0700) as root.

        Raises:
            UnauthenticatedError: a proxied connection that is no longer known (reason ``PEER_UNKNOWN``).
        """
        if peer.startswith("unix-abstract:"):
            found = self.caller(peer)
            if found is None:
                raise UnauthenticatedError(
                    "the connection closed before its call could be attributed to a caller; retry",
                    reason="PEER_UNKNOWN",
                )
            return found
        if peer == "unix:" or peer.startswith("unix:"):
            return ROOT_CALLER
        raise UnauthenticatedError(f"unexpected peer {peer!r}", reason="PEER_UNKNOWN")

    async def _serve(self, sock: socket.socket) -> None:
        self._server = await asyncio.start_unix_server(self._handle, sock=sock)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client_sock: socket.socket = writer.get_extra_info("socket")
        pid, uid, gid = struct.unpack("3i", client_sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != 0 and 0 < self.max_connections_per_caller <= self._open.get(uid, 0):
            self._log_refused(uid)
            writer.close()
            return
        self._open[uid] = self._open.get(uid, 0) + 1
        try:
            await self._forward(reader, writer, Caller(pid=pid, uid=uid, gid=gid))
        finally:
            self._open[uid] -= 1
            if not self._open[uid]:
                del self._open[uid]

    def _log_refused(self, uid: int) -> None:
        """One warning per uid and minute (then a count of those left out): a flood is not also a flood of
        log lines."""
        dropped = self._refusals.allow(uid)
        if dropped is not None:
            log.warning(
                "peercred.refused",
                uid=uid,
                open=self._open.get(uid, 0),
                left_out=dropped,
                reason="max_connections_per_caller reached; further connections of this uid are closed",
            )

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, caller: Caller) -> None:
        up: socket.socket | None = None
        try:
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # EMFILE here too: the client is closed then
            up.bind("")  # autobind: the kernel picks a unique abstract name
            name = up.getsockname()[1:].decode()  # b"\0xxxxx"
            up.setblocking(False)
            await self._loop.sock_connect(up, str(self.private))
        except OSError as exc:
            log.error("peercred.forward_failed", error=str(exc))
            if up is not None:
                up.close()
            writer.close()
            return
        with self._lock:
            self._callers[name] = caller
        up_reader, up_writer = await asyncio.open_unix_connection(sock=up)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except asyncio.CancelledError:
            pass
        finally:
            with self._lock:
                self._callers.pop(name, None)
            for w in (writer, up_writer):
                w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.write_eof()
        except (OSError, RuntimeError):
            pass


def _set_mode_and_group(path: Path, group: str) -> None:
    import grp

    gid = -1
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        log.warning("socket.group_missing", group=group, hint="create it with `groupadd --system gpusnap`")
    if gid != -1 and os.geteuid() == 0:
        os.chown(path, -1, gid)
    os.chmod(path, 0o660)
