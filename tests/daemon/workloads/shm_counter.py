"""A process that counts in POSIX shared memory (/dev/shm) and listens on a fixed loopback port.

    python shm_counter.py WORKDIR NAME PORT

Every 50 ms it increments a counter kept in the shared-memory segment NAME and appends
"<pid-namespace id> <counter>" to WORKDIR/log, so copies that wrongly share one segment show gaps.
"""

import os
import socket
import struct
import sys
import time
from multiprocessing import resource_tracker, shared_memory

wd, name, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
shm = shared_memory.SharedMemory(name=name, create=True, size=4096)
resource_tracker.unregister(shm._name, "shared_memory")  # no tracker process: one process tree
srv = socket.socket()
srv.bind(("127.0.0.1", port))
srv.listen()
log = open(os.path.join(wd, "log"), "a", buffering=1)
open(os.path.join(wd, "ready"), "w").close()
while True:
    n = struct.unpack_from("Q", shm.buf, 0)[0] + 1
    struct.pack_into("Q", shm.buf, 0, n)
    log.write(f"{os.readlink('/proc/self/ns/pid')} {n}\n")
    time.sleep(0.05)
