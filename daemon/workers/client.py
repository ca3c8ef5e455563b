"""AgentClient: the typed commands gpusnapd sends a worker agent (``proto/gpusnap/v1/agent.proto``).

The only daemon module besides the registry's transport (:mod:`gpusnap.daemon.workers.agents`) that
touches the agent's wire messages; operations and the buffer exchange speak in these calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import structlog

from gpusnap.adapters.contract._proto import agent_pb2
from gpusnap.daemon.api.types import ArenaLayout
from gpusnap.daemon.workers.agents import AgentInfo, AgentSession

log = structlog.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class Announced:
    """A buffer the worker offers to keep out of its image (``arena``: 1-based index into the arenas its
    quiesce reported, 0 for none; ``arena_offset``: where in that arena)."""

    name: str
    size_bytes: int
    arena: int = 0
    arena_offset: int = 0


@dataclasses.dataclass(frozen=True)
class Moved:
    """The worker's report on one Offload, Free, Reload or MapArenas: seconds it took, and its own timings of the
    command's steps (``copy``, ``alloc``, ``free``, ``map``: seconds)."""

    seconds: float
    timings: Mapping[str, float]


class AgentClient:
    """Commands to one connected agent; every call raises what :meth:`AgentSession.call` raises.

    Args:
        session: the agent's live session.
    """

    def __init__(self, session: AgentSession):
        self.session = session
        self.arenas: tuple[ArenaLayout, ...] = ()
        """The address-stable arenas the worker's last quiesce reported (as the worker said: unchecked)."""
        self.released_bytes = 0
        """Memory the worker's last quiesce freed without saving it, as it said (shown by ``inspect`` only)."""

    @property
    def info(self) -> AgentInfo:
        return self.session.info

    def close(self) -> None:
        """Drop the connection (an agent mid-exchange then waits for its wake file)."""
        self.session.close()

    def warm_up(self, timeout_s: float) -> str:
        """Run the warm-up; returns the canary's token ids, comma separated."""
        done = self.session.call(agent_pb2.DaemonMessage(warm_up=agent_pb2.WarmUp()), timeout_s, "warm up")
        return self._tokens(done)

    def quiesce(self, offload: bool, timeout_s: float) -> list[Announced]:
        """Stop the worker; with ``offload`` it announces the buffers it can move (none: the channel closes)."""
        done = self.session.call(
            agent_pb2.DaemonMessage(quiesce=agent_pb2.Quiesce(offload=offload)), timeout_s, "quiesce"
        )
        self.arenas = tuple(
            ArenaLayout(a.gpu_uuid, a.size_bytes, a.granularity, tuple(a.chunk_bytes), a.storages) for a in done.arenas
        )
        self.released_bytes = self._released_bytes(done)
        return [Announced(b.name, b.size_bytes, b.arena, b.arena_offset) for b in done.buffers]

    def offload(self, names: Sequence[str], fds: Sequence[int], timeout_s: float) -> Moved:
        """Have the worker write the named buffers to ``fds`` (sealed memfds), keeping them in memory."""
        msg = agent_pb2.DaemonMessage(offload=agent_pb2.Offload(names=list(names)))
        done = self.session.call(msg, timeout_s, "write its buffers out", fds=fds)
        return Moved(done.duration_seconds, self._timings(done))

    def free(self, names: Sequence[str], last: bool, timeout_s: float) -> Moved:
        """Have the worker free the named buffers, written by :meth:`offload` (``last``: the channel closes)."""
        msg = agent_pb2.DaemonMessage(free=agent_pb2.Free(names=list(names), last=last))
        done = self.session.call(msg, timeout_s, "free its buffers")
        return Moved(done.duration_seconds, self._timings(done))

    def reload(self, names: Sequence[str], fds: Sequence[int], timeout_s: float) -> Moved:
        """Have the worker read the named buffers back from ``fds`` (read-only)."""
        msg = agent_pb2.DaemonMessage(reload=agent_pb2.Reload(names=list(names)))
        done = self.session.call(msg, timeout_s, "read its buffers back", fds=fds)
        return Moved(done.duration_seconds, self._timings(done))

    def map_arenas(self, arenas: Sequence[tuple[int, Sequence[str]]], fds: Sequence[int], timeout_s: float) -> Moved:
        """Have the worker import and map the daemon-filled memory of ``arenas`` ((1-based index, the names of
        its buffers)); ``fds``: one exported handle per chunk, arena after arena."""
        msg = agent_pb2.DaemonMessage(
            map_arenas=agent_pb2.MapArenas(
                arenas=[agent_pb2.MappedArena(arena=i, names=list(names)) for i, names in arenas]
            )
        )
        done = self.session.call(msg, timeout_s, "map its prefilled arenas", fds=fds)
        return Moved(done.duration_seconds, self._timings(done))

    def resume(
        self,
        timeout_s: float,
        *,
        restored: bool,
        env: Mapping[str, str] | None = None,
        unset_env: Sequence[str] = (),
        values: Mapping[str, str] | None = None,
    ) -> str:
        """Resume the worker (``restored``: in a restored copy, with the restore context); returns the canary's
        token ids, comma separated (empty for processes without one)."""
        resume = agent_pb2.Resume(restored=restored)
        if restored:
            resume.context.CopyFrom(
                agent_pb2.RestoreContext(env=dict(env or {}), unset_env=list(unset_env), values=dict(values or {}))
            )
        done = self.session.call(agent_pb2.DaemonMessage(resume=resume), timeout_s, "resume")
        timings = self._timings(done)
        log.info(
            "agent.resumed",
            pid=self.info.pid,
            role=self.info.role,
            seconds=round(done.duration_seconds, 4),
            resume_s=round(timings.get("resume", 0.0), 4),
            canary_s=round(timings.get("canary", 0.0), 4),
        )
        return self._tokens(done)

    # What a command result reports: protocol 3's fields, or protocol 2's ``details`` (agent.proto's header).
    # The agent is not trusted: counts and seconds outside their range read as 0.

    def _tokens(self, done: agent_pb2.CommandResult) -> str:
        """The canary's token ids, comma separated (as a snapshot's ``canary_tokens``)."""
        if self.info.protocol == 2:
            return done.details.get("tokens", "")
        return ",".join(str(t) for t in done.tokens)

    def _released_bytes(self, done: agent_pb2.CommandResult) -> int:
        if self.info.protocol == 2:
            text = done.details.get("released_bytes", "")
            return int(text) if text.isdigit() and len(text) < 19 else 0
        return done.released_bytes if done.released_bytes < 1 << 63 else 0

    def _timings(self, done: agent_pb2.CommandResult) -> dict[str, float]:
        """The worker's own timings of the command's steps that it reported (seconds, by step)."""
        if self.info.protocol == 2:
            found = {step: _seconds(done.details.get(f"{step}_s", "")) for step in STEPS}
        else:
            found = {step: getattr(done.timings, step) for step in STEPS}
        return {step: s for step, s in found.items() if 0 < s < MAX_SECONDS}


STEPS = ("copy", "alloc", "free", "map", "resume", "canary")
"""The steps of a command a worker times (``Timings`` in agent.proto)."""
MAX_SECONDS = 1e6
"""Timings above this (or not finite) are not believed."""


def _seconds(text: str) -> float:
    """A protocol-2 timing: a decimal number of seconds, else 0."""
    try:
        return float(text[:24])
    except ValueError:
        return 0.0
