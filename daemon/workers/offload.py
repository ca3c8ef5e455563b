"""The daemon's half of the named-buffer exchange with a worker agent (``agent.proto``: Offload, Reload).

Capture: after Quiesce, :func:`offload` stages one buffer-store file per buffer the worker announced,
hands the worker read-write descriptors in batches, and starts digesting the files while the GPU
checkpoint and the CRIU dump run. Restore and rollback: :func:`reload` hands read-only descriptors back
before Resume.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import structlog

from gpusnap.adapters import wire
from gpusnap.adapters._proto import agent_pb2
from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.store.buffers import BufferStore, StagedBuffers
from gpusnap.daemon.workers.agents import AgentSession

log = structlog.get_logger(__name__)


def _batches(n: int) -> list[range]:
    return [range(i, min(i + wire.MAX_FDS, n)) for i in range(0, n, wire.MAX_FDS)]


SLOWEST_STORE_BYTES_PER_S = 100 << 20
"""A batch's time bound grows by its bytes at this rate (a slow disk), on top of the fixed timeout."""
MAX_BUFFERS = 16384
"""Buffers one worker may announce: each holds a staged file (and descriptor) open during its capture."""


def stage(session: AgentSession, store: BufferStore, announced: Sequence[agent_pb2.BufferInfo]) -> StagedBuffers:
    """Staged files for the buffers the worker announced (see :meth:`BufferStore.stage`).

    The caller owns the result: it hands it to a rollback's :func:`reload` if the capture fails, and
    closes it (:meth:`StagedBuffers.close`) when the capture ends.

    Raises:
        FailedPreconditionError: a malformed announcement (``BAD_BUFFERS``): more than ``MAX_BUFFERS``,
            an empty or repeated name, an empty buffer.
        ResourceExhaustedError: the buffer store lacks room (``BUFFER_STORE_FULL``).
    """
    names = [b.name for b in announced]
    problem = (
        f"{len(names)} buffers (at most {MAX_BUFFERS})" if len(names) > MAX_BUFFERS
        else "an empty name" if not all(names)
        else "a repeated name" if len(set(names)) != len(names)
        else "an empty buffer" if not all(b.size_bytes for b in announced)
        else ""
    )
    if problem:
        raise FailedPreconditionError(
            f"the {session.info.engine} worker (PID {session.info.pid}) announced {problem}; fix its adapter's "
            "buffers() or checkpoint with --no-offload",
            reason="BAD_BUFFERS",
        )
    return store.stage(session.info.uid, names, [b.size_bytes for b in announced])


def batch_timeout(timeout_s: float, nbytes: int) -> float:
    """The bound on one Offload or Reload batch moving ``nbytes``: ``timeout_s`` plus the time the slowest
    store gpusnap plans for (``SLOWEST_STORE_BYTES_PER_S``) needs for them."""
    return timeout_s + nbytes / SLOWEST_STORE_BYTES_PER_S


def offload(session: AgentSession, staged: StagedBuffers, timeout_s: float) -> None:
    """Have the worker write its buffers into ``staged`` and free them, in batches; digests start at once.

    A failure part-way leaves some buffers out of the worker: the capture's rollback reads them back from
    ``staged`` (the agent skips those it still holds).

    Raises:
        FailedPreconditionError, DeadlineExceededError: see :meth:`AgentSession.call`.
        DataLossError: the worker wrote a different size than it announced (``BUFFER_SIZE``).
    """
    batches = _batches(len(staged.names))
    for i, batch in enumerate(batches):
        msg = agent_pb2.DaemonMessage(
            offload=agent_pb2.Offload(names=[staged.names[j] for j in batch], last=i == len(batches) - 1)
        )
        nbytes = sum(staged.sizes[j] for j in batch)
        done = session.call(msg, batch_timeout(timeout_s, nbytes), "write its buffers out",
                            fds=[staged.fds[j] for j in batch])
        log.info("buffers.written", pid=session.info.pid, buffers=len(batch), worker_s=round(done.duration_seconds, 3),
                 bytes=nbytes, **dict(done.details))
    staged.start_digests()


def reload(session: AgentSession, names: Sequence[str], fds: Sequence[int], timeout_s: float) -> None:
    """Hand the worker its buffers back (``fds``: read-only, one per name; closed here)."""
    try:
        for batch in _batches(len(names)):
            msg = agent_pb2.DaemonMessage(reload=agent_pb2.Reload(names=[names[j] for j in batch]))
            nbytes = sum(os.fstat(fds[j]).st_size for j in batch)
            done = session.call(msg, batch_timeout(timeout_s, nbytes), "read its buffers back",
                                fds=[fds[j] for j in batch])
            log.info("buffers.read", pid=session.info.pid, buffers=len(batch), worker_s=round(done.duration_seconds, 3),
                     **dict(done.details))
    finally:
        for fd in fds:
            os.close(fd)
