"""gpusnap: the command-line client of gpusnapd.

Exit codes (also in ``gpusnap --help`` and the README):

    0 success                       5 conflict (ABORTED, ALREADY_EXISTS: busy tree, name taken)
    1 internal or unknown error     6 permission denied
    2 usage or invalid argument     7 daemon unavailable
    3 not found                     8 deadline exceeded
    4 failed precondition or damaged snapshot (FAILED_PRECONDITION, DATA_LOSS)
    9 resources exhausted (RESOURCE_EXHAUSTED)
  130 cancelled (CANCELLED: Ctrl-C, the operation rolled back)
"""

from __future__ import annotations

from gpusnap.daemon.cli import capture, node, ops, park, snapshots, transfer  # noqa: F401  (each registers its commands)
from gpusnap.daemon.cli.app import EXIT_CODES, main, run

__all__ = ["EXIT_CODES", "main", "run"]
