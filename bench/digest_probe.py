"""Probe: SHA-256 against BLAKE3 for the image digest on this CPU (issue 25, item 1: a faster digest for new snapshots?).

Hashes one ``--gib`` GiB file on a tmpfs (in the page cache: what a RAM store or a just-written image is)
as the image digest does, a hash list over ``checksum.CHUNK_BYTES`` chunks hashed on a pool of ``--threads``
threads (each chunk mmapped), with hashlib's SHA-256 (OpenSSL; sha_ni) and with the ``blake3`` package
(Rust, AVX-512) per chunk, and BLAKE3 of the whole file on its own threads; ``--rounds`` times, interleaved.
Needs ``pip install blake3`` (not a dependency of gpusnap). JSON: bench/results/digest-probe-[<label>-]<date>.json
with GB/s per variant (best and median).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import results_file  # noqa: E402
from gpusnap.daemon.store import checksum  # noqa: E402

Hasher = Callable[[Any], bytes]


def _chunked(path: Path, pool: ThreadPoolExecutor, digest: Hasher) -> None:
    def one(off: int) -> bytes:
        with (
            open(path, "rb") as fh,
            mmap.mmap(fh.fileno(), min(checksum.CHUNK_BYTES, size - off), access=mmap.ACCESS_READ, offset=off) as mm,
        ):
            return digest(mm)

    size = path.stat().st_size
    list(pool.map(one, range(0, size, checksum.CHUNK_BYTES)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm", help="a tmpfs for the file")
    results_file.add_arguments(ap)
    a = ap.parse_args()
    blake3: Any = importlib.import_module("blake3")  # pip install blake3 (a probe: not a dependency)

    path = Path(a.dir) / f"gpusnap-digest-probe-{os.getpid()}"
    size = int(a.gib * (1 << 30))
    with open(path, "wb") as fh:
        block = os.urandom(1 << 20)
        for _ in range(size >> 20):
            fh.write(block)

    def sha(b: Any) -> bytes:
        return hashlib.sha256(b).digest()

    def b3(b: Any) -> bytes:
        return bytes(blake3.blake3(b).digest())

    variants: dict[str, Callable[[], None]] = {}
    for n in sorted({1, a.threads}):
        pool = ThreadPoolExecutor(n)
        variants[f"sha256-list-{n}t"] = functools.partial(_chunked, path, pool, sha)
        variants[f"blake3-list-{n}t"] = functools.partial(_chunked, path, pool, b3)

    def whole() -> None:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            blake3.blake3(mm, max_threads=blake3.blake3.AUTO).digest()

    variants["blake3-whole-auto"] = whole
    secs: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for _ in range(a.rounds):
            for name, fn in variants.items():
                t = time.perf_counter()
                fn()
                secs[name].append(time.perf_counter() - t)
    finally:
        path.unlink(missing_ok=True)
    rate = {
        k: {"best_gb_s": size / min(v) / 1e9, "median_gb_s": size / statistics.median(v) / 1e9} for k, v in secs.items()
    }
    doc = {
        "host": {"cpus": len(os.sched_getaffinity(0))},
        "bytes": size,
        "rounds": a.rounds,
        "seconds": secs,
        "rate": rate,
    }
    for k, v in rate.items():
        print(f"{k:22s} best {v['best_gb_s']:.2f} GB/s  median {v['median_gb_s']:.2f} GB/s")
    results_file.write(doc, "digest-probe", a.out, a.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
