"""Calls to several agents at once (the processes of one engine answer in parallel).

One thread per call, for the call's length, not a lane of ``gpusnap.daemon.executor``: the ranks of one
engine may rendezvous inside a call (a quiesce or resume that syncs their communicators), so a call that
waited for a free thread behind another rank's call could wait forever; the calls' number is bounded by an
engine's processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor


def in_parallel(calls: Sequence[Callable[[], None]]) -> None:
    """Run ``calls`` at once (one thread each), wait for all, and raise the first failure."""
    if len(calls) <= 1:
        for call in calls:
            call()
        return
    with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="gpusnap-agents") as pool:
        futures = [pool.submit(call) for call in calls]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]  # type: ignore[misc]
