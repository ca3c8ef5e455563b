"""sha256 of image files, several files at once (hashlib releases the GIL while hashing)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpusnap.daemon.api.types import ImageFile

_WORKERS = 8


def file_sha256(path: Path) -> str:
    """Lowercase hex sha256 of ``path``'s content."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def image_files(images_dir: Path) -> tuple[ImageFile, ...]:
    """Describe every regular file under ``images_dir`` (sorted by path) with size and sha256."""
    paths = sorted(p for p in images_dir.rglob("*") if p.is_file() and not p.is_symlink())
    with ThreadPoolExecutor(max_workers=_WORKERS) as pool:
        digests = list(pool.map(file_sha256, paths))
    return tuple(
        ImageFile(path=str(p.relative_to(images_dir)), size_bytes=p.stat().st_size, sha256=d)
        for p, d in zip(paths, digests, strict=True)
    )


def mismatches(images_dir: Path, files: Iterable[ImageFile]) -> list[str]:
    """Return one line per file that is missing, of the wrong size or with the wrong sha256."""
    expected = list(files)

    def check(f: ImageFile) -> str | None:
        path = images_dir / f.path
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{f.path}: missing"
        if size != f.size_bytes:
            return f"{f.path}: {size} bytes, expected {f.size_bytes}"
        if file_sha256(path) != f.sha256:
            return f"{f.path}: sha256 mismatch"
        return None

    with ThreadPoolExecutor(max_workers=_WORKERS) as pool:
        return [r for r in pool.map(check, expected) if r is not None]
