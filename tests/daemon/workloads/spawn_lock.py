"""A process holding a spawn-context multiprocessing lock, as vLLM's processes do.

    python spawn_lock.py WORKDIR

glibc's ``sem_open`` maps the semaphore under a temporary name (``/dev/shm/sem.XXXXXX``), then links it
as ``sem.<name>`` and removes the temporary name, so CRIU dumps the mapping as a link remap
(``/dev/shm/link_remap.N``). Every 50 ms the process takes and releases the lock and appends a count to
WORKDIR/log.
"""

import multiprocessing
import os
import sys
import time

wd = sys.argv[1]
lock = multiprocessing.get_context("spawn").Lock()
log = open(os.path.join(wd, "log"), "a", buffering=1)
open(os.path.join(wd, "ready"), "w").close()
n = 0
while True:
    with lock:
        n += 1
        log.write(f"{n}\n")
    time.sleep(0.05)
