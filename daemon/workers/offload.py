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
from gpusnap.daemon.store.buffers import BufferStore, StagedBuffers
from gpusnap.daemon.workers.agents import AgentSession

log = structlog.get_logger(__name__)


def _batches(n: int) -> list[range]:
    return [range(i, min(i + wire.MAX_FDS, n)) for i in range(0, n, wire.MAX_FDS)]


def finish_quiesce(session: AgentSession, timeout_s: float) -> None:
    """Tell an agent that announced buffers to keep them (an empty last Offload); it then detaches."""
    msg = agent_pb2.DaemonMessage(offload=agent_pb2.Offload(last=True))
    session.call(msg, timeout_s, "detach")


def offload(
    session: AgentSession, store: BufferStore, announced: Sequence[agent_pb2.BufferInfo], timeout_s: float
) -> StagedBuffers:
    """Move the announced buffers out of the worker into staged files; digests start at once.

    The caller owns the result and must :meth:`StagedBuffers.close` it when the capture ends (after a
    rollback's :func:`reload`, if any). On error the staged files are closed here.

    Raises:
        ResourceExhaustedError: the buffer store lacks room (``BUFFER_STORE_FULL``).
        FailedPreconditionError, DeadlineExceededError: see :meth:`AgentSession.call`.
        DataLossError: the worker wrote a different size than it announced (``BUFFER_SIZE``).
    """
    staged = store.stage(session.info.uid, [b.name for b in announced], [b.size_bytes for b in announced])
    try:
        batches = _batches(len(announced))
        for i, batch in enumerate(batches):
            msg = agent_pb2.DaemonMessage(
                offload=agent_pb2.Offload(names=[staged.names[j] for j in batch], last=i == len(batches) - 1)
            )
            done = session.call(msg, timeout_s, "write its buffers out", fds=[staged.fds[j] for j in batch])
            log.info("buffers.written", pid=session.info.pid, buffers=len(batch), worker_s=round(done.duration_seconds, 3),
                     bytes=sum(staged.sizes[j] for j in batch), **dict(done.details))
        staged.start_digests()
    except BaseException:
        staged.close()
        raise
    return staged


def reload(session: AgentSession, names: Sequence[str], fds: Sequence[int], timeout_s: float) -> None:
    """Hand the worker its buffers back (``fds``: read-only, one per name; closed here)."""
    try:
        for batch in _batches(len(names)):
            msg = agent_pb2.DaemonMessage(reload=agent_pb2.Reload(names=[names[j] for j in batch]))
            done = session.call(msg, timeout_s, "read its buffers back", fds=[fds[j] for j in batch])
            log.info("buffers.read", pid=session.info.pid, buffers=len(batch), worker_s=round(done.duration_seconds, 3),
                     **dict(done.details))
    finally:
        for fd in fds:
            os.close(fd)
