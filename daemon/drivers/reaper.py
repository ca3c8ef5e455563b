"""The init (PID 1) of a restored tree's PID namespace, once CRIU is done: reaps the tree, stops it on SIGTERM.

The namespace init of ``gpusnap.daemon.drivers.criu_exec`` execs ``python -m gpusnap.daemon.drivers.reaper
--root=NSPID snapshot=ID name=NAME operation=OP`` once the tree runs, so that ``ps``, ``pgrep -f`` and
``gpusnap ls --running`` (``gpusnap.daemon.drivers.restored``) tell which snapshot each restored tree came from
(its ``comm`` is ``gpusnap-init``). It stays PID 1 of the namespace, keeping every PID of the tree its own, and:

- reaps the tree's processes as they end, and exits when none is left;
- when the tree's root (``--root=PID``, in the namespace) ends, stops the rest as on SIGTERM: ``kill PID``
  of the PID ``gpusnap restore`` printed, by the tree's owner, ends the whole restored tree;
- for a tree started from a terminal (``--pump=MASTER,OUT``): holds the master of the pty the tree got in
  place of it, and copies what the tree writes there into ``OUT`` (the ``--terminal`` file, or /dev/null);
- on SIGTERM or SIGINT sends SIGTERM to every process of the namespace (``kill(-1)`` from its init), and
  SIGKILL to those left after ``STOP_GRACE_S``; it then exits, and the kernel ends whatever remains
  (the init of a PID namespace takes the namespace with it). This is how ``gpusnap stop`` ends a tree;
- on SIGUSR2 (:data:`END_NOW`) sends SIGKILL to every process of the namespace at once: how gpusnapd kills a
  tree (a standby dropped, a restore that failed after CRIU) so that what follows still runs;
- for a tree that continues files in copies of its own (``--copies-fd=FD``: the copies' ledger, a ``Ledger``
  ``gpusnap.daemon.drivers.filecopies``): once the tree has ended, however it ended, removes those copies,
  each as the user who made it and only while its name still names that copy. A copy lives as long as the
  tree that writes it (issue 27, item 4); only a SIGKILL of this init itself leaves them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

STOP_GRACE_S = 10.0
"""Seconds a stopped tree has to exit on SIGTERM before its processes are killed."""
END_NOW = signal.SIGUSR2
"""Kill the tree at once (no grace), then exit as when it ends."""
PR_SET_NAME = 15
COMM = b"gpusnap-init"


def main(argv: list[str]) -> int:
    ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(COMM), 0, 0, 0)
    pump = next((a.removeprefix("--pump=") for a in argv if a.startswith("--pump=")), "")
    root = int(next((a.removeprefix("--root=") for a in argv if a.startswith("--root=")), "0"))
    copies = _ledger(next((a.removeprefix("--copies-fd=") for a in argv if a.startswith("--copies-fd=")), ""))
    try:
        return _reap(root, pump)
    finally:
        if copies:
            for sig in (signal.SIGTERM, signal.SIGINT, END_NOW):  # the tree is gone: nothing left to stop
                signal.signal(sig, signal.SIG_IGN)
            _remove_copies(copies)


def _ledger(fd: str) -> bytes:
    """The copies' ledger (a ``filecopies.Ledger``, encoded) read from the inherited descriptor ``fd`` (closed);
    empty when not given or unreadable. It is decoded only once the tree has ended (this init stays small)."""
    if not fd.isdigit():
        return b""
    try:
        with os.fdopen(int(fd), "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _remove_copies(ledger: bytes) -> None:
    """Remove the copies of ``ledger`` (``filecopies.remove``); an unreadable ledger removes nothing."""
    from gpusnap.daemon.drivers import filecopies
    from gpusnap.daemon.store import documents

    try:
        filecopies.remove(documents.decode(ledger, filecopies.Ledger))
    except documents.DocumentError:
        pass


def _reap(root: int, pump: str) -> int:
    """Reap the tree until none of it is left (module docstring)."""
    if pump:
        master, out = (int(x) for x in pump.split(","))
        threading.Thread(target=_copy, args=(master, out), name="pty", daemon=True).start()
    stopping: list[float] = []

    def stop(_signum: int, _frame: object) -> None:
        if not stopping:
            stopping.append(time.monotonic())
            _kill_all(signal.SIGTERM)
            raise _Stop  # out of a blocking waitpid (which PEP 475 would otherwise resume)

    def end_now(_signum: int, _frame: object) -> None:
        stopping.insert(0, time.monotonic() - STOP_GRACE_S)  # past the grace: SIGKILL now and on every round
        _kill_all(signal.SIGKILL)
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(END_NOW, end_now)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while True:
        if stopping and time.monotonic() - stopping[0] > STOP_GRACE_S:
            _kill_all(signal.SIGKILL)
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG if stopping else 0)
        except ChildProcessError:
            return 0
        except (InterruptedError, _Stop):
            continue
        if pid == 0:  # stopping: nothing ended yet
            time.sleep(0.1)
        elif pid == root and not stopping:  # the tree's root ended: the rest goes with it
            stopping.append(time.monotonic())
            _kill_all(signal.SIGTERM)


def _copy(master: int, out: int) -> None:
    """What the tree writes to its terminal, into ``out`` (until the last slave closes: EIO)."""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            return
        if not data:
            return
        try:
            os.write(out, data)
        except OSError:
            pass


class _Stop(Exception):
    """Raised by the SIGTERM handler to leave a blocking wait."""


def _kill_all(sig: int) -> None:
    try:
        os.kill(-1, sig)  # from a namespace's init: every other process of the namespace
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))  # the other arguments only name the tree, for people
