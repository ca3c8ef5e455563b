"""The control-directory contract of NVIDIA Dynamo Snapshot workers, played by gpusnapd.

Files in ``SNAPSHOT_CONTROL_DIR`` (docs/engines.md, "Workers written to NVIDIA Dynamo Snapshot's
control-directory contract"; ai-dynamo/dynamo ``docs/reference/workload-contract.md``):
the worker writes ``ready-for-snapshot`` once quiesced; the agent writes ``snapshot-complete`` (the
source may exit) and ``restore-complete`` (resume now), plus ``restore-context.json``
(``{"version": 1, "env": {NAME: value or null}}``). Writers use a temporary file and a rename;
existence is the signal.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gpusnap.daemon.access import safefs
from gpusnap.daemon.api.errors import DeadlineExceededError, InvalidArgumentError

READY = "ready-for-snapshot"
SNAPSHOT_COMPLETE = "snapshot-complete"
RESTORE_COMPLETE = "restore-complete"
RESTORE_CONTEXT = "restore-context.json"
POLL_S = 0.1


def check_dir(control_dir: str, owner_uid: int) -> Path:
    """The control directory: an absolute path to a directory (not a symlink) of ``owner_uid`` or root.

    Raises:
        InvalidArgumentError: reason ``BAD_CONTROL_DIR``.
        PermissionDeniedError: someone else's directory (reason ``NOT_OWNER``).
    """
    try:
        with safefs.open_dir(control_dir, owner_uid):
            return Path(control_dir)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(
            f"control directory {control_dir!r} is not usable ({exc}); pass the worker's SNAPSHOT_CONTROL_DIR",
            reason="BAD_CONTROL_DIR",
        ) from exc


def wait_ready(control_dir: Path, timeout_s: float, alive: Callable[[], bool]) -> None:
    """Wait for ``ready-for-snapshot`` (the worker has quiesced).

    Args:
        alive: waiting stops early when the worker dies.

    Raises:
        DeadlineExceededError: reason ``WORKER_NOT_READY``.
    """
    deadline = time.monotonic() + timeout_s
    while not (control_dir / READY).exists():
        if time.monotonic() > deadline or not alive():
            raise DeadlineExceededError(
                f"the worker did not write {control_dir / READY} within {timeout_s:g} s; it must quiesce and "
                "signal readiness (Dynamo Snapshot worker contract)",
                reason="WORKER_NOT_READY",
            )
        time.sleep(POLL_S)


def clear(control_dir: Path, owner_uid: int, *names: str) -> None:
    """Remove stale signal files."""
    with safefs.open_dir(control_dir, owner_uid) as fd:
        for name in names:
            safefs.remove(fd, name)


def signal_file(control_dir: Path, owner_uid: int, name: str, content: str = "") -> None:
    """Create ``name`` atomically, never through a symlink."""
    with safefs.open_dir(control_dir, owner_uid) as fd:
        safefs.create(fd, name, content)


def write_context(control_dir: Path, owner_uid: int, env: Mapping[str, str], unset_env: Sequence[str]) -> None:
    """Write ``restore-context.json``: env to set, and ``null`` for env to unset."""
    doc: dict[str, object] = {"version": 1, "env": {**dict(env), **{name: None for name in unset_env}}}
    signal_file(control_dir, owner_uid, RESTORE_CONTEXT, json.dumps(doc))
