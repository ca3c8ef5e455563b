"""The CRIU helper (``criu_exec``) with a page fill whose copies fail once three have gone in: the fault a test
injects to see the tree killed before it runs (run as a script in the helper's place)."""

from __future__ import annotations

import errno
import os
import sys

from gpusnap.daemon.drivers import criu_exec, pagefill

_real_copy = pagefill.copy
_done = [0]


def _failing_copy(uffd: int, dst: int, src: int, length: int) -> None:
    _done[0] += 1
    if _done[0] > 3:
        raise OSError(errno.EFAULT, "injected by the test")
    _real_copy(uffd, dst, src, length)


if __name__ == "__main__":
    pagefill.copy = _failing_copy
    code = criu_exec.main()
    sys.stdout.flush()
    os._exit(code)
