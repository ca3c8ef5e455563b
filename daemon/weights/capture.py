"""Capture-side steps of the weights path: after quiesce, each agent's announced buffers are staged in the
buffer store and written out by its worker (all workers in parallel); at publish they are committed to
blobs; a failed capture (or ``--leave-running``) hands them back to the source.

The staged files, and at commit their digests, are journaled first (``journal``), so that recovery after a
daemon crash can hand them back to the quiesced worker (``gpusnap.daemon.store.buffers.HeldFiles``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from gpusnap.daemon.api.types import BufferRef
from gpusnap.daemon.store.buffers import BufferStore, HeldFiles, StagedBuffers
from gpusnap.daemon.store.facts import JournaledBuffers
from gpusnap.daemon.weights import exchange
from gpusnap.daemon.weights.exchange import Progress
from gpusnap.daemon.workers.agents import AgentInfo
from gpusnap.daemon.workers.client import AgentClient, Announced
from gpusnap.daemon.workers.parallel import in_parallel

Journal = Callable[[tuple[JournaledBuffers, ...]], None]
"""Where the staged facts go before anything depends on them (the operation's journal)."""


@dataclasses.dataclass
class AgentWeights:
    """One agent's weights in a capture: the buffers its quiesce announced, and the files staged for them."""

    client: AgentClient
    announced: list[Announced] = dataclasses.field(default_factory=list)
    staged: StagedBuffers | None = None

    @property
    def info(self) -> AgentInfo:
        return self.client.info


def offload(
    parts: Sequence[AgentWeights],
    store: BufferStore,
    timeout_s: float,
    progress: Progress,
    journal: Journal,
    before_free: Callable[[], None] = lambda: None,
) -> int:
    """The ``offload`` phase: stage every announced buffer, journal the staged files, then have every worker
    write its buffers out and free them once gpusnapd has copied them, in parallel (one progress event per
    process); returns the bytes.

    Raises:
        FailedPreconditionError, ResourceExhaustedError: see :func:`exchange.stage`.
        FailedPreconditionError, DeadlineExceededError, OSError: see :func:`exchange.offload`.
    """
    moving = [p for p in parts if p.announced]
    for part in moving:
        part.staged = exchange.stage(part.client, store, part.announced)
    journal(staged_facts(moving))
    in_parallel([lambda p=p: _offload(p, timeout_s, progress, before_free) for p in moving])  # type: ignore[misc]
    return sum(p.staged.total_bytes for p in moving if p.staged)


def _offload(part: AgentWeights, timeout_s: float, progress: Progress, before_free: Callable[[], None]) -> None:
    assert part.staged is not None
    start = time.monotonic()
    exchange.offload(part.client, part.staged, timeout_s, before_free)
    exchange.report(progress, part.info.label, part.staged.total_bytes, time.monotonic() - start, "written out")


def staged_facts(parts: Sequence[AgentWeights], digests: bool = False) -> tuple[JournaledBuffers, ...]:
    """What recovery needs to hand the buffers back after a daemon crash: per agent, its staged files and
    (with ``digests``, which waits for them) the blobs they become at commit."""
    return tuple(
        JournaledBuffers(
            instance_id=p.info.instance_id,
            uid=p.staged.uid,
            names=tuple(p.staged.names),
            paths=tuple(str(x) for x in p.staged.paths),
            digests=tuple(p.staged.digests()) if digests else (),
        )
        for p in parts
        if p.staged is not None
    )


def commit(parts: Sequence[AgentWeights], journal: Journal = lambda _: None) -> tuple[BufferRef, ...]:
    """Commit every agent's staged buffers; the references name their agent and arena. ``journal`` gets
    :func:`staged_facts` with the digests before any file moves."""
    journal(staged_facts(parts, digests=True))
    refs: list[BufferRef] = []
    for part in parts:
        if part.staged is not None:
            where = {a.name: a for a in part.announced}
            refs.extend(
                dataclasses.replace(
                    r,
                    agent=part.info.instance_id,
                    arena=where[r.name].arena,
                    arena_offset=where[r.name].arena_offset,
                )
                for r in part.staged.commit()
            )
    return tuple(refs)


def release(parts: Sequence[AgentWeights]) -> bool:
    """Release every staged file (the capture ended); returns whether any agent had buffers staged."""
    had = False
    for part in parts:
        if part.staged is not None:
            part.staged.close()
            part.staged = None
            had = True
    return had


def hand_back(client: AgentClient, staged: StagedBuffers | HeldFiles, timeout_s: float) -> None:
    """Give a source worker back the buffers it wrote to ``staged`` before it resumes (a failed capture,
    ``--leave-running``, or recovery after a daemon crash: ``HeldFiles``)."""
    exchange.reload(client, staged.names, staged.read_fds(), timeout_s)
