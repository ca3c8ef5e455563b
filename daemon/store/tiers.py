"""Tiers of the buffer store: where a blob lives, how full each place is, and LRU eviction downwards.

With ``--buffer-dir`` on a tmpfs, the buffer store has two tiers: the RAM tier (``buffer_dir``) and the
disk tier (``<store>/buffers``); without it, the disk tier alone. Each tier has the same layout
(``sha256/<uid>/<digest>``, ``incoming/``) and an optional byte budget (``ram_tier_bytes``,
``disk_tier_bytes``; 0 = bounded by free space only). New blobs go to the fastest tier whose budget
they fit; when a tier is over its budget, its least recently used blobs that no operation has pinned
move to the next tier (copied and fsynced there before the faster copy goes, so a reader always finds
one). Reads use the fastest tier holding a blob; a restore marks the blobs it reads as used. With a
remote store, the disk tier over its budget drops its least recently used unpinned blobs that are safely
there, and restores fetch them back (``gpusnap.daemon.remote.evict``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import structlog

from gpusnap.daemon.store import listing
from gpusnap.daemon.store.durable import fsync_dir

log = structlog.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class Tier:
    """One place blobs live. ``budget_bytes`` 0 means no budget (free space bounds it)."""

    name: str
    root: Path
    budget_bytes: int = 0

    @property
    def blobs(self) -> Path:
        return self.root / "sha256"

    @property
    def incoming(self) -> Path:
        return self.root / "incoming"

    def blob_files(self, uid: int | None = None) -> Iterator[tuple[str, Path]]:
        """(``<uid>/<digest>``, path) of every blob in this tier (of user ``uid`` only, when given); a user
        directory the garbage collector removes meanwhile is skipped (``store.listing``)."""
        for user_dir in listing.entries(self.blobs):
            if uid is not None and user_dir.name != str(uid):
                continue
            for blob in listing.entries(user_dir):
                yield f"{user_dir.name}/{blob.name}", blob

    def blob_stats(self, uid: int | None = None) -> Iterator[tuple[str, Path, os.stat_result]]:
        """:meth:`blob_files` with each blob's ``lstat``; a blob collected or evicted meanwhile is skipped."""
        for key, path in self.blob_files(uid):
            st = listing.stat(path)
            if st is not None:
                yield key, path, st

    def used_bytes(self, uid: int | None = None) -> int:
        """Bytes of this tier's blobs (of user ``uid`` only, when given)."""
        return sum(st.st_size for _, _, st in self.blob_stats(uid))

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def room_for(self, need: int) -> bool:
        """Whether ``need`` more bytes fit this tier's budget (eviction may have to make the room) and
        its file system."""
        return (self.budget_bytes == 0 or need <= self.budget_bytes) and need <= self.free_bytes()


@dataclasses.dataclass(frozen=True)
class TierUsage:
    """One row of ``gpusnap store``: a tier's use (or, named ``remote``, the blobs only the remote holds)."""

    name: str
    path: str
    used_bytes: int
    budget_bytes: int
    free_bytes: int
    blobs: int

    @classmethod
    def of(cls, tier: Tier, uid: int | None = None) -> TierUsage:
        """``tier``'s use by the blobs of ``uid`` (None: of everyone)."""
        files = [st for _, _, st in tier.blob_stats(uid)]
        return cls(
            tier.name,
            str(tier.root),
            sum(st.st_size for st in files),
            tier.budget_bytes,
            tier.free_bytes(),
            len(files),
        )


def move(key: str, src: Path, dst_tier: Tier, guard: AbstractContextManager[object] | None = None) -> bool:
    """Copy blob ``key`` from ``src`` into ``dst_tier`` (fsynced, renamed into place), then remove ``src``.
    Returns False when the source went away meanwhile (collected). ``guard``: held while the user directory is
    made and the copy renamed into it (the lock under which the garbage collector removes empty ones)."""
    target = dst_tier.blobs / key
    if not target.exists():
        tmp = dst_tier.incoming / f"evict-{secrets.token_hex(8)}"
        try:
            with open(src, "rb") as fi, open(tmp, "xb") as fo:
                shutil.copyfileobj(fi, fo, 16 << 20)
                fo.flush()
                os.fsync(fo.fileno())
        except FileNotFoundError:
            tmp.unlink(missing_ok=True)
            return False
        os.chmod(tmp, 0o400)
        with guard or contextlib.nullcontext():
            target.parent.mkdir(mode=0o700, exist_ok=True)
            os.rename(tmp, target)
        fsync_dir(target.parent)
    src.unlink(missing_ok=True)
    return True


def eviction_order(
    tier: Tier, pinned: set[str], rank: Callable[[str], int] | None = None
) -> list[tuple[str, Path, int]]:
    """Unpinned blobs of ``tier``, lowest ``rank`` first (the park ladder's priority of the snapshots using a
    blob; none: all equal), least recently used first within a rank: (key, path, size)."""
    found = []
    for key, path, st in tier.blob_stats():
        if key not in pinned:
            found.append((rank(key) if rank is not None else 0, st.st_mtime, key, path, st.st_size))
    return [(k, p, s) for _, _, k, p, s in sorted(found)]


def mark_used(path: Path) -> None:
    """Record a read for LRU order (the modification time; tmpfs and ``relatime`` make atime unreliable)."""
    try:
        os.utime(path)
    except OSError:
        pass
