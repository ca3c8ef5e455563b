"""Holds two files through two open file descriptions each (run as a script; stdio on /dev/null).

    python two_fds.py DIR

``DIR/a.log`` (CRIU's ``static/file_append``): one descriptor with ``O_APPEND``, one without, the second
written ("start\\n") and moved back to 0. ``DIR/b.log``: a writer at its end (11 bytes) and a reader at byte 5.
Writes ``DIR/ready``. On SIGUSR1 it writes ``DIR/report-<n>`` (JSON: each descriptor's position and whether
it appends, before; then ``X`` through a.log's plain descriptor and ``Y`` through its appending one, and
what b.log's reader reads next), so a test sees whether each description came back with its own state.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time

d = sys.argv[1]
a_append = os.open(os.path.join(d, "a.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
a_plain = os.open(os.path.join(d, "a.log"), os.O_WRONLY)
os.write(a_plain, b"start\n")
os.lseek(a_plain, 0, os.SEEK_SET)
b_writer = os.open(os.path.join(d, "b.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(b_writer, b"0123456789\n")
b_reader = os.open(os.path.join(d, "b.log"), os.O_RDONLY)
os.read(b_reader, 5)
count = 0


def state() -> dict[str, object]:
    fds = {"a_append": a_append, "a_plain": a_plain, "b_writer": b_writer, "b_reader": b_reader}
    return {
        name: {
            "pos": os.lseek(fd, 0, os.SEEK_CUR),
            "append": bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND),
            "file": os.readlink(f"/proc/self/fd/{fd}"),
        }
        for name, fd in fds.items()
    }


def on_usr1(_signum: int, _frame: object) -> None:
    global count
    count += 1
    before = state()
    os.write(a_plain, b"X")
    os.write(a_append, b"Y")
    read = os.read(b_reader, 5).decode()
    with open(os.path.join(d, f"report-{count}"), "w") as fh:
        json.dump({"before": before, "read": read}, fh)


signal.signal(signal.SIGUSR1, on_usr1)
open(os.path.join(d, "ready"), "w").close()
while True:
    time.sleep(0.1)
