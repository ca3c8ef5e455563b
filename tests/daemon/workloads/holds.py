"""Holds one object of a kind CRIU may or may not checkpoint (run as a script; stdio on /dev/null).

    python holds.py KIND READY_FILE

KIND: ``vsock`` (an AF_VSOCK socket), ``userfaultfd``, ``fuse`` (/dev/fuse), ``sysv-shm`` (a mapped SysV
segment), ``eventfd`` (supported: the control case), ``pty-pair`` (both ends of a pty; start it in
its own session), ``fork-churn`` (forks and reaps short-lived children all the time; counts in READY_FILE.count),
``unconnected-sockets`` (an unbound TCP socket, an unbound UDP socket, an unbound UDP-Lite one and a TCP
socket whose ``connect()`` was refused: none is in ``/proc/net/*``, CRIU dumps them all).
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import time

kind, ready = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
keep: list[object] = []
if kind == "vsock":
    keep.append(socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM))
elif kind == "userfaultfd":
    fd = libc.syscall(323, os.O_CLOEXEC)  # SYS_userfaultfd on x86_64
    assert fd >= 0, ctypes.get_errno()
elif kind == "fuse":
    keep.append(os.open("/dev/fuse", os.O_RDWR))
elif kind == "sysv-shm":
    libc.shmat.restype = ctypes.c_void_p
    shmid = libc.shmget(0, 4096, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    assert shmid >= 0 and libc.shmat(shmid, None, 0) not in (None, ctypes.c_void_p(-1).value)
    libc.shmctl(shmid, 0, None)  # IPC_RMID once detached: nothing left behind
elif kind == "eventfd":
    keep.append(os.eventfd(0))
elif kind == "pty-pair":  # started as a session leader (setsid)
    keep.extend(os.openpty())
elif kind == "unconnected-sockets":
    keep.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    keep.append(socket.socket(socket.AF_INET6, socket.SOCK_DGRAM))
    keep.append(socket.socket(socket.AF_INET, socket.SOCK_DGRAM, 136))  # IPPROTO_UDPLITE
    refused = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))  # a port nothing listens on: bound, never listening
    try:
        refused.connect(probe.getsockname())
    except ConnectionRefusedError:
        pass
    probe.close()
    keep.append(refused)
elif kind != "fork-churn":
    raise SystemExit(f"unknown kind {kind}")
open(ready, "w").close()
count = 0
while True:
    if kind == "fork-churn":
        for _ in range(4):
            if os.fork() == 0:
                time.sleep(0.02 * (os.getpid() % 3))
                os._exit(0)
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        count += 1
        with open(ready + ".count", "w") as fh:
            fh.write(str(count))
    time.sleep(0.05)
