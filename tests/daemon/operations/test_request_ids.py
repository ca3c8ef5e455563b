"""Issue 19 item 4: idempotency keys are kept per caller, for a stated time, and per kind of operation.

They were kept only among the newest 256 finished operations of all users: one user's 300 cheap failing
restores evicted root's key, and root's retry with the same ``request_id`` started a second restore. A
``request_id`` reused for another kind of operation also returned the other kind's operation.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.operations.base import OperationKind, OperationRecord, PhaseRunner
from gpusnap.daemon.operations.registry import OperationRegistry
from gpusnap.daemon.store import journal


def _fail(_run: PhaseRunner) -> None:
    raise FailedPreconditionError("no such snapshot", reason="SNAPSHOT_NOT_FOUND")


def _finished(registry: OperationRegistry, uid: int, kind: OperationKind, request_id: str) -> OperationRecord:
    record = registry.start(OperationRecord(kind, owner_uid=uid, request_id=request_id), (), _fail)
    assert record.wait(30) and record.done
    return record


def test_one_callers_operations_never_evict_anothers_key() -> None:
    registry = OperationRegistry()
    roots = _finished(registry, 0, OperationKind.RESTORE, "deploy-7")
    for i in range(300):
        _finished(registry, 1000, OperationKind.RESTORE, f"spam-{i}")
    assert registry.find_request(0, "restore", "deploy-7") is roots
    assert registry.find_request(0, "checkpoint", "deploy-7") is None, "a key is per kind"
    assert registry.find_request(1000, "restore", "spam-299") is not None
    again = registry.start(OperationRecord(OperationKind.RESTORE, owner_uid=0, request_id="deploy-7"), (), _fail)
    assert again is roots


def test_keys_are_kept_for_a_stated_time_and_a_bounded_count_per_caller() -> None:
    now = datetime.now(UTC)
    old = now - timedelta(seconds=journal.REQUEST_ID_KEEP_S + 60)
    ops = [(f"op-new{i}", 1000, f"k{i}", now - timedelta(seconds=i)) for i in range(journal.KEEP_FINISHED)]
    ops += [("op-mine", 0, "deploy-7", now - timedelta(hours=1)), ("op-stale", 0, "deploy-6", old)]
    ops += [(f"op-flood{i}", 1000, f"f{i}", now - timedelta(hours=2, seconds=i)) for i in range(2000)]
    keep = journal.kept(ops, now)
    assert "op-mine" in keep, "root's key, within the day, survives another user's flood"
    assert "op-stale" not in keep, "a key older than REQUEST_ID_KEEP_S goes with the newest-N rule"
    assert sum(1 for op_id in keep if op_id.startswith("op-flood")) <= journal.REQUEST_IDS_PER_CALLER
