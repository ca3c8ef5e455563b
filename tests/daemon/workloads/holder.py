"""Holds one file open (run as a script; stdio should be /dev/null).

    python holder.py FILE OUTDIR

Opens FILE read-only, writes OUTDIR/ready, and on SIGUSR1 reads the file through the descriptor it
holds and writes what it read to OUTDIR/read-<n> (as whoever the process runs as then).
"""

from __future__ import annotations

import os
import signal
import sys
import time

fd = os.open(sys.argv[1], os.O_RDONLY)
out = sys.argv[2]
count = 0


def on_usr1(_signum: int, _frame: object) -> None:
    global count
    count += 1
    data = os.pread(fd, 4096, 0)
    with open(os.path.join(out, f"read-{count}"), "wb") as fh:
        fh.write(data)


signal.signal(signal.SIGUSR1, on_usr1)
open(os.path.join(out, "ready"), "w").close()
while True:
    time.sleep(0.1)
