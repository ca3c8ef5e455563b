"""Bound blocking calls (CUDA driver, NVML) with a wall-clock deadline.

A hung ``cuCheckpointProcess*`` call must never block the daemon forever (FC-03, NVIDIA/cuda-checkpoint#45;
FC-02, #30). Python cannot interrupt a thread stuck inside a C library, so :func:`call_with_deadline` runs the
call in a *daemon* thread and stops waiting when the deadline passes. The thread is **left behind**: it keeps
running until the library returns (possibly never). It does not keep the interpreter alive at exit, but it
does hold whatever the library holds (driver locks), so later calls into the same driver may hang as well;
they are bounded the same way. The thread is named ``gpusnap-deadline[<what>]``, so a stack dump names the
call that hangs.

An abandoned call that returns late may have changed the world after the caller gave up (a lock that finally
succeeded leaves a process LOCKED). ``on_late_result`` lets the caller register a compensating action that
runs in the abandoned thread when that happens.

Each call gets a thread of its own, not a lane of ``gpusnap.daemon.executor``: a lane's thread taken by a
call that never returns would be lost to that lane for good, and enough hung calls would starve it.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

from gpusnap.daemon.api.errors import DeadlineExceededError

T = TypeVar("T")


class _Box(Generic[T]):
    """Result slot shared between the caller and the worker thread (guarded by ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.completed = False
        self.abandoned = False
        self.value: T | None = None
        self.error: BaseException | None = None


def call_with_deadline(
    fn: Callable[..., T],
    *args: Any,
    timeout_s: float | None,
    what: str,
    on_late_result: Callable[[T], object] | None = None,
) -> T:
    """Run ``fn(*args)`` in a daemon thread and wait at most ``timeout_s`` seconds for it.

    Args:
        fn: the blocking callable (e.g. ``CudaDriver.lock``).
        *args: positional arguments for ``fn``.
        timeout_s: wall-clock limit in seconds (> 0); ``None`` waits forever (use only for calls known to
            return).
        what: what the call is, for messages, e.g. ``"cuCheckpointProcessLock(pid=1234)"``.
        on_late_result: called with ``fn``'s return value, in the abandoned thread, if ``fn`` returns
            successfully *after* the deadline fired; its exceptions are swallowed. Use it to undo a late
            success (unlock a process whose lock completed after the caller gave up).

    Returns:
        Whatever ``fn`` returns.

    Raises:
        DeadlineExceededError: ``fn`` did not return within ``timeout_s`` (reason ``DRIVER_CALL_TIMEOUT``,
            metadata ``what`` and ``timeout_s``). The thread running ``fn`` is left behind (see module doc).
        ValueError: ``timeout_s`` is not positive.
        BaseException: whatever ``fn`` raised, re-raised unchanged in the caller's thread.
    """
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    box: _Box[T] = _Box()
    ctx = contextvars.copy_context()  # keep structlog/contextvars bindings inside the worker thread

    def runner() -> None:
        value: T | None = None
        error: BaseException | None = None
        try:
            value = ctx.run(fn, *args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            error = exc
        with box.lock:
            box.value, box.error, box.completed = value, error, True
            late = box.abandoned
        box.done.set()
        if late and error is None and on_late_result is not None:
            try:
                on_late_result(cast(T, value))
            except Exception:  # noqa: BLE001 - best effort, nobody is waiting any more
                pass

    thread = threading.Thread(target=runner, name=f"gpusnap-deadline[{what}]", daemon=True)
    thread.start()
    box.done.wait(timeout_s)
    with box.lock:
        if not box.completed:
            box.abandoned = True
            raise DeadlineExceededError(
                f"{what} did not return within {timeout_s:g} s; gave up waiting (the call keeps running in a "
                "background thread). A driver call that never returns usually means an unsupported topology, "
                "e.g. NCCL collectives in flight (FC-02/FC-03): do not retry blindly; restart the worker, and "
                "the daemon if later CUDA calls hang too",
                reason="DRIVER_CALL_TIMEOUT",
                metadata={"what": what, "timeout_s": f"{timeout_s:g}"},
            )
    if box.error is not None:
        raise box.error
    return cast(T, box.value)  # set whenever no error was stored
