"""A process with large dirty private anonymous regions, as a Python/torch heap has (run as a script).

    python anon_regions.py WORKDIR [--regions N] [--mb M] [--sparse-mb S] [--hugepage none|before-fill|before-dump]
                           [--shm-mb H --shm-name NAME] [--fork-child]

- maps N private anonymous regions of M MiB each (the VMA kind glibc gives large allocations), fills each
  with a per-region pattern; maps one more region of S MiB (default 64) and touches one 4 KiB page in each
  2 MiB of it (a sparse heap: what huge pages would bloat); writes the sha256 of all of them to
  WORKDIR/expected_sha;
- ``--hugepage before-fill``: ``madvise(MADV_HUGEPAGE)`` every region before touching it (its pages are born
  2 MiB where THP allows); ``before-dump``: after (what an agent does right before a dump: the VMAs carry
  VM_HUGEPAGE, the pages stay 4 KiB);
- ``--shm-mb H``: also a /dev/shm segment ``NAME`` of H MiB, filled and held open for writing, as vLLM's
  queues are (``multiprocessing.shared_memory``), hashed with the regions;
- on SIGUSR1 it re-hashes the regions into WORKDIR/sha_now;
- on SIGUSR2 it answers a request: WORKDIR/answer appears (a first request that touches almost no memory);
- ``--fork-child``: after the fill it forks a child that shares the regions copy-on-write and rewrites the first
  half of the first region (its own copy of those pages), hashes its view into WORKDIR/child_expected_sha, and on
  SIGUSR1 (sent by the parent once its own hash is written) into WORKDIR/child_sha_now.
WORKDIR/ready appears once the regions are filled (and advised).
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import signal
import time

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--regions", type=int, default=6)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--sparse-mb", type=int, default=64)
    ap.add_argument("--hugepage", choices=("none", "before-fill", "before-dump"), default="none")
    ap.add_argument("--shm-mb", type=int, default=0)
    ap.add_argument("--shm-name", default="")
    ap.add_argument("--fork-child", action="store_true")
    args = ap.parse_args()
    wd = args.workdir
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    regions = [mmap.mmap(-1, args.mb * MIB, flags=flags) for _ in range(args.regions)]
    sparse = mmap.mmap(-1, args.sparse_mb * MIB, flags=flags) if args.sparse_mb else None
    every = [*regions, *([sparse] if sparse is not None else [])]
    shm = None
    if args.shm_mb:
        from multiprocessing import resource_tracker, shared_memory

        shm = shared_memory.SharedMemory(name=args.shm_name, create=True, size=args.shm_mb * MIB)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # one process tree
        pattern = bytes(i % 253 for i in range(4096)) * 256
        for off in range(0, shm.size, len(pattern)):
            shm.buf[off : off + len(pattern)] = pattern
    if args.hugepage == "before-fill":
        for m in every:
            m.madvise(mmap.MADV_HUGEPAGE)
    for n, buf in enumerate(regions):
        chunk = bytes((i * 7 + n * 13 + 1) % 251 for i in range(4096)) * 256
        for off in range(0, len(buf), len(chunk)):
            buf[off : off + len(chunk)] = chunk
    if sparse is not None:
        for off in range(0, len(sparse), 2 * MIB):
            sparse[off : off + 8] = off.to_bytes(8, "little")
    if args.hugepage == "before-dump":
        for m in every:
            m.madvise(mmap.MADV_HUGEPAGE)

    def digest() -> str:
        h = hashlib.sha256()
        for buf in every:
            h.update(buf)
        if shm is not None:
            h.update(shm.buf)
        return h.hexdigest()

    def write(name: str) -> None:
        with open(os.path.join(wd, name + ".tmp"), "w") as fh:
            fh.write(digest())
        os.rename(os.path.join(wd, name + ".tmp"), os.path.join(wd, name))

    write("expected_sha")
    child = 0
    if args.fork_child:
        child = os.fork()
        if child == 0:
            half = len(regions[0]) // 2
            regions[0][:half] = bytes((i * 31 + 5) % 253 for i in range(4096)) * (half // 4096)
            signal.signal(signal.SIGUSR1, lambda *_: write("child_sha_now"))
            write("child_expected_sha")
            while True:
                time.sleep(1)
        while not os.path.exists(os.path.join(wd, "child_expected_sha")):
            time.sleep(0.05)

    def on_usr1(signum: int, frame: object) -> None:
        write("sha_now")
        if child:
            os.kill(child, signal.SIGUSR1)

    def on_usr2(signum: int, frame: object) -> None:
        open(os.path.join(wd, "answer"), "w").close()

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGUSR2, on_usr2)
    open(os.path.join(wd, "ready"), "w").close()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
