"""Restore-side step of the weights path (``reload-buffers``): every restored worker gets its buffers back,
in parallel: the arenas gpusnapd prefilled meanwhile are handed over (``gpusnap.daemon.weights.prefill``),
the rest are read back from the buffer store. One progress event per process, with its bytes and seconds,
and why prefill was not used where it was not.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from gpusnap.daemon.api.types import Snapshot, WorkerInfo
from gpusnap.daemon.store.buffers import BufferStore
from gpusnap.daemon.weights import exchange
from gpusnap.daemon.weights.exchange import Progress
from gpusnap.daemon.weights.prefill import Prefill, hand_over
from gpusnap.daemon.workers.client import AgentClient
from gpusnap.daemon.workers.parallel import in_parallel


def reload(
    snapshot: Snapshot,
    clients: Mapping[str, AgentClient],
    store: BufferStore,
    timeout_s: float,
    progress: Progress,
    prefill: Prefill | None = None,
) -> None:
    """Hand every worker of ``snapshot`` that has buffers its own back (``clients``: the restored agents, by
    instance id). Call it only once the buffers are verified: the filled memory and the blobs' descriptors
    reach the workers here.

    Raises:
        FailedPreconditionError, DeadlineExceededError: see :meth:`AgentSession.call`.
    """
    in_parallel(
        [
            lambda w=w: _reload(snapshot, w, clients[w.instance_id], store, timeout_s, progress, prefill)  # type: ignore[misc]
            for w in snapshot.all_workers
            if snapshot.buffers_of(w)
        ]
    )


def _label(worker: WorkerInfo) -> str:
    return f"{worker.engine} process {worker.process} (PID {worker.pid})"


def _reload(
    snapshot: Snapshot,
    worker: WorkerInfo,
    client: AgentClient,
    store: BufferStore,
    timeout_s: float,
    progress: Progress,
    prefill: Prefill | None,
) -> None:
    refs = snapshot.buffers_of(worker)
    if prefill is not None:
        mapped = hand_over(prefill, worker, client, timeout_s)
        nbytes = sum(b.size_bytes for b in refs if b.name in mapped)
        why = prefill.why_not(worker.instance_id)
        if nbytes or why:
            tail = f"; not prefilled: {why}" if why else ""
            exchange.report(progress, _label(worker), nbytes, prefill.fill_s, "prefilled", tail)
        refs = tuple(b for b in refs if b.name not in mapped)
    if not refs:
        return
    fds = store.open_for_read(snapshot.buffer_uid, list(refs))
    start = time.monotonic()
    exchange.reload(client, [b.name for b in refs], fds, timeout_s)
    exchange.report(progress, _label(worker), sum(b.size_bytes for b in refs), time.monotonic() - start, "read back")
