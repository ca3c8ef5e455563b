"""AgentRegistry: the daemon's end of the worker-agent channel (``proto/gpusnap/v1/agent.proto``).

Agents dial the agent socket; each connection is identified by its peer credentials (SO_PEERCRED), so
the daemon knows which process tree an agent belongs to without trusting anything the agent says. One
command is in flight per agent at a time.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import re
import selectors
import socket
import struct
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import structlog

from gpusnap.adapters.contract import capture_settings, wire
from gpusnap.adapters.contract._proto import agent_pb2
from gpusnap.daemon.access import rundirs, safefs
from gpusnap.daemon.api.errors import DeadlineExceededError, FailedPreconditionError
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.logthrottle import Throttle

log = structlog.get_logger(__name__)


PROTOCOLS = (2, wire.PROTOCOL_VERSION)
"""The agent protocols gpusnapd reads: 3, and 2 (its agents said the same in string maps: agent.proto's header)
for the agents inside snapshots taken before 3 and for workers with an older gpusnap installed."""


@dataclasses.dataclass(frozen=True)
class AgentInfo:
    """What the agent said in its hello (``AgentHello``), and who it is."""

    pid: int
    uid: int
    engine: str
    instance_id: str
    wake_dir: str
    resumed: bool
    role: str = ""
    """``frontend``, ``core``, ``worker``, or empty (a single-process worker, treated as a front end)."""
    process: str = ""
    """The process's title, for messages."""
    expect_pids: tuple[int, ...] = ()
    """Engine processes this one started (PIDs in its own namespace), each of which needs an agent."""
    weights: str = ""
    """Where the process's weights go, and why, as its adapter said."""
    capture_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The capture settings' environment variables as the process has them now (the table's names only)."""
    info: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Engine facts for people (logged)."""
    protocol: int = wire.PROTOCOL_VERSION
    """The protocol the agent speaks (:data:`PROTOCOLS`): how its command results are read (``workers.client``)."""
    start_time: float = 0.0
    """When the agent's process started (``proc.start_time``), read as it connected: with the PID it names
    that one process, so a session never passes for the agent of a later process given the same PID."""

    @property
    def label(self) -> str:
        """The agent's process for messages: engine, title and PID."""
        return f"{self.engine} {'process ' + self.process if self.process else 'worker'} (PID {self.pid})"


def agent_info(hello: agent_pb2.AgentHello, pid: int, uid: int, start_time: float) -> AgentInfo:
    """The agent of process ``pid`` (of ``uid``, started at ``start_time``) as its ``hello`` describes it
    (protocol 3's fields, or protocol 2's ``info`` map: :func:`with_v2_info`). The agent is not trusted: only
    positive PIDs and the capture settings' names are taken."""
    agent = AgentInfo(
        pid=pid,
        uid=uid,
        engine=hello.engine,
        instance_id=hello.instance_id,
        wake_dir=hello.wake_dir,
        resumed=hello.resumed,
        start_time=start_time,
    )
    if hello.protocol_version == 2:
        return with_v2_info(agent, hello.info)
    return dataclasses.replace(
        agent,
        role=hello.role,
        process=hello.process,
        expect_pids=tuple(p for p in hello.expect_pids if p > 0),
        weights=hello.weights,
        capture_env=capture_settings.reported(hello.capture_env),
        info=dict(hello.info),
    )


V2_ENV_PREFIX = "capture_env."
"""Protocol 2: the prefix of the ``info`` keys that carried the capture settings."""
V2_KEYS = ("role", "process", "expect_pids", "weights")
"""Protocol 2: the ``info`` keys that carried what protocol 3 has fields for."""


def with_v2_info(agent: AgentInfo, info: Mapping[str, str]) -> AgentInfo:
    """``agent`` with what a protocol-2 agent said in its hello's ``info`` (agent.proto's header); also how the
    previous release journaled an agent (``info`` beside the fields of its hello)."""
    env = {k.removeprefix(V2_ENV_PREFIX): v for k, v in info.items() if k.startswith(V2_ENV_PREFIX)}
    return dataclasses.replace(
        agent,
        role=info.get("role", ""),
        process=info.get("process", ""),
        expect_pids=tuple(int(p) for p in info.get("expect_pids", "").split(",") if p.strip().isdigit()),
        weights=info.get("weights", ""),
        capture_env=capture_settings.reported(env),
        info={k: v for k, v in info.items() if k not in V2_KEYS and not k.startswith(V2_ENV_PREFIX)},
        protocol=2,
    )


class AgentSession:
    """One connected agent."""

    def __init__(self, sock: socket.socket, info: AgentInfo):
        self.sock = sock
        self.info = info
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.closed = False

    def call(
        self, message: agent_pb2.DaemonMessage, timeout_s: float, what: str, fds: Sequence[int] = ()
    ) -> agent_pb2.CommandResult:
        """Send one command (with ``fds`` attached, see ``agent.proto``) and wait for its result.

        Raises:
            DeadlineExceededError: no answer within ``timeout_s`` (reason ``AGENT_TIMEOUT``).
            FailedPreconditionError: the agent went away (``AGENT_LOST``) or reported failure
                (``AGENT_COMMAND_FAILED``, the agent's words in the message).
        """
        with self._lock:
            message.command_id = next(self._ids)
            self.sock.settimeout(timeout_s)
            try:
                wire.send(self.sock, message, fds)
                while True:
                    reply = wire.recv(self.sock, agent_pb2.AgentMessage(), AGENT_MAX_FRAME)
                    if reply.WhichOneof("message") == "result" and reply.result.command_id == message.command_id:
                        break
            except TimeoutError as exc:
                self.close()
                raise DeadlineExceededError(
                    f"the {self.info.label} did not finish {what} within {timeout_s:g} s; "
                    "raise the timeout or check the worker's log",
                    reason="AGENT_TIMEOUT",
                ) from exc
            except (wire.ChannelClosed, OSError) as exc:
                self.close()
                raise FailedPreconditionError(
                    f"the agent of the {self.info.label} went away during {what}: {exc}",
                    reason="AGENT_LOST",
                ) from exc
            finally:
                if not self.closed:  # blocking again, for peer_open's MSG_DONTWAIT peek
                    self.sock.settimeout(None)
        result = reply.result
        if not result.ok:
            raise FailedPreconditionError(
                f"the {self.info.label} could not {what}: {result.error}",
                reason="AGENT_COMMAND_FAILED",
                metadata={"pid": str(self.info.pid)},
            )
        return result

    def peer_open(self) -> bool:
        """False once the agent has closed its end. A session in the middle of a :meth:`call` counts as open
        (the call sees a closed peer itself): its socket is then in timeout mode, where even a
        ``MSG_DONTWAIT`` peek waits for data up to the call's timeout, and the registry's lock would be held
        that long (two agents resumed in parallel: one's hello waited out the other's call)."""
        if not self._lock.acquire(blocking=False):
            return not self.closed
        try:
            return not self.closed and _peer_open(self.sock)
        finally:
            self._lock.release()

    def live(self) -> bool:
        """Open (:meth:`peer_open`), and its process is the one that connected (not gone, its PID not given
        to another)."""
        return (
            self.info.start_time != 0.0 and self.peer_open() and proc.start_time(self.info.pid) == self.info.start_time
        )

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def _peer_open(sock: socket.socket) -> bool:
    """False once the agent has closed its end (a pending EOF), without consuming anything."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


INSTANCE_ID_RE = re.compile(r"^[0-9a-f]{32}$")
MAX_AGENTS_PER_UID = 64
"""Connections (attached or saying hello) one user may hold; more are closed at once."""
MAX_PENDING = 256
"""Connections of all users still saying hello (each buffers at most ``HELLO_MAX_FRAME``)."""
HELLO_MAX_FRAME = 64 << 10
"""Largest hello frame, bytes."""
HELLO_TIMEOUT_S = 10.0
"""A connection that has not said hello by then is closed."""
AGENT_MAX_FRAME = 1 << 20
"""Largest frame from an attached agent (command results), bytes."""


class AgentRegistry:
    """Listen for agents on ``socket_path`` and hand their sessions to operations.

    Args:
        socket_path: the agent socket (mode 0666: any local worker may attach; a session only ever acts on
            the process it comes from, found by SO_PEERCRED).

    The socket is open to every local user, so one thread accepts and reads hellos for all connections
    (no thread per connection), each user may hold ``MAX_AGENTS_PER_UID`` connections, a hello is at most
    ``HELLO_MAX_FRAME`` bytes and must arrive within ``HELLO_TIMEOUT_S``, and an attached agent's frames
    are capped at ``AGENT_MAX_FRAME``: the memory all connections can make the daemon hold is bounded.
    """

    def __init__(self, socket_path: Path):
        self.socket_path = socket_path
        self._sessions: dict[int, AgentSession] = {}
        self._cond = threading.Condition()
        self._listener: socket.socket | None = None
        self._refusals = Throttle()
        self._bound: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        """Bind the socket and accept agents in a background thread.

        Raises:
            FailedPreconditionError: another daemon serves the socket (reason ``SOCKET_IN_USE``).
        """
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists() or self.socket_path.is_symlink():
            if rundirs.socket_answers(self.socket_path):
                raise FailedPreconditionError(
                    f"another gpusnapd already serves the agent socket {self.socket_path}; stop it first or give "
                    "this one another agent socket (GPUSNAP_AGENT_SOCKET / agent_socket)",
                    reason="SOCKET_IN_USE",
                )
            self.socket_path.unlink()  # left behind by a daemon that died
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.socket_path))
        st = os.lstat(self.socket_path)
        self._bound = (st.st_dev, st.st_ino)
        os.chmod(self.socket_path, 0o666)
        self._listener.listen(64)
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="gpusnap-agents", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        with self._cond:
            for session in self._sessions.values():
                session.close()
            self._sessions.clear()
        rundirs.unlink_if_ours(self.socket_path, self._bound)

    def connected(self) -> int:
        """Agents connected now."""
        with self._cond:
            return len(self._sessions)

    def find(self, pids: Collection[int]) -> AgentSession | None:
        """The live session of an agent in one of ``pids``, if any."""
        found = self.find_all(pids)
        return found[0] if found else None

    def find_all(self, pids: Collection[int]) -> list[AgentSession]:
        """The live sessions of agents in ``pids``, in the order of ``pids``."""
        with self._cond:
            sessions = [self._sessions.get(pid) for pid in pids]
            return [s for s in sessions if s is not None and s.live()]

    def capture_env(self, pids: Collection[int]) -> dict[int, dict[str, str]]:
        """Capture settings each live agent among ``pids`` reported in its hello (its process's environment as
        it is now, which ``/proc/<pid>/environ`` does not show; ``capture_settings.report``), by PID."""
        with self._cond:
            sessions = [self._sessions.get(p) for p in pids]
        return {s.info.pid: dict(s.info.capture_env) for s in sessions if s is not None and s.live()}

    def wait_for(self, pids: Collection[int], instance_id: str, timeout_s: float) -> AgentSession:
        """Wait for the agent ``instance_id`` to reconnect (after Quiesce) from one of ``pids``.

        Raises:
            DeadlineExceededError: it did not come back in time (reason ``AGENT_TIMEOUT``).
            FailedPreconditionError: every process of ``pids`` is gone, so it never will (``AGENT_LOST``).
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if not any(proc.alive(p) for p in pids):
                    raise FailedPreconditionError(
                        f"the worker of agent {instance_id[:8]}… exited before its agent reconnected",
                        reason="AGENT_LOST",
                    )
                for pid in pids:
                    session = self._sessions.get(pid)
                    if (
                        session is not None
                        and session.info.resumed
                        and session.info.instance_id == instance_id
                        and session.live()
                    ):
                        return session
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceededError(
                        f"the worker agent {instance_id[:8]}… did not reconnect within {timeout_s:g} s after being "
                        "woken; check that the worker can reach the agent socket "
                        f"{self.socket_path} and its wake directory",
                        reason="AGENT_TIMEOUT",
                    )
                self._cond.wait(timeout=min(remaining, 0.5))

    @staticmethod
    def wake(wake_dir: str, instance_id: str, uid: int) -> None:
        """Create the agent's wake file (the worker polls for it after Quiesce), never through a symlink, in
        a directory of the agent's user or the daemon's own wake directory."""
        with safefs.open_dir(wake_dir, uid, shared_ok=True) as fd:
            safefs.create(fd, instance_id)

    @staticmethod
    def unwake(wake_dir: str, instance_id: str, uid: int) -> None:
        """Remove a wake file (before a capture, so a stale one cannot wake the source early)."""
        with safefs.open_dir(wake_dir, uid, shared_ok=True) as fd:
            safefs.remove(fd, instance_id)

    def _serve(self) -> None:
        """Accept agents and read their hellos in this one thread (no thread per connection)."""
        assert self._listener is not None
        listener = self._listener
        listener.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, None)
        pending: dict[socket.socket, _Pending] = {}
        try:
            while not self._stopping:
                for key, _ in sel.select(timeout=0.5):
                    if key.data is None:
                        self._accept_ready(listener, sel, pending)
                    else:
                        self._read_hello(key.fileobj, key.data, sel, pending)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn, p in [(c, p) for c, p in pending.items() if p.deadline < now]:
                    self._refused(p.uid, p.pid, f"no hello within {HELLO_TIMEOUT_S:g} s")
                    self._drop(conn, sel, pending)
        finally:
            for conn in list(pending):
                self._drop(conn, sel, pending)
            sel.close()

    def _accept_ready(
        self, listener: socket.socket, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending]
    ) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("agent.accept_failed", error=str(exc))
                    time.sleep(0.1)
                return  # or the listener was closed
            pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            with self._cond:
                attached = sum(1 for s in self._sessions.values() if s.info.uid == uid and not s.closed)
            waiting = sum(1 for p in pending.values() if p.uid == uid)
            if attached + waiting >= MAX_AGENTS_PER_UID or len(pending) >= MAX_PENDING:
                self._refused(uid, pid, "too many agent connections")
                conn.close()
                continue
            start = proc.start_time(pid)
            if not start:  # gone already: its PID may name another process by the hello
                conn.close()
                continue
            conn.setblocking(False)
            p = _Pending(pid=pid, uid=uid, deadline=time.monotonic() + HELLO_TIMEOUT_S, start=start)
            pending[conn] = p
            sel.register(conn, selectors.EVENT_READ, p)

    def _refused(self, uid: int, pid: int, reason: str) -> None:
        """Log a refused connection: a few per uid and minute, then a count of those left out."""
        dropped = self._refusals.allow(uid)
        if dropped is not None:
            log.warning("agent.refused", pid=pid, uid=uid, reason=reason, left_out=dropped)

    @staticmethod
    def _drop(conn: socket.socket, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending]) -> None:
        pending.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _read_hello(
        self, conn: socket.socket, p: _Pending, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending]
    ) -> None:
        try:
            whole = p.frame.read(conn)
        except BlockingIOError:
            return
        except wire.BadFrame as exc:
            self._refused(p.uid, p.pid, f"hello: {exc}")
            self._drop(conn, sel, pending)
            return
        except (wire.ChannelClosed, OSError):
            self._drop(conn, sel, pending)
            return
        if not whole:
            return
        sel.unregister(conn)
        pending.pop(conn, None)
        try:
            msg = p.frame.message(agent_pb2.AgentMessage())
        except wire.BadFrame:
            msg = agent_pb2.AgentMessage()  # not a hello: refused as one
        conn.setblocking(True)
        self._hello(conn, p.pid, p.uid, msg, p.start)

    def _hello(self, conn: socket.socket, pid: int, uid: int, msg: agent_pb2.AgentMessage, start: float) -> None:
        if msg.WhichOneof("message") != "hello" or msg.hello.protocol_version not in PROTOCOLS:
            self._refused(uid, pid, f"not a hello of protocol {' or '.join(map(str, PROTOCOLS))}")
            conn.close()
            return
        h = msg.hello
        if not INSTANCE_ID_RE.fullmatch(h.instance_id) or not os.path.isabs(h.wake_dir):
            self._refused(uid, pid, "malformed instance id or wake directory")
            conn.close()
            return
        info = agent_info(h, pid, uid, start)
        with self._cond:
            for stale in [p for p, s in self._sessions.items() if not s.live()]:
                self._sessions.pop(stale).close()
            old = self._sessions.get(pid)
            if old is not None:
                old.close()
            self._sessions[pid] = AgentSession(conn, info)
            self._cond.notify_all()
        log.info("agent.attached", pid=pid, engine=info.engine, instance=info.instance_id[:8], resumed=info.resumed)


@dataclasses.dataclass
class _Pending:
    """A connection whose hello is still being read."""

    pid: int
    uid: int
    deadline: float
    start: float
    """The connecting process's start time (``proc.start_time``)."""
    frame: wire.FrameReader = dataclasses.field(
        default_factory=lambda: wire.FrameReader(HELLO_MAX_FRAME, take_fds=False)
    )
