"""Failpoints: faults injected at phase boundaries, for the fault matrix (tests/daemon/test_fault_matrix.py).

``GPUSNAP_FAILPOINT=<kind>:<phase>:<fault>`` in gpusnapd's environment (which only root sets; ``main`` reads it
into :meth:`Failpoints.from_env` and hands it to ``build_daemon``) makes every operation of ``kind``
(``checkpoint``, ``restore``, …) meet ``fault`` at the start of phase ``phase``, after its journal entry names
that phase:

- ``kill``: gpusnapd SIGKILLs itself (a daemon crash at that boundary);
- ``enospc``: the phase fails with ``OSError(ENOSPC)`` (the disk filled up at that boundary).

Unset (the default) it costs one comparison per phase. The same idea as etcd's gofail and FreeBSD's fail(9).
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Mapping

ENV = "GPUSNAP_FAILPOINT"


class Failpoints:
    """The faults one daemon injects (``spec``: ``<kind>:<phase>:<fault>``, or ``""``: none)."""

    def __init__(self, spec: str = ""):
        self.spec = tuple(spec.split(":"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Failpoints:
        """The faults ``GPUSNAP_FAILPOINT`` names (none when it is unset)."""
        return cls(environ.get(ENV, ""))

    def hit(self, kind: str, phase: str) -> None:
        """Apply the configured fault if it is set for ``kind`` at the start of ``phase``.

        Raises:
            OSError: ``ENOSPC``, for the ``enospc`` fault.
        """
        if len(self.spec) != 3 or self.spec[0] != kind or self.spec[1] != phase:
            return
        if self.spec[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.spec[2] == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"failpoint {kind}:{phase}")


NONE = Failpoints()
"""No fault anywhere (what an operation meets unless its daemon was given failpoints)."""
