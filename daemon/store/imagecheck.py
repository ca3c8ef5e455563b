"""The check of a snapshot's image files before its restore runs them (``SnapshotStore.verify``).

Every file's size is checked first. Then each file's digest is either

- trusted: a file on a root-only RAM store that this daemon hashed and that has not changed since
  (``store.verified``; hashed again in the background);
- checked now, before CRIU runs: every file CRIU parses, and everything the caller does not defer;
- checked later: files the caller defers, whose digests are computed on the ``digest`` lane while CRIU
  runs; :meth:`ImageCheck.wait` raises when one does not match. A restore defers only data no code reads
  before the restored tasks run (CRIU's page images, ``checksum.RAW_PAGES``, and the /dev/shm files copied
  into the tree's private /dev/shm), and waits at CRIU's ``pre-resume`` (every task restored, none has run an
  instruction), so no restored task runs unless every digest matched (docs/security.md, "Image integrity").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Executor
from pathlib import Path

import structlog

from gpusnap.daemon.api.errors import DataLossError
from gpusnap.daemon.api.types import ImageFile, Snapshot
from gpusnap.daemon.executor import check_wait
from gpusnap.daemon.store import checksum
from gpusnap.daemon.store.verified import Status, VerifiedOnce

log = structlog.get_logger(__name__)


def raise_damaged(snapshot: Snapshot, bad: Sequence[str]) -> None:
    """Raise DataLossError (``IMAGE_CHECKSUM``) naming the damaged files in ``bad``, if any."""
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise DataLossError(
            f"snapshot {snapshot.id} is damaged ({shown}); it cannot be restored: delete it and checkpoint again",
            reason="IMAGE_CHECKSUM",
            # the damaged files by name ("pages-1.img: checksum mismatch" -> "pages-1.img")
            metadata={
                "snapshot": snapshot.id,
                "files": ",".join(b.partition(":")[0] for b in bad[:20]),
                "damaged_count": str(len(bad)),
            },
        )


class ImageCheck:
    """The digests :func:`start` left to compute while CRIU runs, and the trusted files to re-check after."""

    def __init__(
        self,
        snapshot: Snapshot,
        images_dir: Path,
        pool: Executor,
        verified: VerifiedOnce,
        later: Sequence[tuple[ImageFile, Status]] = (),
        trusted: Sequence[tuple[ImageFile, Status]] = (),
        hashed_bytes: int = 0,
    ):
        self.snapshot, self.images_dir, self.pool, self.verified = snapshot, images_dir, pool, verified
        self.later, self.trusted = tuple(later), tuple(trusted)
        self.hashed_bytes = hashed_bytes
        """Bytes hashed before CRIU ran."""
        self._pending = checksum.start_digests([images_dir / f.path for f, _ in self.later], pool)
        self._bad: list[str] | None = None
        self._lock = threading.Lock()

    @property
    def later_bytes(self) -> int:
        """Bytes hashed while CRIU runs."""
        return sum(f.size_bytes for f, _ in self.later)

    @property
    def trusted_bytes(self) -> int:
        """Bytes not hashed: verified once before (``store.verified``)."""
        return sum(f.size_bytes for f, _ in self.trusted)

    def wait(self) -> None:
        """Wait for the deferred digests (the first call; later ones give the same answer at once), then queue
        the background re-checks of the trusted files.

        Raises:
            DataLossError: reason ``IMAGE_CHECKSUM``, naming the files whose digests do not match (or could
                not be read).
        """
        with self._lock:
            if self._bad is None:
                self._bad = self._collect()
        raise_damaged(self.snapshot, self._bad)

    def _collect(self) -> list[str]:
        check_wait(self.pool)
        files = [f for f, _ in self.later]
        try:
            digests = self._pending.result()
        except (OSError, CancelledError) as exc:
            return [f"{f.path}: unreadable ({exc})" for f in files]
        bad = checksum.digest_mismatches(files, digests)
        for (f, st), d in zip(self.later, digests, strict=True):
            if d == f.sha256:
                self.verified.remember(st, self.images_dir / f.path, d)
        for f, st in self.trusted:
            self.verified.recheck(self.images_dir / f.path, st)
        return bad


def start(
    snapshot: Snapshot,
    images_dir: Path,
    pool: Executor,
    verified: VerifiedOnce,
    later: Callable[[str], bool],
    progress: checksum.Progress | None = None,
) -> ImageCheck:
    """Check ``snapshot``'s image files (module docstring): every size, and the digests of the files neither
    trusted nor picked by ``later`` (called with the path relative to ``images_dir``) now, telling
    ``progress``; the rest queued.

    Raises:
        DataLossError: reason ``IMAGE_CHECKSUM``: a file is missing, of the wrong size, or one checked now has
            the wrong digest.
        RuntimeError: called from a lane that may not wait on ``pool`` (``executor.check_wait``).
    """
    bad, sized = checksum.size_mismatches(images_dir, snapshot.files)
    raise_damaged(snapshot, bad)
    now: list[tuple[ImageFile, Status]] = []
    deferred: list[tuple[ImageFile, Status]] = []
    trusted: list[tuple[ImageFile, Status]] = []
    for f in sized:
        try:
            st = Status.of(images_dir / f.path)
        except FileNotFoundError:
            raise_damaged(snapshot, [f"{f.path}: missing"])
            raise  # (raise_damaged raised)
        if verified.trusted(st, f.sha256):
            trusted.append((f, st))
        else:
            (deferred if later(f.path) else now).append((f, st))
    digests = checksum.file_digests([images_dir / f.path for f, _ in now], pool, progress)
    for (f, st), d in zip(now, digests, strict=True):
        if d == f.sha256:
            verified.remember(st, images_dir / f.path, d)
    raise_damaged(snapshot, checksum.digest_mismatches([f for f, _ in now], digests))
    check = ImageCheck(
        snapshot, images_dir, pool, verified, deferred, trusted, hashed_bytes=sum(f.size_bytes for f, _ in now)
    )
    log.debug(
        "store.images_checked",
        snapshot_id=snapshot.id,
        hashed_bytes=check.hashed_bytes,
        later_bytes=check.later_bytes,
        trusted_bytes=check.trusted_bytes,
    )
    return check
