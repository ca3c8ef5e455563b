"""The daemon's half of the named-buffer exchange with a worker agent (``agent.proto``: Offload, Reload).

Capture: after Quiesce, :func:`stage` creates one buffer-store file per buffer the worker announced, and
:func:`offload` hands the worker, in batches, a sealed memfd per buffer to write it into (never a descriptor
of the store's files: ``gpusnap.daemon.store.sealed``), copies each batch into the store while the worker
writes the next, has the worker free its buffers once all are copied, then starts digesting the files
while the GPU checkpoint and the CRIU dump run. Restore and rollback: :func:`reload` hands read-only descriptors
back before Resume. Every frame that carries descriptors (these and the prefill's ``MapArenas``) is cut by
:func:`fd_batches`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol, TypeVar

import structlog

from gpusnap.adapters.contract import wire
from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.store.buffers import BufferStore, StagedBuffers
from gpusnap.daemon.workers.client import AgentClient, Announced

log = structlog.get_logger(__name__)

T = TypeVar("T")


class Progress(Protocol):
    """Where a step reports bytes moved (an operation's phase progress)."""

    def report(self, done: int, total: int, message: str = "", rate: float | None = None) -> None: ...


def report(progress: Progress, label: str, nbytes: int, seconds: float, what: str, tail: str = "") -> None:
    """One progress event for one process (``label``): its bytes, its rate, and a message with its seconds (then
    ``tail``)."""
    progress.report(
        nbytes,
        nbytes,
        message=f"{label}: {nbytes} bytes {what} in {seconds:.3f} s{tail}",
        rate=nbytes / seconds if seconds > 0 else 0.0,
    )


def fd_batches(items: Sequence[T], fds_of: Callable[[T], int] = lambda _: 1) -> list[list[T]]:
    """``items`` in order, grouped so that each frame carries at most ``wire.MAX_FDS`` descriptors
    (``fds_of``: how many one item carries; an item over the limit alone gets a frame of its own)."""
    out: list[list[T]] = [[]]
    count = 0
    for item in items:
        n = fds_of(item)
        if count + n > wire.MAX_FDS and out[-1]:
            out.append([])
            count = 0
        out[-1].append(item)
        count += n
    return [b for b in out if b]


BATCH_BYTES = 256 << 20
"""An Offload batch holds buffers up to this many bytes, or up to 1/``BATCHES`` of the total if that is more
(a buffer larger than that alone): gpusnapd copies a batch into the store while the worker writes the next,
so only the last batch's copy adds to the phase."""
BATCHES = 8
AHEAD = 1
"""Batches whose copy may still run while the worker writes the next: what the memfds hold at once stays
within ``AHEAD + 1`` batches (host memory, and descriptors)."""
SLOWEST_STORE_BYTES_PER_S = 100 << 20
"""A batch's time bound grows by its bytes at this rate (a slow disk), on top of the fixed timeout."""
MAX_BUFFERS = 16384
"""Buffers one worker may announce: each holds a staged file (and descriptor) open during its capture."""


def stage(agent: AgentClient, store: BufferStore, announced: Sequence[Announced]) -> StagedBuffers:
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
        f"{len(names)} buffers (at most {MAX_BUFFERS})"
        if len(names) > MAX_BUFFERS
        else "an empty name"
        if not all(names)
        else "a repeated name"
        if len(set(names)) != len(names)
        else "an empty buffer"
        if not all(b.size_bytes for b in announced)
        else ""
    )
    if problem:
        raise FailedPreconditionError(
            f"the {agent.info.label} announced {problem}; fix its adapter's buffers() or checkpoint with --no-offload",
            reason="BAD_BUFFERS",
        )
    return store.stage(agent.info.uid, names, [b.size_bytes for b in announced])


def batch_timeout(timeout_s: float, nbytes: int) -> float:
    """The bound on one Offload or Reload batch moving ``nbytes``: ``timeout_s`` plus the time the slowest
    store gpusnap plans for (``SLOWEST_STORE_BYTES_PER_S``) needs for them."""
    return timeout_s + nbytes / SLOWEST_STORE_BYTES_PER_S


def offload_batches(sizes: Sequence[int]) -> list[list[int]]:
    """Indices of ``sizes`` in order, grouped into Offload batches: at most ``wire.MAX_FDS`` each, and at most
    ``max(BATCH_BYTES, total / BATCHES)`` bytes unless a single buffer is larger."""
    cap = max(BATCH_BYTES, sum(sizes) // BATCHES)
    out: list[list[int]] = []
    for group in fd_batches(range(len(sizes))):
        out.append([])
        nbytes = 0
        for i in group:
            if out[-1] and nbytes + sizes[i] > cap:
                out.append([])
                nbytes = 0
            out[-1].append(i)
            nbytes += sizes[i]
    return out


def offload(
    agent: AgentClient, staged: StagedBuffers, timeout_s: float, before_free: Callable[[], None] = lambda: None
) -> float:
    """Have the worker write its buffers into sealed memfds, in batches, copy each batch into ``staged`` while
    the worker writes the next, then have the worker free them all; digests start at once.

    The worker frees nothing before every copy is done, so its buffers are always either in its memory or
    in gpusnapd's files (a daemon crash in between leaves them in the worker). A failure part-way leaves
    some buffers out of the worker only if it is in ``Free``: the capture's rollback reads them back from
    ``staged`` (the agent skips those it still holds). ``before_free`` runs once every copy is done (the
    fault matrix's ``offload-free`` point).

    Raises:
        FailedPreconditionError, DeadlineExceededError: see :meth:`AgentSession.call`.
        OSError: a copy into the store failed (``ENOSPC``).

    Returns:
        Seconds the worker spent (its own measure, summed over batches).
    """
    spent = 0.0
    copying: list[list[Future[None]]] = []
    for batch in offload_batches(staged.sizes):
        if len(copying) > AHEAD:
            for future in copying.pop(0):
                future.result()
        nbytes = sum(staged.sizes[j] for j in batch)
        done = agent.offload([staged.names[j] for j in batch], staged.memfds(batch), batch_timeout(timeout_s, nbytes))
        copying.append(staged.copy_in(batch))
        spent += done.seconds
        log.info(
            "buffers.written",
            pid=agent.info.pid,
            buffers=len(batch),
            worker_s=round(done.seconds, 3),
            bytes=nbytes,
            **{f"{step}_s": round(seconds, 3) for step, seconds in done.timings.items()},
        )
    start = time.monotonic()
    staged.wait_copies()
    copied = time.monotonic()
    before_free()
    done = agent.free(staged.names, last=True, timeout_s=timeout_s)
    spent += done.seconds
    log.info("buffers.freed", pid=agent.info.pid, copy_wait_s=round(copied - start, 3), worker_s=round(done.seconds, 3))
    staged.start_digests()
    return spent


def reload(agent: AgentClient, names: Sequence[str], fds: Sequence[int], timeout_s: float) -> float:
    """Hand the worker its buffers back (``fds``: read-only, one per name; closed here); returns the seconds
    the worker spent."""
    spent = 0.0
    try:
        for batch in fd_batches(range(len(names))):
            nbytes = sum(os.fstat(fds[j]).st_size for j in batch)
            done = agent.reload([names[j] for j in batch], [fds[j] for j in batch], batch_timeout(timeout_s, nbytes))
            spent += done.seconds
            log.info(
                "buffers.read",
                pid=agent.info.pid,
                buffers=len(batch),
                worker_s=round(done.seconds, 3),
                **{f"{step}_s": round(seconds, 3) for step, seconds in done.timings.items()},
            )
    finally:
        for fd in fds:
            os.close(fd)
    return spent
