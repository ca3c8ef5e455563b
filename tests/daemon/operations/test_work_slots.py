"""Issue 19 item 4: one user's operations leave work slots to others, and fan-out copies count against it.

The per-user cap of running operations (16) was above the daemon's work slots (8), so one user's fan-out
restores held every slot (root's dump went from 0.24 s to 7.65 s), and each of up to 16 x 64 copies had a
namespace init of root's outside the user's limits.
"""

from __future__ import annotations

import threading

import pytest

from gpusnap.daemon.api.errors import ResourceExhaustedError, UnavailableError
from gpusnap.daemon.operations.base import OperationKind, OperationRecord, PhaseRunner
from gpusnap.daemon.operations.registry import OperationRegistry


def test_a_user_holds_at_most_half_the_work_slots_and_root_still_gets_one() -> None:
    registry = OperationRegistry(max_workers=4, max_per_caller=16)
    release = threading.Event()
    working = threading.Semaphore(0)

    def busy(_run: PhaseRunner) -> None:
        working.release()
        release.wait(30)

    for _ in range(6):
        registry.start(OperationRecord(OperationKind.RESTORE, owner_uid=1000), (), busy)
    started = sum(working.acquire(timeout=1 if i >= 2 else 10) for i in range(3))
    assert started == 2, f"user 1000 works {started} operations at once, of 4 slots"
    root_ran = threading.Event()
    registry.start(OperationRecord(OperationKind.CHECKPOINT, owner_uid=0), (), lambda _run: root_ran.set())
    assert root_ran.wait(5), "root's operation found no free work slot"
    release.set()
    registry.shutdown()


def test_fan_out_copies_count_against_their_caller() -> None:
    registry = OperationRegistry(max_workers=4, max_per_caller=16)
    release = threading.Event()
    registry.start(OperationRecord(OperationKind.RESTORE, owner_uid=1000), (), lambda _r: release.wait(30), weight=12)
    with pytest.raises(ResourceExhaustedError, match="this one needs 8"):
        registry.start(OperationRecord(OperationKind.RESTORE, owner_uid=1000), (), lambda _r: None, weight=8)
    registry.start(OperationRecord(OperationKind.RESTORE, owner_uid=1000), (), lambda _r: None, weight=4)
    release.set()
    registry.shutdown()


def test_no_operation_starts_once_the_registry_shuts_down() -> None:
    """A call that outlived the server's grace period at gpusnapd's stop starts nothing the stop would cut
    short (its publish's fsyncs would meet a shut-down lane): it is told the daemon is unavailable."""
    registry = OperationRegistry(max_workers=4)
    registry.shutdown()
    ran = threading.Event()
    with pytest.raises(UnavailableError, match="gpusnapd is stopping") as err:
        registry.start(OperationRecord(OperationKind.CHECKPOINT, owner_uid=0), (), lambda _r: ran.set())
    assert err.value.reason == "DAEMON_UNAVAILABLE"
    assert not ran.wait(0.2) and registry.list() == []
