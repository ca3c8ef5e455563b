"""Restore one snapshot over and over as the calling (hostile) user, watching root's files (run as a script).

    python restore_loop.py SOCKET SNAPSHOT COUNT WATCHED_JSON

WATCHED_JSON maps paths to ``[st_ino, st_uid, st_mode]`` as they must stay. Two threads restore (the
daemon overlaps one's helpers with the other's CRIU), each restored tree killed at once; after every
restore each watched path is stat'ed without following symlinks, and the loop stops at the first change.
Prints one JSON object: ``{"restores": n, "restored": n, "refused": {reason: n}, "broken": "…" | null}``.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import threading

from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.client import DaemonClient

THREADS = 2


def broken(watched: dict[str, list[int]]) -> str | None:
    for path, (ino, uid, mode) in watched.items():
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return f"{path} was deleted"
        if [st.st_ino, st.st_uid, st.st_mode] != [ino, uid, mode]:
            return f"{path} changed: ino {st.st_ino}, uid {st.st_uid}, mode {st.st_mode:o}"
    return None


def main() -> int:
    socket_path, snapshot, count, watched = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    lock = threading.Lock()
    refused: collections.Counter[str] = collections.Counter()
    state = {"restores": 0, "restored": 0, "broken": None}

    def loop(client: DaemonClient) -> None:
        while True:
            with lock:
                if state["broken"] or state["restores"] >= count:
                    return
                state["restores"] += 1
            try:
                op = client.wait(client.restore(snapshot).id, timeout_s=120)
                try:
                    os.kill(op.restore.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                with lock:
                    state["restored"] += 1
            except GpusnapError as exc:
                with lock:
                    refused[exc.reason] += 1
            found = broken(watched)
            if found:
                with lock:
                    state["broken"] = state["broken"] or found

    with DaemonClient(socket_path) as client:
        threads = [threading.Thread(target=loop, args=(client,)) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    print(json.dumps({**state, "refused": dict(refused)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
