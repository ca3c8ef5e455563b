"""Calls to several agents at once (the processes of one engine answer in parallel)."""

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
