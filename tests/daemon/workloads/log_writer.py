"""Writes a count to a log it opened with "w" (no O_APPEND), one line every 0.1 s (run as a script; stdio on
/dev/null).

    python log_writer.py LOG
"""

from __future__ import annotations

import itertools
import sys
import time

with open(sys.argv[1], "w") as log:  # at its own position: CRIU records the file's size
    for i in itertools.count():
        log.write(f"{i}\n")
        log.flush()
        time.sleep(0.1)
