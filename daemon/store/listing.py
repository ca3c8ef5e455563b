"""Reading a directory that another lane deletes from: what is gone by the time it is looked at is skipped.

The store's directories are listed while other threads remove from them: the garbage collector and the
tiers' eviction remove blobs (and empty user directories), ``rm`` removes snapshots, an expiring or
finishing pull removes its work. A listing is a snapshot of names, so a name may be gone by the time it is
stat'ed or opened (``FileNotFoundError``): these helpers count such an entry as gone instead of failing the
call that listed it (a ``gpusnap store`` once logged a traceback: issue 26, item 10).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from stat import S_ISDIR, S_ISREG


def entries(directory: Path) -> list[Path]:
    """The entries of ``directory``; none when it is gone."""
    try:
        return list(directory.iterdir())
    except FileNotFoundError:
        return []


def stat(path: Path) -> os.stat_result | None:
    """``path``'s ``lstat``; ``None`` when it is gone."""
    try:
        return path.lstat()
    except FileNotFoundError:
        return None


def files(root: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """Every regular file under ``root`` (``root`` itself, if it is one) with its ``lstat``, skipping what is
    removed meanwhile; symlinks are not followed."""
    top = stat(root)
    if top is None:
        return
    if not S_ISDIR(top.st_mode):
        if S_ISREG(top.st_mode):
            yield root, top
        return
    for dirpath, _dirs, names in os.walk(root):  # a directory removed meanwhile is skipped (onerror: None)
        for name in names:
            path = Path(dirpath) / name
            st = stat(path)
            if st is not None and S_ISREG(st.st_mode):
                yield path, st


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (as :func:`files`)."""
    return sum(st.st_size for _, st in files(root))
