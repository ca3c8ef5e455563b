"""A dump's CRIU that outlived the gpusnapd that started it: found from the journal, and waited for.

A dump's helper (``gpusnap.daemon.drivers.criu_exec``) runs in a session of its own, its ``criu swrk`` in its
process group, so neither dies with gpusnapd; the checkpoint journals the helper (``criu_helper``,
``criu_helper_start``) before the helper has its request. Once gpusnapd is gone that CRIU goes on dumping,
the tree frozen and its parasite in the task it is dumping, until its ``post-dump`` notification: the helper
then finds no daemon to answer, so CRIU fails the dump and, as on any failure, cures and resumes the tree,
unlocks the network and removes its link remaps, and exits (criu/cr-dump.c ``cr_dump_finish``). A CRIU
killed instead while its parasite runs in a task leaves it there (compel's parasite returns to the task's
code through ``rt_sigreturn`` with its blob still mapped), so nothing here ever signals it.

Recovery (``gpusnap.daemon.operations.recovery``) therefore waits: the store keeps that capture's staging
directory (CRIU still writes images into it: :func:`busy_staging`), the recovered checkpoint holds the tree
(no other operation may take it), and the source is reported on, and the staging directory removed, only once
the helper's process group is gone (:func:`wait`). The wait is bounded by what is left of the dump: the rest
of the tree's memory written out (docs/reliability.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from gpusnap.daemon.drivers import proc
from gpusnap.daemon.store import facts as journaled
from gpusnap.daemon.store.facts import CaptureFacts
from gpusnap.daemon.store.journal import Entry

START_SLACK_S = 0.02
"""Start times are in clock ticks (10 ms): a process started right after the helper may read as a tick before."""
POLL_S = 0.05
"""How often :func:`wait` looks whether that CRIU is gone."""
REPORT_EVERY_S = 30.0
"""How often :func:`wait` reports that it still waits."""


def running(facts: CaptureFacts) -> list[int]:
    """The live processes of the journaled dump helper's process group (the helper and its CRIU); empty when
    none was journaled or they are gone."""
    if not facts.criu_helper or not facts.criu_helper_start:
        return []
    return proc.group_members(facts.criu_helper, facts.criu_helper_start - START_SLACK_S)


def busy_staging(entries: Iterable[Entry]) -> list[str]:
    """The staging directories (snapshot ids) of unfinished journal ``entries`` whose dump CRIU still runs:
    the store must keep them (``SnapshotStore.open``) until :func:`wait` returns."""
    busy = []
    for entry in entries:
        facts = journaled.of_entry(entry)
        if entry.running and isinstance(facts, CaptureFacts) and facts.staging and running(facts):
            busy.append(facts.staging)
    return busy


def wait(facts: CaptureFacts, report: Callable[[list[int], float], None]) -> float:
    """Return once the journaled dump helper's process group is gone; ``report(pids, seconds)`` every
    :data:`REPORT_EVERY_S` meanwhile. Returns the seconds waited."""
    start = time.monotonic()
    reported = start
    while pids := running(facts):
        now = time.monotonic()
        if now - reported >= REPORT_EVERY_S:
            report(pids, now - start)
            reported = now
        time.sleep(POLL_S)
    return time.monotonic() - start
