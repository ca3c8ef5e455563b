"""A parent and a child that shut down cleanly on SIGTERM (run as a script; stdio on /dev/null).

    python on_term.py DIR

Each appends ``<role> got SIGTERM`` to DIR/term.log (opened for appending) and exits 0 on SIGTERM; DIR/ready
appears once both run.
"""

from __future__ import annotations

import os
import signal
import sys
import time

workdir = sys.argv[1]
log = open(os.path.join(workdir, "term.log"), "a")  # noqa: SIM115 (held for the process's life)
role = "parent"
if os.fork() == 0:
    role = "child"


def on_term(_signum: int, _frame: object) -> None:
    log.write(f"{role} got SIGTERM\n")
    log.flush()
    os._exit(0)


signal.signal(signal.SIGTERM, on_term)
if role == "parent":
    open(os.path.join(workdir, "ready"), "w").close()
while True:
    time.sleep(0.1)
