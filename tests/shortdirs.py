"""Short, world-traversable temporary directories, removed when the test session ends.

pytest's ``tmp_path`` is long (a Unix socket path must fit ``sockaddr_un``'s 108 bytes) and sits under root's
0700 ``/tmp/pytest-of-root``, which the test users cannot traverse. Tests that need a socket directory or a
directory another user may reach make one here instead of calling ``tempfile.mkdtemp`` themselves, so that
none is left in ``/tmp`` after the run (conftest's ``pytest_sessionfinish`` calls :func:`remove_all`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

_made: list[Path] = []


def short_dir(prefix: str, mode: int = 0o755, parent: str | None = None) -> Path:
    """A fresh directory ``<parent or the temp dir>/<prefix>XXXXXXXX`` with ``mode``, removed at session end."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(d, mode)
    _made.append(d)
    return d


def remove_all() -> None:
    """Remove every directory :func:`short_dir` made (whatever is inside, whoever owns it)."""
    while _made:
        shutil.rmtree(_made.pop(), ignore_errors=True)
