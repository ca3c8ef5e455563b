"""Run as a hostile user: open agent-socket connections and report what the daemon did with them.

    python flood_agents.py SOCKET MODE N

MODE ``idle``: N connections that say nothing; ``huge``: N connections that announce a 16 MiB frame and
trickle it; ``junk``: N connections, one after the other, each sending a hello that is not one (each is
refused at once). Prints one JSON line: how many were closed by the daemon within 3 s, and within 15 s.
"""

from __future__ import annotations

import json
import select
import socket
import struct
import sys
import time

path, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
conns = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        s.close()
        continue
    if mode == "huge":
        s.sendall(struct.pack(">I", 16 << 20) + b"x" * 1000)
    if mode == "junk":
        s.sendall(struct.pack(">I", 4) + b"junk")
        s.recv(1)  # closed by the daemon: the next one
        s.close()
        continue
    conns.append(s)


def closed_by_daemon(deadline: float) -> int:
    closed = 0
    for s in conns:
        remaining = max(0.0, deadline - time.monotonic())
        r, _, _ = select.select([s], [], [], remaining)
        if r:
            try:
                if s.recv(1) == b"":
                    closed += 1
            except OSError:
                closed += 1
    return closed


start = time.monotonic()
early = closed_by_daemon(start + 3)
late = closed_by_daemon(start + 15)
print(json.dumps({"connected": len(conns), "closed_early": early, "closed_by_15s": late}))
