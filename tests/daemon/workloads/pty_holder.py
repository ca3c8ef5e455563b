"""Holds both ends of a pseudo-terminal it opened (run as a script; stdio on /dev/null).

    python pty_holder.py OUTDIR

Writes the pty's number to OUTDIR/pty, then OUTDIR/ready, and sleeps. CRIU restores the pair with the same
number, which must then be free on the host.
"""

from __future__ import annotations

import os
import sys
import time

master, slave = os.openpty()
with open(os.path.join(sys.argv[1], "pty"), "w") as fh:
    fh.write(os.ttyname(slave).rsplit("/", 1)[1])
open(os.path.join(sys.argv[1], "ready"), "w").close()
while True:
    time.sleep(0.1)
