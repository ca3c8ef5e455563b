"""Failpoints: faults injected at phase boundaries, for the fault matrix (tests/daemon/test_fault_matrix.py).

``GPUSNAP_FAILPOINT=<kind>:<phase>:<fault>`` in gpusnapd's environment (which only root sets) makes every
operation of ``kind`` (``checkpoint``, ``restore``, …) meet ``fault`` at the start of phase ``phase``, after its
journal entry names that phase:

- ``kill``: gpusnapd SIGKILLs itself (a daemon crash at that boundary);
- ``enospc``: the phase fails with ``OSError(ENOSPC)`` (the disk filled up at that boundary).

Unset (the default) it costs one comparison per phase. The same idea as etcd's gofail and FreeBSD's fail(9).
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "GPUSNAP_FAILPOINT"
_SPEC = tuple(os.environ.get(ENV, "").split(":"))


def hit(kind: str, phase: str) -> None:
    """Apply the configured fault if it is set for ``kind`` at the start of ``phase``.

    Raises:
        OSError: ``ENOSPC``, for the ``enospc`` fault.
    """
    if len(_SPEC) != 3 or _SPEC[0] != kind or _SPEC[1] != phase:
        return
    if _SPEC[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if _SPEC[2] == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"failpoint {kind}:{phase}")
