"""Holds what a user's worker holds by path: a file it reads, a unix socket it listens on, a log it writes.

    python user_paths.py FILE SOCKET LOG OUTDIR

Opens FILE read-only, binds and listens on SOCKET, opens LOG with "w" (at its own position: a restore
continues it in a copy once it has grown) and writes one line to it, then writes OUTDIR/ready. On SIGUSR1 it
reads FILE through the descriptor it holds into OUTDIR/read-<n> (as whoever the process runs as then).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

fd = os.open(sys.argv[1], os.O_RDONLY)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[2])
listener.listen(8)
log = open(sys.argv[3], "w")  # noqa: SIM115 - held for the process's life
log.write("started\n")
log.flush()
out = sys.argv[4]
count = 0


def on_usr1(_signum: int, _frame: object) -> None:
    global count
    count += 1
    with open(os.path.join(out, f"read-{count}"), "wb") as fh:
        fh.write(os.pread(fd, 4096, 0))


signal.signal(signal.SIGUSR1, on_usr1)
open(os.path.join(out, "ready"), "w").close()
while True:
    time.sleep(0.1)
