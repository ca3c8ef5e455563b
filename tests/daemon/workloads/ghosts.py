"""Holds a deleted file and sits in a deleted directory (run as a script; stdio should be /dev/null).

    python ghosts.py DIR

Writes DIR/d/x and opens it, makes DIR/d/sub its working directory, then removes both (CRIU brings them
back as ghosts: from the images, at their old paths). Writes DIR/ready; on SIGUSR1 writes what it reads
through its descriptor to DIR/read-<n>.
"""

from __future__ import annotations

import os
import signal
import sys
import time

top = sys.argv[1]
fd = os.open(os.path.join(top, "d", "x"), os.O_RDWR | os.O_CREAT, 0o600)
os.write(fd, b"ghost data\n")
os.mkdir(os.path.join(top, "d", "sub"))
os.chdir(os.path.join(top, "d", "sub"))
os.unlink(os.path.join(top, "d", "x"))
os.rmdir(os.path.join(top, "d", "sub"))
count = 0


def on_usr1(_signum: int, _frame: object) -> None:
    global count
    count += 1
    with open(os.path.join(top, f"read-{count}"), "wb") as fh:
        fh.write(os.pread(fd, 4096, 0))


signal.signal(signal.SIGUSR1, on_usr1)
open(os.path.join(top, "ready"), "w").close()
while True:
    time.sleep(0.1)
