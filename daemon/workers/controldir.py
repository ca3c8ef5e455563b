"""The control-directory contract of NVIDIA Dynamo Snapshot workers, played by gpusnapd.

Files in ``SNAPSHOT_CONTROL_DIR`` (prior-art.md §(c), ai-dynamo/dynamo ``docs/reference/workload-contract.md``):
the worker writes ``ready-for-snapshot`` once quiesced; the agent writes ``snapshot-complete`` (the
source may exit) and ``restore-complete`` (resume now), plus ``restore-context.json``
(``{"version": 1, "env": {NAME: value or null}}``). Writers use a temporary file and a rename;
existence is the signal.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpusnap.daemon.api.errors import DeadlineExceededError, InvalidArgumentError

READY = "ready-for-snapshot"
SNAPSHOT_COMPLETE = "snapshot-complete"
RESTORE_COMPLETE = "restore-complete"
RESTORE_CONTEXT = "restore-context.json"
POLL_S = 0.1


def check_dir(control_dir: str) -> Path:
    """The control directory, which must be an absolute path to an existing directory.

    Raises:
        InvalidArgumentError: reason ``BAD_CONTROL_DIR``.
    """
    path = Path(control_dir)
    if not path.is_absolute() or not path.is_dir():
        raise InvalidArgumentError(
            f"control directory {control_dir!r} is not an existing absolute directory; pass the worker's "
            "SNAPSHOT_CONTROL_DIR",
            reason="BAD_CONTROL_DIR",
        )
    return path


def wait_ready(control_dir: Path, timeout_s: float, alive: object) -> None:
    """Wait for ``ready-for-snapshot`` (the worker has quiesced).

    Args:
        alive: ``() -> bool``; waiting stops early when the worker dies.

    Raises:
        DeadlineExceededError: reason ``WORKER_NOT_READY``.
    """
    deadline = time.monotonic() + timeout_s
    while not (control_dir / READY).exists():
        if time.monotonic() > deadline or not alive():  # type: ignore[operator]
            raise DeadlineExceededError(
                f"the worker did not write {control_dir / READY} within {timeout_s:.0f} s; it must quiesce and "
                "signal readiness (Dynamo Snapshot worker contract)",
                reason="WORKER_NOT_READY",
            )
        time.sleep(POLL_S)


def clear(control_dir: Path, *names: str) -> None:
    """Remove stale signal files."""
    for name in names:
        try:
            (control_dir / name).unlink()
        except FileNotFoundError:
            pass


def signal_file(control_dir: Path, name: str, content: str = "") -> None:
    """Create ``name`` atomically (temp file + rename)."""
    tmp = control_dir / f".{name}.tmp"
    tmp.write_text(content)
    os.rename(tmp, control_dir / name)


def write_context(control_dir: Path, env: Mapping[str, str], unset_env: Sequence[str]) -> None:
    """Write ``restore-context.json``: env to set, and ``null`` for env to unset."""
    doc: dict[str, object] = {"version": 1, "env": {**dict(env), **{name: None for name in unset_env}}}
    signal_file(control_dir, RESTORE_CONTEXT, json.dumps(doc))
