"""Holds a file and grows on demand (run as a script; stdio should be /dev/null).

    python grower.py FILE OUTDIR

Opens FILE read-only and writes OUTDIR/ready; on SIGUSR1 it allocates 64 MiB more, touches every page, and
writes OUTDIR/grew-<pid>-<n> (a restored copy of it grows as it runs, after its standby or restore was counted).
"""

from __future__ import annotations

import os
import signal
import sys
import time

fd = os.open(sys.argv[1], os.O_RDONLY)
out = sys.argv[2]
held: list[bytearray] = []


def on_usr1(_signum: int, _frame: object) -> None:
    held.append(bytearray(b"\x01" * (64 << 20)))
    open(os.path.join(out, f"grew-{os.getpid()}-{len(held)}"), "w").close()


signal.signal(signal.SIGUSR1, on_usr1)
open(os.path.join(out, "ready"), "w").close()
while True:
    time.sleep(0.1)
