"""A tmpfs of the benchmark's own, mounted for its run (root only): a RAM store for gpusnapd (its snapshots and
buffers in memory, mode 0700), as bench/verify_bench.py and bench/vllm_cpu_bench.py use it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def mounted(where: Path, size_mb: int) -> Iterator[Path]:
    """Mount a tmpfs of ``size_mb`` MiB (mode 0700) on ``where`` (created) until the block ends (lazy unmount).

    Raises:
        subprocess.CalledProcessError: ``mount`` failed (not root, no tmpfs).
    """
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
