"""One executor for the tests that build a store, a buffer store or a prefill without a daemon (as
``build_daemon`` builds one per daemon): its lanes start threads on first use and end with the test run."""

from __future__ import annotations

from gpusnap.daemon.executor import Executor, Lane, LaneSizes

LANES = Executor()

SERIAL = Executor(LaneSizes(buffer_jobs=1))
"""Lanes whose ``buffer_jobs`` and ``prefill`` run one task at a time, in the order queued: :func:`drain` waits
for what a buffer store or a prefill queued in the background."""


def drain(lane: Lane) -> None:
    """Wait until every task queued on ``lane`` so far has run (``lane`` runs one at a time, in order)."""
    assert lane._max_workers == 1, f"{lane.name} runs tasks side by side; give the test SERIAL's"
    lane.submit(lambda: None).result()
