"""call_with_deadline: bounded blocking calls (FC-03)."""

from __future__ import annotations

import threading
import time

import pytest

from gpusnap.daemon.api.errors import DeadlineExceededError
from gpusnap.daemon.drivers.deadline import call_with_deadline


def _running(what: str) -> bool:
    """Whether the call ``what`` left behind still runs (its thread is named after it)."""
    return f"gpusnap-deadline[{what}]" in [t.name for t in threading.enumerate()]


def test_returns_value_and_passes_args() -> None:
    assert call_with_deadline(lambda a, b: a + b, 2, 3, timeout_s=1.0, what="add") == 5
    assert call_with_deadline(lambda: "x", timeout_s=None, what="no deadline") == "x"


def test_reraises_callee_exception() -> None:
    def boom() -> None:
        raise KeyError("k")

    with pytest.raises(KeyError):
        call_with_deadline(boom, timeout_s=1.0, what="boom")


def test_deadline_names_what_and_leaves_thread_behind() -> None:
    release = threading.Event()
    late: list[str] = []

    def slow() -> str:
        release.wait()
        return "done"

    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError) as e:
        call_with_deadline(
            slow,
            timeout_s=0.2,
            what="cuCheckpointProcessCheckpoint(pid=9)",
            on_late_result=late.append,
        )
    assert 0.15 < time.monotonic() - t0 < 2
    err = e.value
    assert err.reason == "DRIVER_CALL_TIMEOUT"
    assert err.message.startswith("cuCheckpointProcessCheckpoint(pid=9) did not return within 0.2 s")
    assert err.metadata == {"what": "cuCheckpointProcessCheckpoint(pid=9)", "timeout_s": "0.2"}
    what = "cuCheckpointProcessCheckpoint(pid=9)"
    assert _running(what), "the call is left running"
    release.set()
    deadline = time.monotonic() + 5
    while (not late or _running(what)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late == ["done"]  # compensating callback ran with the late result
    assert not _running(what)


def test_late_error_is_swallowed_and_forgotten() -> None:
    release = threading.Event()

    def fail_later() -> None:
        release.wait()
        raise RuntimeError("late")

    with pytest.raises(DeadlineExceededError):
        call_with_deadline(fail_later, timeout_s=0.05, what="late failure")
    assert _running("late failure")
    release.set()
    deadline = time.monotonic() + 5
    while _running("late failure") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _running("late failure")


def test_rejects_nonpositive_timeout() -> None:
    with pytest.raises(ValueError):
        call_with_deadline(lambda: None, timeout_s=0, what="x")


def test_contextvars_propagate() -> None:
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("op", default="none")
    var.set("op-1")
    assert call_with_deadline(var.get, timeout_s=1.0, what="ctx") == "op-1"
