"""Digests of image files: SHA-256 over fixed-size chunks, computed on all cores.

CRIU writes one pages file per process, so a 16 GiB GPU worker yields one ~18 GB file; a plain
sequential SHA-256 of it took 18.5 s on an H200 host (gpusnap measurement, 2026-11-29). gpusnap
therefore digests each file as a hash list: every ``CHUNK_BYTES`` chunk is hashed with SHA-256 in
parallel (hashlib releases the GIL), and the file's digest is the SHA-256 of the concatenated chunk
digests, prefixed by the chunk size. It keeps SHA-256's collision resistance and runs at the
machine's aggregate hashing speed. Manifests name the scheme (``DIGEST_ALGORITHM``).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future, as_completed
from pathlib import Path

from gpusnap.daemon.api.types import ImageFile
from gpusnap.daemon.executor import check_wait

CHUNK_BYTES = 16 << 20
RAW_PAGES = re.compile(r"pages-[0-9]+\.img")
"""CRIU's page images (``pages-<id>.img``: ``CR_FD_PAGES``, magic ``RAW_IMAGE_MAGIC`` in CRIU 4.2's
criu/image-desc.c and criu/include/magic.h): raw page contents that CRIU copies into the restored memory
and never parses. Every other image (protobuf entries, and the other raw ones: ``ip``'s, ``tar``'s and
``iptables-restore``'s input) is parsed by CRIU or a tool it runs."""
DIGEST_ALGORITHM = "sha256-list-16MiB"
"""sha256(b"16777216:" + sha256(chunk_0) + sha256(chunk_1) + …); an empty file hashes no chunk."""


def hash_chunk(path: Path, offset: int) -> bytes:
    """The SHA-256 of the ``CHUNK_BYTES`` chunk of ``path`` at ``offset`` (a multiple of ``CHUNK_BYTES``)."""
    with open(path, "rb") as fh:
        size = min(CHUNK_BYTES, os.fstat(fh.fileno()).st_size - offset)
        if size <= 0:
            return hashlib.sha256().digest()
        with mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ, offset=offset) as mm:
            return hashlib.sha256(mm).digest()


def combine(chunks: Sequence[bytes]) -> str:
    """The ``DIGEST_ALGORITHM`` digest of a file whose ``CHUNK_BYTES`` chunks have the SHA-256 ``chunks``."""
    return hashlib.sha256(f"{CHUNK_BYTES}:".encode() + b"".join(chunks)).hexdigest()


def chunk_count(size: int) -> int:
    """How many ``CHUNK_BYTES`` chunks a file of ``size`` bytes has (0 for an empty file)."""
    return -(-size // CHUNK_BYTES)


Progress = Callable[[int, int], None]
"""Called with (bytes digested so far, bytes to digest) as chunks finish."""


class PendingDigests:
    """Digests being computed on a pool (:func:`start_digests`): :meth:`result` waits for them."""

    def __init__(self, jobs: list[list[Future[bytes]]]):
        self._jobs = jobs

    def result(self) -> list[str]:
        """The ``DIGEST_ALGORITHM`` digests, in the order of the paths given.

        Raises:
            OSError: a file cannot be read.
        """
        return [combine([f.result() for f in chunks]) for chunks in self._jobs]


def start_digests(paths: Sequence[Path], pool: Executor) -> PendingDigests:
    """Queue every chunk of every file of ``paths`` on ``pool`` and return at once; the caller may then wait
    for them from any thread that may wait on ``pool`` (``executor.check_wait``).

    Raises:
        OSError: a file cannot be stat'ed.
    """
    return PendingDigests(
        [[pool.submit(hash_chunk, p, off) for off in range(0, p.stat().st_size, CHUNK_BYTES)] for p in paths]
    )


def file_digests(paths: Sequence[Path], pool: Executor, progress: Progress | None = None) -> list[str]:
    """The ``DIGEST_ALGORITHM`` digests of ``paths`` (lowercase hex), every chunk of every file in
    parallel on ``pool`` (gpusnapd's: a lane of ``gpusnap.daemon.executor``, kept between calls: a pool per
    call started its threads inside every verify and every dump, ``make bench-overhead``). Never call it
    from a task of ``pool`` itself: it waits for ``pool``'s tasks. ``progress`` hears of every chunk done.

    Raises:
        OSError: a file cannot be read.
        RuntimeError: called from a task of a lane that may not wait on ``pool`` (``executor.check_wait``).
    """
    check_wait(pool)
    sizes = [p.stat().st_size for p in paths]
    jobs = [
        [pool.submit(hash_chunk, p, off) for off in range(0, size, CHUNK_BYTES)]
        for p, size in zip(paths, sizes, strict=True)
    ]
    if progress is not None:
        total, done = sum(sizes), 0
        chunk_bytes = {
            f: min(CHUNK_BYTES, size - i * CHUNK_BYTES)
            for chunks, size in zip(jobs, sizes, strict=True)
            for i, f in enumerate(chunks)
        }
        for f in as_completed(chunk_bytes):
            done += chunk_bytes[f]
            progress(done, total)
    return [combine([f.result() for f in chunks]) for chunks in jobs]


def image_files(images_dir: Path, pool: Executor, progress: Progress | None = None) -> tuple[ImageFile, ...]:
    """Describe every regular file under ``images_dir`` (sorted by path) with size and digest (its chunks
    hashed on ``pool``: :func:`file_digests`, telling ``progress``)."""
    paths = sorted(p for p in images_dir.rglob("*") if p.is_file() and not p.is_symlink())
    digests = file_digests(paths, pool, progress)
    return tuple(
        ImageFile(path=str(p.relative_to(images_dir)), size_bytes=p.stat().st_size, sha256=d)
        for p, d in zip(paths, digests, strict=True)
    )


def size_mismatches(images_dir: Path, files: Iterable[ImageFile]) -> tuple[list[str], list[ImageFile]]:
    """One line per file of ``files`` that is missing under ``images_dir`` or of the wrong size, and the files
    that have their sizes (whose digests are still to check)."""
    out, sized = [], []
    for f in files:
        try:
            size = (images_dir / f.path).stat().st_size
        except FileNotFoundError:
            out.append(f"{f.path}: missing")
            continue
        if size != f.size_bytes:
            out.append(f"{f.path}: {size} bytes, expected {f.size_bytes}")
        else:
            sized.append(f)
    return out, sized


def digest_mismatches(files: Sequence[ImageFile], digests: Sequence[str]) -> list[str]:
    """One line per file of ``files`` whose digest in ``digests`` (same order) is not the recorded one."""
    return [f"{f.path}: checksum mismatch" for f, d in zip(files, digests, strict=True) if d != f.sha256]


def mismatches(
    images_dir: Path, files: Iterable[ImageFile], pool: Executor, progress: Progress | None = None
) -> list[str]:
    """Return one line per file that is missing, of the wrong size or with the wrong digest (hashed on
    ``pool``: :func:`file_digests`, telling ``progress``)."""
    out, sized = size_mismatches(images_dir, files)
    digests = file_digests([images_dir / f.path for f in sized], pool, progress)
    return out + digest_mismatches(sized, digests)
