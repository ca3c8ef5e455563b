"""A process tree for checkpoint/restore tests (run as a script; stdio should be /dev/null).

    python tree.py WORKDIR [--mem-mb N] [--random] [--no-listener] [--no-child]

- parent fills N MiB (default 100) with a known pattern (or random bytes) and writes its sha256 to WORKDIR/expected_sha;
- parent forks a child; they are joined by a pipe: the parent writes a tick every 0.1 s, the child
  appends the tick count to WORKDIR/child.log;
- parent appends its own counter to WORKDIR/parent.log (a file kept open and appended to);
- parent listens on 127.0.0.1 (port in WORKDIR/port) and answers "hello <counter>" to each client;
- on SIGUSR1 the parent re-hashes its memory into WORKDIR/sha_now.
WORKDIR/ready appears once all of that runs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import sys
import threading
import time

PATTERN = bytes((i * 7 + 3) % 251 for i in range(4096))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--mem-mb", type=int, default=100)
    ap.add_argument("--no-listener", action="store_true")
    ap.add_argument("--no-child", action="store_true")
    ap.add_argument("--random", action="store_true", help="fill memory with random bytes (no two chunks alike)")
    args = ap.parse_args()
    wd = args.workdir
    memory = bytearray(os.urandom(args.mem_mb << 20) if args.random else PATTERN * (args.mem_mb * 256))
    with open(os.path.join(wd, "expected_sha"), "w") as fh:
        fh.write(hashlib.sha256(memory).hexdigest())

    r, w = os.pipe()
    if not args.no_child and os.fork() == 0:
        os.close(w)
        log = open(os.path.join(wd, "child.log"), "a", buffering=1)
        count = 0
        while os.read(r, 1):
            count += 1
            log.write(f"{count}\n")
        os._exit(0)
    os.close(r)

    counter = 0

    def on_usr1(signum: int, frame: object) -> None:
        with open(os.path.join(wd, "sha_now.tmp"), "w") as fh:
            fh.write(hashlib.sha256(memory).hexdigest())
        os.rename(os.path.join(wd, "sha_now.tmp"), os.path.join(wd, "sha_now"))

    signal.signal(signal.SIGUSR1, on_usr1)

    if not args.no_listener:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        with open(os.path.join(wd, "port"), "w") as fh:
            fh.write(str(srv.getsockname()[1]))

        def serve() -> None:
            while True:
                conn, _ = srv.accept()
                with conn:
                    conn.sendall(f"hello {counter}\n".encode())

        threading.Thread(target=serve, daemon=True).start()

    log = open(os.path.join(wd, "parent.log"), "a", buffering=1)
    open(os.path.join(wd, "ready"), "w").close()
    while True:
        counter += 1
        log.write(f"{counter}\n")
        if not args.no_child:
            os.write(w, b"t")
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
