"""Plain CRIU through its command line, with the options gpusnapd gives it: the baseline the benchmarks
hold gpusnap against (bench/overhead_bench.py, bench/vllm_cpu_bench.py).

A dump kills the tree (no ``--leave-running``); a restore (``-d``) returns once the tree runs, detached, in
the caller's PID namespace, and names its root in ``--pidfile``. Each writes its log into the images
directory, whose last timestamp is CRIU's own run time (:func:`log_seconds`).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.conftest import criu_prefix

OPTS = ["--shell-job", "--ext-unix-sk", "--file-locks", "--link-remap", "-v4"]
"""What ``CriuDriver`` sets for both actions (``gpusnap.daemon.drivers.criu``)."""
_STAMP = re.compile(rb"^\((\d+\.\d+)\)", re.M)


def binary() -> str:
    """The CRIU of the prefix the tests use (``GPUSNAP_CRIU_PREFIX``, default ``.criu``)."""
    return str(criu_prefix() / "bin" / "criu")


def dump(pid: int, images: Path, *extra: str) -> None:
    """``criu dump -t PID`` into ``images`` (created), ``dump.log`` beside them; the tree is killed.

    Raises:
        AssertionError: CRIU failed; its last errors are in the message.
    """
    images.mkdir(parents=True, exist_ok=True)
    cmd = [binary(), "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "--ghost-limit", str(1 << 30)]
    _run([*cmd, "--timeout", "10", *OPTS, *extra], images / "dump.log", "dump")


def restore(images: Path, *extra: str) -> int:
    """``criu restore -d`` of ``images`` (``restore.log`` beside them); returns the restored root's PID.

    Raises:
        AssertionError: CRIU failed; its last errors are in the message.
    """
    pidfile = images / "restored.pid"
    pidfile.unlink(missing_ok=True)
    cmd = [binary(), "restore", "-d", "-D", str(images), "-o", "restore.log", "--pidfile", str(pidfile)]
    _run([*cmd, *OPTS, *extra], images / "restore.log", "restore")
    return int(pidfile.read_text())


def _run(cmd: list[str], log: Path, action: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        text = log.read_text(errors="replace") if log.exists() else res.stderr
        errors = [ln for ln in text.splitlines() if "Error" in ln] or text.splitlines()[-5:]
        raise AssertionError(f"plain CRIU {action} failed: {errors[-3:]}")


def log_seconds(path: Path) -> float:
    """CRIU's own run time: the timestamp of its log's last stamped line (seconds since it started)."""
    stamps = _STAMP.findall(path.read_bytes())
    return float(stamps[-1]) if stamps else 0.0
