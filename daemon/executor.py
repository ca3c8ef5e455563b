"""The daemon's one bounded executor: named lanes of worker threads, one owner, one shutdown.

``build_daemon`` (``gpusnap.daemon.server``) makes one :class:`Executor` and hands it by constructor to the
store, the buffer store, the prefill and the gRPC server; the daemon's stop calls :meth:`Executor.shutdown`
once no operation runs, before the agent channel closes and the store's lock is released. Every pool the daemon's work runs on is a lane here, and every lane's bound is a field of
:class:`LaneSizes`, so the bounds are set in one place.

Deadlocks: a task that waits on a future of its *own* lane can wait forever once every thread of that lane
is such a waiter. So a task waits only on the lanes :data:`MAY_WAIT_ON` lists for its lane, and no lane
lists itself (a test checks the graph has no cycle). Today:

====================  ======================  ===========================================================
lane                  may wait on             runs
====================  ======================  ===========================================================
``rpc``               every other lane        the gRPC server's unary calls (``service/servicers.py``)
``buffer_jobs``       ``buffer_io``           a capture's digest job, a restore's read-ahead and verify, the
                                              budget pass (``store/buffers.py``)
``buffer_io``         --                      memfd copies into staged buffers, buffer chunk digests
``digest``            --                      image chunk digests (``store/checksum.py``: dump, verify)
``fsync``             --                      a publish's fsyncs (``store/durable.fsync_tree``)
``prefill``           --                      the prefill's background registrations, in order (one thread)
====================  ======================  ===========================================================

The table is also checked where tasks wait: :func:`check_wait` (called by ``checksum.file_digests``,
``durable.fsync_tree`` and the buffer store's copies) raises at once when a lane's task is about to wait on
a lane the table does not allow it, so a mistake fails loudly instead of hanging once the lane is full.

Threads that are not lanes, and why, are listed in docs/architecture.md ("Threads").
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import structlog

log = structlog.get_logger(__name__)

CORES = max(2, len(os.sched_getaffinity(0)))
"""Hashing threads per digest lane: one per core gpusnapd may run on (its CPU affinity, which a cpuset
narrows; hashlib releases the GIL), at least two."""

MAY_WAIT_ON: dict[str, tuple[str, ...]] = {
    "rpc": ("buffer_jobs", "buffer_io", "digest", "fsync", "prefill"),
    "buffer_jobs": ("buffer_io",),
    "buffer_io": (),
    "digest": (),
    "fsync": (),
    "prefill": (),
}
"""Lane → the lanes its tasks may block on (the module docstring's table). No lane waits on itself."""


@dataclasses.dataclass(frozen=True)
class LaneSizes:
    """Threads per lane (each at least 1). The defaults are the bounds the daemon runs with."""

    rpc: int = 32
    """Unary gRPC calls at once, shared by all callers (each holds at most ``max_calls_per_caller``)."""
    buffer_jobs: int = 8
    """Buffer-store jobs at once: digest jobs of captures, read-aheads and verifies of restores, budget passes."""
    buffer_io: int = CORES
    """Copies of worker memfds (``buffers.COPY_CHUNK_BYTES`` each) and buffer chunk digests at once."""
    digest: int = CORES
    """Image chunks (``checksum.CHUNK_BYTES``) hashed at once, over all dumps and verifies."""
    fsync: int = 16
    """fsyncs in flight at once: the journal commits of concurrent fsyncs are grouped (ext4's jbd2, XFS's
    log), so 40 small CRIU images sync in about 0.03 s together against 0.15–0.23 s one by one (ext4 on a
    virtual disk; ``make bench-overhead``)."""
    prefill: int = 1
    """The prefill's registrations ahead: one thread, so they run in the order they were queued."""

    def __post_init__(self) -> None:
        small = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) < 1]
        if small:
            raise ValueError(f"every lane needs at least one thread: {', '.join(small)}")


_here = threading.local()
"""``lane``: the name of the lane whose thread this is (unset on other threads)."""


def _enter(name: str) -> None:
    _here.lane = name


class Lane(ThreadPoolExecutor):
    """One lane: a ``ThreadPoolExecutor`` of ``size`` threads named ``gpusnap-<name>_<n>``, each of which knows
    its lane (:func:`current_lane`)."""

    def __init__(self, name: str, size: int):
        prefix = f"gpusnap-{name.replace('_', '-')}"
        super().__init__(max_workers=size, thread_name_prefix=prefix, initializer=_enter, initargs=(name,))
        self.name = name


def current_lane() -> str | None:
    """The name of the lane the calling thread belongs to; None on any other thread."""
    return getattr(_here, "lane", None)


def check_wait(pool: object) -> None:
    """Check that the calling thread may wait on tasks of ``pool`` (:data:`MAY_WAIT_ON`). Pools that are not
    lanes, and threads that are not a lane's, are not checked.

    Raises:
        RuntimeError: the calling thread is a task of a lane that may not wait on ``pool``'s lane (its own
            among them): once that lane is full of such waiters, none would ever run.
    """
    here = current_lane()
    if here is None or not isinstance(pool, Lane) or pool.name in MAY_WAIT_ON[here]:
        return
    raise RuntimeError(
        f"a task of gpusnapd's {here!r} lane is about to wait on its {pool.name!r} lane, which "
        "gpusnap.daemon.executor.MAY_WAIT_ON does not allow (it could deadlock): run the waiting work elsewhere"
    )


class Executor:
    """The lanes of :data:`MAY_WAIT_ON`, each a ``ThreadPoolExecutor`` of its :class:`LaneSizes` bound whose
    threads are named ``gpusnap-<lane>_<n>`` and start on first use.

    Raises:
        ValueError: a lane of fewer than one thread (from :class:`LaneSizes`).
    """

    def __init__(self, sizes: LaneSizes = LaneSizes()):  # noqa: B008 (frozen)
        self.rpc = Lane("rpc", sizes.rpc)
        self.buffer_jobs = Lane("buffer_jobs", sizes.buffer_jobs)
        self.buffer_io = Lane("buffer_io", sizes.buffer_io)
        self.digest = Lane("digest", sizes.digest)
        self.fsync = Lane("fsync", sizes.fsync)
        self.prefill = Lane("prefill", sizes.prefill)

    def lanes(self) -> dict[str, Lane]:
        """Lane name (a key of :data:`MAY_WAIT_ON`) → its pool."""
        return {name: getattr(self, name) for name in MAY_WAIT_ON}

    def threads(self) -> list[threading.Thread]:
        """The lanes' threads started so far and still alive."""
        return [t for pool in self.lanes().values() for t in list(pool._threads) if t.is_alive()]

    def stop_lane(self, name: str) -> None:
        """Refuse new tasks on lane ``name`` (a key of :data:`MAY_WAIT_ON`) and drop its queued ones; running
        ones finish (:meth:`shutdown` waits for them). The gRPC server's stop does this for ``rpc``.

        Raises:
            KeyError: no such lane.
        """
        self.lanes()[name].shutdown(wait=False, cancel_futures=True)

    def shutdown(self, timeout_s: float = 30.0) -> list[str]:
        """Drop every queued task, then wait up to ``timeout_s`` seconds in all for the running ones to end;
        returns the names of the threads still running then (logged; empty when all ended). New tasks are
        refused from the first step on (``RuntimeError`` from ``submit``). Idempotent."""
        for pool in self.lanes().values():
            pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout_s
        for thread in self.threads():
            thread.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in self.threads()]
        if left:
            log.warning("executor.threads_left", threads=left, waited_s=timeout_s)
        return left
