"""WorkerAgent: runs inside an engine worker and carries out the daemon's warm-up, quiesce and resume.

Start it once the engine is built::

    from gpusnap.adapters import start_agent
    from gpusnap.adapters.engines.vllm.adapter import VllmAdapter
    agent = start_agent(VllmAdapter(engine), loop=asyncio.get_running_loop())

The agent dials gpusnapd's agent socket (``GPUSNAP_AGENT_SOCKET``, default ``/run/gpusnap/agent.sock``)
from a background thread (named ``gpusnap-agent`` for the kernel, so the daemon's preflight finds an agent
that is not attached to it) and keeps retrying while the daemon is away; the first failure is said once in
the worker's log (``gpusnap.adapters.reach``). After answering ``Quiesce`` (with
buffers, ``Free``) it closes the connection, so the captured image holds no socket to the daemon, and waits for its wake file
(``<wake dir>/<instance id>``, by default ``wake`` beside the agent socket, where gpusnapd makes it); the daemon creates it once the worker may run on (in a restored copy, or
in the source after a failed capture). Then it reconnects and waits for ``Resume``. Buffers the adapter
names (:meth:`EngineAdapter.buffers`) leave memory between quiesce and resume: see
``gpusnap.adapters.buffers`` and ``agent.proto``. The worker survives
being frozen at any instant: between commands the agent only sleeps or blocks in ``recv``.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from gpusnap.adapters import buffers, heaptrim, memory_report, reach, vmm
from gpusnap.adapters.base import EngineAdapter, RestoreContext
from gpusnap.adapters.contract import capture_settings, wire
from gpusnap.adapters.contract._proto import agent_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SOCKET = "/run/gpusnap/agent.sock"
WAKE_DIR_NAME = "wake"
"""The default wake directory is this, beside the agent socket: gpusnapd creates it there (mode 0755: it writes
the wake files, the agents only look for theirs); a worker's own wake directory (``GPUSNAP_WAKE_DIR``) must
belong to the worker's user."""
RECONNECT_S = 0.5
WAKE_POLL_S = 0.005
"""How often a quiesced agent looks for its wake file (one ``stat``). It looks only between a quiesce and its
wake (a standby's tasks are stopped meanwhile), and every restore and activation waits for it: at 20 ms the
wait was 10 ms on average, a tenth of a CPU activation's target (issue 25)."""


class WorkerAgent:
    """The daemon's hands inside one worker process.

    Args:
        adapter: the engine adapter whose coroutines the agent calls.
        socket_path: the daemon's agent socket (default: ``GPUSNAP_AGENT_SOCKET`` or ``/run/gpusnap/agent.sock``).
        wake_dir: where the wake file appears (default: ``GPUSNAP_WAKE_DIR``, or ``wake`` beside the agent socket).
        loop: the engine's event loop; adapter coroutines run there. ``None``: the agent runs its own loop.
    """

    def __init__(
        self,
        adapter: EngineAdapter,
        *,
        socket_path: str | None = None,
        wake_dir: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        self.adapter = adapter
        self.socket_path = socket_path or os.environ.get("GPUSNAP_AGENT_SOCKET", DEFAULT_SOCKET)
        self.wake_dir = Path(
            wake_dir or os.environ.get("GPUSNAP_WAKE_DIR") or Path(self.socket_path).parent / WAKE_DIR_NAME
        )
        self.instance_id = secrets.token_hex(16)
        self.loop = loop
        self.quiesced = False
        self.resumed_count = 0
        """How many times this process (or the image it came from) was resumed after a quiesce."""
        self._stop = threading.Event()
        self._own_loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="gpusnap-agent", daemon=True)
        self._attached = threading.Event()
        self._buffers: dict[str, buffers.Buffer] = {}
        self._out: set[str] = set()
        """Names of the buffers written out and freed, until reloaded."""
        self._written: set[str] = set()
        """Names of the buffers written out and still in memory, until freed (``Free``) or resumed."""
        self._arenas: list[vmm.Arena] = []
        """The arenas the buffers lie in, as announced at quiesce (MapArenas names them by 1-based index)."""
        self._unreachable_since: float | None = None
        """When dialing the socket first failed (since the last success), for the log."""

    def start(self) -> WorkerAgent:
        """Start the agent's thread; returns ``self``."""
        try:
            self.wake_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("gpusnap agent: cannot create wake directory %s: %s", self.wake_dir, exc)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reconnecting (the thread ends at its next wake-up)."""
        self._stop.set()

    def wait_attached(self, timeout: float) -> bool:
        """Block until the agent has said hello to the daemon; True if it did within ``timeout`` s."""
        return self._attached.wait(timeout)

    # -- the agent's thread -------------------------------------------------------------------------

    def _run(self) -> None:
        _name_thread(wire.AGENT_THREAD)
        if self.loop is None:
            self._own_loop = asyncio.new_event_loop()
        while not self._stop.is_set():
            if self.quiesced:
                self._wait_for_wake()
            sock = self._connect()
            if sock is None:
                continue
            try:
                self._serve(sock)
            except (wire.ChannelClosed, OSError) as exc:
                log.info("gpusnap agent: channel closed (%s); reconnecting", exc)
            finally:
                sock.close()

    def _connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
            facts = self.adapter.info()
            hello = agent_pb2.AgentHello(
                protocol_version=wire.PROTOCOL_VERSION,
                engine=self.adapter.engine,
                instance_id=self.instance_id,
                resumed=self.quiesced,
                wake_dir=str(self.wake_dir),
                info=dict(facts.info),
                role=facts.role,
                process=facts.process,
                expect_pids=list(facts.expect_pids),
                weights=facts.weights,
                capture_env=capture_settings.report(os.environ),
            )
            wire.send(sock, agent_pb2.AgentMessage(hello=hello))
        except OSError as exc:
            sock.close()
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
                reach.unreachable(self.socket_path, exc)
            self._stop.wait(RECONNECT_S)
            return None
        if self._unreachable_since is not None:
            reach.reached(self.socket_path, time.monotonic() - self._unreachable_since)
            self._unreachable_since = None
        self._attached.set()
        return sock

    def _wait_for_wake(self) -> None:
        wake = self.wake_dir / self.instance_id
        while not self._stop.is_set() and not wake.exists():
            time.sleep(WAKE_POLL_S)

    def _serve(self, sock: socket.socket) -> None:
        while not self._stop.is_set():
            msg, fds = wire.recv_with_fds(sock, agent_pb2.DaemonMessage())
            kind = msg.WhichOneof("command")
            start = time.monotonic()
            result = agent_pb2.CommandResult(command_id=msg.command_id, ok=True)
            try:
                if kind == "warm_up":
                    result.tokens.extend(self._call(self.adapter.warm_up()))
                elif kind == "health":
                    result.tokens.extend(self._call(self.adapter.health()))
                elif kind == "quiesce":
                    result.buffers.extend(self._quiesce(msg.quiesce.offload))
                    result.arenas.extend(self._arena_infos())
                    result.released_bytes = self.adapter.released_bytes()
                elif kind == "map_arenas":
                    result.arenas_mapped = self._map_arenas(msg.map_arenas, fds, result.timings)
                elif kind == "offload":
                    self._offload(list(msg.offload.names), fds, result.timings)
                elif kind == "free":
                    self._free(list(msg.free.names), result.timings, last=msg.free.last)
                elif kind == "reload":
                    self._reload(list(msg.reload.names), fds, result.timings)
                elif kind == "resume":
                    result.tokens.extend(self._resume(msg.resume, result.timings))
                else:
                    raise ValueError(f"unknown command {kind!r}")
            except Exception as exc:  # reported to the daemon, never fatal to the worker
                result.ok = False
                result.error = f"{type(exc).__name__}: {exc}"
            finally:
                for fd in fds:
                    os.close(fd)
            closing = result.ok and ((kind == "quiesce" and not result.buffers) or (kind == "free" and msg.free.last))
            if closing:  # the dump comes next: what the quiesced worker freed stays out of the image, and what
                heaptrim.trim()  # the CUDA checkpoint will carry is reported (a diagnostic, if asked) before the lock
                memory_report.write_if_requested()
            result.duration_seconds = time.monotonic() - start
            wire.send(sock, agent_pb2.AgentMessage(result=result))
            if closing:
                return  # close the channel before the dump

    def _quiesce(self, offload: bool) -> list[agent_pb2.BufferInfo]:
        try:
            self._call(self.adapter.quiesce())
            named = self.adapter.buffers() if offload else {}
            self._buffers = {b.name: b for b in buffers.collect(named)} if named else {}
            self._written.clear()
        except Exception:
            self._call(self.adapter.resume(None))  # a failed quiesce leaves the worker serving
            raise
        # Quiesced from here on, even if the answer never reaches the daemon (it timed out): the worker
        # then waits for its wake file, and the daemon's rollback resumes it.
        self.quiesced = True
        self._arenas = list(dict.fromkeys(b.arena for b in self._buffers.values() if b.arena is not None))
        return [
            agent_pb2.BufferInfo(
                name=b.name,
                size_bytes=b.nbytes,
                arena=self._arenas.index(b.arena) + 1 if b.arena is not None else 0,
                arena_offset=b.arena.offset_of(b.address) if b.arena is not None else 0,
            )
            for b in self._buffers.values()
        ]

    def _arena_infos(self) -> list[agent_pb2.ArenaInfo]:
        """The arenas' layouts for the daemon's prefill; none if one cannot be described (it then reloads)."""
        try:
            layouts = [a.layout() for a in self._arenas]
        except Exception as exc:  # noqa: BLE001 (an optional optimisation: the reload path still works)
            log.warning("gpusnap agent: arena layout unavailable (%s); a restore reads them back instead", exc)
            return []
        return [
            agent_pb2.ArenaInfo(
                gpu_uuid=a.gpu_uuid,
                size_bytes=a.size,
                granularity=a.granularity,
                chunk_bytes=list(a.chunks),
                storages=a.storages,
            )
            for a in layouts
        ]

    def _map_arenas(self, msg: agent_pb2.MapArenas, fds: list[int], timings: agent_pb2.Timings) -> int:
        """Adopt the daemon's filled memory as the named arenas (one descriptor per chunk, in order); their
        buffers count as read back; returns how many arenas. On failure the arenas adopted by this command are
        released again."""
        plan: list[tuple[vmm.Arena, list[buffers.Buffer]]] = []
        for m in msg.arenas:
            if not 1 <= m.arena <= len(self._arenas):
                raise ValueError(f"no arena {m.arena} (the worker has {len(self._arenas)})")
            arena = self._arenas[m.arena - 1]
            named = [self._buffers[n] for n in m.names if n in self._buffers]
            held = [b for b in self._buffers.values() if b.arena is arena]
            if len(named) != len(m.names) or {b.name for b in named} != {b.name for b in held}:
                raise ValueError(f"arena {m.arena} holds buffers {sorted(b.name for b in held)[:3]}…, not those named")
            if not all(b.name in self._out for b in held):
                raise ValueError(f"arena {m.arena} holds buffers that are not out")
            plan.append((arena, held))
        if len(fds) != sum(len(a.chunk_sizes) for a, _ in plan):
            raise ValueError(f"{len(fds)} descriptors for the arenas' chunks")
        start = time.monotonic()
        done: list[vmm.Arena] = []
        used = 0
        try:
            for arena, _ in plan:
                n = len(arena.chunk_sizes)
                arena.adopt(fds[used : used + n])
                used += n
                done.append(arena)
        except BaseException:
            for arena in done:
                arena.release()
            raise
        for _, held in plan:
            buffers.back_in(held)
            self._out.difference_update(b.name for b in held)
        timings.map = time.monotonic() - start
        return len(plan)

    def _check(self, names: list[str], fds: list[int]) -> None:
        if len(names) != len(fds):
            raise ValueError(f"{len(names)} buffer names but {len(fds)} descriptors")
        unknown = [n for n in names if n not in self._buffers]
        if unknown:
            raise ValueError(f"unknown buffers {unknown[:3]}")

    def _offload(self, names: list[str], fds: list[int], timings: agent_pb2.Timings) -> None:
        """Write the named buffers into the daemon's sealed memfds; they stay in memory until ``Free``."""
        self._check(names, fds)
        out = [n for n in names if n in self._out]
        if out:
            raise ValueError(f"buffers {out[:3]} are out already")
        timings.copy = buffers.write([self._buffers[n] for n in names], fds)
        self._written.update(names)

    def _free(self, names: list[str], timings: agent_pb2.Timings, *, last: bool) -> None:
        """Free the named buffers, which ``Offload`` wrote and the daemon has copied into its store."""
        unwritten = [n for n in names if n not in self._written]
        if unwritten:
            raise ValueError(f"buffers {unwritten[:3]} were not written out")
        picked = [self._buffers[n] for n in names]
        start = time.monotonic()
        try:
            buffers.free(picked)
        finally:  # what was freed is out, even if freeing one of them failed
            self._out.update(b.name for b in picked if b.out)
            self._written.difference_update(self._out)
        if last:
            buffers.release_host_cache(
                {b.storage.device for b in self._buffers.values() if b.storage.device.type == "cuda"}
            )
            buffers.trim_heap()
            log.info(
                "gpusnap agent: %d buffers (%d bytes) out of memory",
                len(self._out),
                sum(self._buffers[n].nbytes for n in self._out),
            )
        timings.free = time.monotonic() - start

    def _reload(self, names: list[str], fds: list[int], timings: agent_pb2.Timings) -> None:
        """Read back the named buffers that are out (a rollback may name some that never left)."""
        self._check(names, fds)
        wanted = [(self._buffers[n], fd) for n, fd in zip(names, fds, strict=True) if n in self._out]
        timings.alloc, timings.copy = buffers.read([b for b, _ in wanted], [fd for _, fd in wanted])
        self._out.difference_update(names)

    def _resume(self, msg: agent_pb2.Resume, timings: agent_pb2.Timings) -> list[int]:
        """Resume the engine, then run its canary; returns its tokens (``timings``: the resume's and the
        canary's seconds)."""
        if self._out:
            raise RuntimeError(f"{len(self._out)} buffers were not reloaded (e.g. {sorted(self._out)[0]!r})")
        context = None
        if msg.restored:
            context = RestoreContext(
                env=dict(msg.context.env), unset_env=list(msg.context.unset_env), values=dict(msg.context.values)
            )
            context.apply_env()
        start = time.monotonic()
        self._call(self.adapter.resume(context))
        resumed = time.monotonic()
        self._written.clear()
        if self._buffers:  # the reload's pinned slots, off the path to the first token
            threading.Thread(target=buffers.release_host_cache, name="gpusnap-release", daemon=True).start()
        self.quiesced = False
        self.resumed_count += 1
        tokens = self._call(self.adapter.health())
        timings.resume, timings.canary = resumed - start, time.monotonic() - resumed
        return tokens

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.loop is not None:
            fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
            return fut.result()
        assert self._own_loop is not None
        return self._own_loop.run_until_complete(coro)


PR_SET_NAME = 15
"""prctl(2): name the calling thread (at most 15 bytes)."""


def _name_thread(name: str) -> None:
    """Give the calling thread ``name`` in the kernel (its ``comm``), where the daemon can read it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError) as exc:  # no libc to call: the daemon then cannot tell it is here
        log.warning("gpusnap agent: cannot name its thread %r (%s)", name, exc)


_current: WorkerAgent | None = None


def current() -> WorkerAgent | None:
    """The agent :func:`start_agent` started in this process, if any (the daemon knows one per process)."""
    return _current


def start_agent(adapter: EngineAdapter, *, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> WorkerAgent:
    """Create and start a :class:`WorkerAgent` for ``adapter`` (see the module docstring)."""
    global _current
    _current = WorkerAgent(adapter, loop=loop, **kwargs).start()
    return _current
