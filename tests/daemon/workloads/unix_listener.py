"""Listens on a unix socket bound by path and holds one connection to it (run as a script).

    python unix_listener.py SOCKET_PATH OUTDIR

Binds SOCKET_PATH, listens, connects to itself and accepts (so the tree holds a listener and both ends
of an accepted connection, which carries the listener's name too), writes OUTDIR/ready and sleeps.
"""

from __future__ import annotations

import os
import socket
import sys
import time

listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(8)
listener.setblocking(False)
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
client.connect(sys.argv[1])
accepted, _ = listener.accept()
open(os.path.join(sys.argv[2], "ready"), "w").close()
while True:
    time.sleep(0.1)
