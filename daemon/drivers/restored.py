"""The restored trees running now, found by the inits of their PID namespaces, and how one is stopped.

Every restore into a fresh PID namespace leaves that namespace's init running as the tree's reaper: root's
``python -m gpusnap.daemon.drivers.reaper --root=NSPID … snapshot=ID name=NAME operation=OP`` (comm
``gpusnap-init``, :mod:`gpusnap.daemon.drivers.reaper`). :func:`running` finds them in /proc and trusts only
one that is root's (real uid 0: no user can make such a process) and PID 1 of its namespace; its tree's root
is its child whose PID in the namespace is ``NSPID``. A tree whose root has ended is not listed: its init is
stopping the rest. :func:`stop` sends the init SIGTERM through a pidfd opened before the init is checked
again, so a PID reused meanwhile is never signalled; the init stops its whole tree (SIGTERM, SIGKILL after
``reaper.STOP_GRACE_S``), and is killed itself (taking the namespace with it) if it outlives that.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Sequence
from datetime import UTC, datetime

import psutil

from gpusnap.daemon.api.types import RestoredTree
from gpusnap.daemon.drivers import proc, reaper

REAPER = "gpusnap.daemon.drivers.reaper"
COMM = reaper.COMM.decode()
STOP_MARGIN_S = 5.0
"""Seconds past the init's own grace before it is killed."""


def running(daemon: str = "") -> list[RestoredTree]:
    """The restored trees running now, oldest first (see the module docstring); with ``daemon`` (a store's
    :attr:`~gpusnap.daemon.store.SnapshotStore.instance`), only those that gpusnapd restored."""
    return [t for t, _ in trees(daemon=daemon)]


def trees(table: proc.ProcessTable | None = None, daemon: str = "") -> list[tuple[RestoredTree, list[int]]]:
    """:func:`running`, each with every PID of its namespace (its init first), from one listing of the
    processes (``table``, or one read now): listing N trees costs one pass over /proc, not N."""
    table = table or proc.ProcessTable.now()
    found = []
    for init_pid in table.named(COMM):
        pids = table.descendants(init_pid)
        tree = _tree(init_pid, table.children.get(init_pid, []), len(pids) - 1, daemon)
        if tree is not None:
            found.append((tree, pids))
    return sorted(found, key=lambda f: (f[0].started, f[0].pid))


def _tree(init_pid: int, children: list[int], process_count: int, daemon: str = "") -> RestoredTree | None:
    """The tree under ``init_pid`` (its ``children``; ``process_count`` processes under it) if that is a restored
    tree's init whose root runs (and, with ``daemon``, that this gpusnapd restored: its init's ``gpusnapd=``
    names it, or names none, as before gpusnapd named itself), else ``None``."""
    try:
        init = psutil.Process(init_pid)
        argv = init.cmdline()
        if init.uids().real != 0 or argv[1:3] != ["-m", REAPER] or proc.namespace_pid(init_pid) != 1:
            return None
        args = dict(a.lstrip("-").partition("=")[::2] for a in argv[3:] if "=" in a)
        if daemon and args.get("gpusnapd", daemon) != daemon:
            return None
        ns_root = int(args.get("root", "0"))
        root = next((c for c in children if proc.namespace_pid(c) == ns_root), 0)
        if not ns_root or not root:
            return None
        process = psutil.Process(root)
        return RestoredTree(
            pid=root,
            init_pid=init_pid,
            snapshot_id=args.get("snapshot", ""),
            snapshot_name="" if args.get("name", "-") == "-" else args["name"],
            operation_id=args.get("operation", ""),
            uid=process.uids().real,
            started=datetime.fromtimestamp(process.create_time(), UTC),
            process_count=max(process_count, 0),
        )
    except (psutil.Error, OSError, ValueError, LookupError):  # gone meanwhile, or not one of ours
        return None


def stop(trees: Sequence[RestoredTree], grace_s: float = reaper.STOP_GRACE_S + STOP_MARGIN_S) -> None:
    """Stop ``trees`` (as :func:`running` listed them) and return once their inits are gone: each init gets
    SIGTERM, and SIGKILL if it still runs after ``grace_s``."""
    fds = []
    for tree in trees:
        try:
            fd = os.pidfd_open(tree.init_pid)
        except ProcessLookupError:
            continue
        same = _tree(
            tree.init_pid, proc.children(tree.init_pid), 0
        )  # checked once the pidfd holds it: never a reused PID
        if same is None or (same.operation_id, same.started) != (tree.operation_id, tree.started):
            os.close(fd)
            continue
        signal.pidfd_send_signal(fd, signal.SIGTERM)
        fds.append(fd)
    try:
        left = _wait(fds, time.monotonic() + grace_s)
        for fd in left:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        _wait(left, time.monotonic() + STOP_MARGIN_S)
    finally:
        for fd in fds:
            os.close(fd)


END_WAIT_S = 5.0
"""Seconds :func:`end_now` gives a tree's init to end it (and remove its file copies) before it is killed."""


def end_now(init_pid: int) -> None:
    """Kill the tree under namespace init ``init_pid`` at once, through the init once it is the tree's reaper
    (SIGUSR2: it kills everything, then removes the tree's file copies and exits, ``reaper``), and return once
    the init is gone (SIGKILL after :data:`END_WAIT_S`). An init that is not yet the reaper (CRIU still
    restoring) gets SIGKILL: it has no handler, so nothing but SIGKILL reaches it from outside. The caller
    checked that ``init_pid`` names the tree's init (its start time)."""
    try:
        fd = os.pidfd_open(init_pid)
    except ProcessLookupError:
        return
    try:
        try:
            reaping = open(f"/proc/{init_pid}/comm", "rb").read().strip() == reaper.COMM
        except OSError:
            reaping = False
        signal.pidfd_send_signal(fd, reaper.END_NOW if reaping else signal.SIGKILL)
        if _wait([fd], time.monotonic() + END_WAIT_S):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            _wait([fd], time.monotonic() + STOP_MARGIN_S)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


def _wait(fds: list[int], deadline: float) -> list[int]:
    """The pidfds of ``fds`` whose process still runs at ``deadline`` (a pidfd reads ready once it exits)."""
    left = list(fds)
    while left and (remaining := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select(left, [], [], remaining)
        left = [fd for fd in left if fd not in ready]
    return left
