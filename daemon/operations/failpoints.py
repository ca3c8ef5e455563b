"""Failpoints: faults injected at phase boundaries, for the fault matrix (tests/daemon/test_fault_matrix.py).

``GPUSNAP_FAILPOINT=<kind>:<phase>:<fault>`` in gpusnapd's environment (which only root sets; ``main`` reads it
into :meth:`Failpoints.from_env` and hands it to ``build_daemon``) makes every operation of ``kind``
(``checkpoint``, ``restore``, …) meet ``fault`` at the start of phase ``phase``, after its journal entry names
that phase:

- ``kill``: gpusnapd SIGKILLs itself (a daemon crash at that boundary);
- ``enospc``: the phase fails with ``OSError(ENOSPC)`` (the disk filled up at that boundary);
- ``hold``: the operation waits at that boundary while ``$GPUSNAP_FAILPOINT_DIR/held`` exists (gpusnapd
  creates it, holding ``<kind>:<phase>``; at most ``HOLD_S``), so a test can act on the world at exactly that
  point (kill a worker, make its agent hang); then the phase fails with ``ENOSPC`` if the test left
  ``$GPUSNAP_FAILPOINT_DIR/enospc``, and goes on otherwise.

Unset (the default) it costs one comparison per phase. The same idea as etcd's gofail and FreeBSD's fail(9).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

ENV = "GPUSNAP_FAILPOINT"
HOLD_ENV = "GPUSNAP_FAILPOINT_DIR"
HOLD_S = 300.0


class Failpoints:
    """The faults one daemon injects (``spec``: ``<kind>:<phase>:<fault>``, or ``""``: none)."""

    def __init__(self, spec: str = "", hold_dir: str = ""):
        self.spec = tuple(spec.split(":"))
        self.hold_dir = hold_dir
        """Where the ``hold`` fault waits (``GPUSNAP_FAILPOINT_DIR``)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Failpoints:
        """The faults ``GPUSNAP_FAILPOINT`` names (none when it is unset), held in ``GPUSNAP_FAILPOINT_DIR``."""
        return cls(environ.get(ENV, ""), environ.get(HOLD_ENV, ""))

    def hit(self, kind: str, phase: str) -> None:
        """Apply the configured fault if it is set for ``kind`` at the start of ``phase``.

        Raises:
            OSError: ``ENOSPC``, for the ``enospc`` fault (and ``hold`` when asked to).
        """
        if len(self.spec) != 3 or self.spec[0] != kind or self.spec[1] != phase:
            return
        if self.spec[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.spec[2] == "hold" and self.hold_dir:
            held = Path(self.hold_dir, "held")
            held.write_text(f"{kind}:{phase}")
            deadline = time.monotonic() + HOLD_S
            while held.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            if not Path(self.hold_dir, "enospc").exists():
                return
        if self.spec[2] in ("enospc", "hold"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"failpoint {kind}:{phase}")


NONE = Failpoints()
"""No fault anywhere (what an operation meets unless its daemon was given failpoints)."""
