"""A control-directory worker that forks, after gpusnap's preflight, a child holding /dev/shm memory.

    python late_shm_child.py CONTROL_DIR SHM_NAME

It waits for CONTROL_DIR/go (the test writes it once the capture waits in ``wait-ready``, i.e. after
preflight listed the tree), forks a child that creates /dev/shm/SHM_NAME, maps it, writes a pattern and
keeps checking it (the parent holds nothing in /dev/shm), and then signals ``ready-for-snapshot``. The child appends "ok N" to
CONTROL_DIR/log every 50 ms while the mapping still holds the pattern.
"""

import mmap
import os
import sys
import time

cdir, name = sys.argv[1], sys.argv[2]
open(os.path.join(cdir, "started"), "w").close()
while not os.path.exists(os.path.join(cdir, "go")):
    time.sleep(0.05)
PATTERN = b"late-child-shm!" * 4096
if os.fork() == 0:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, len(PATTERN))
    m = mmap.mmap(fd, len(PATTERN))
    os.close(fd)
    m[:] = PATTERN
    open(os.path.join(cdir, "child-ready"), "w").close()
    log = open(os.path.join(cdir, "log"), "a", buffering=1)
    n = 0
    while True:
        if m[:] == PATTERN:
            n += 1
            log.write(f"ok {n}\n")
        time.sleep(0.05)
while not os.path.exists(os.path.join(cdir, "child-ready")):
    time.sleep(0.01)
os.open(os.path.join(cdir, "ready-for-snapshot"), os.O_CREAT | os.O_WRONLY, 0o644)
while True:
    time.sleep(1)
